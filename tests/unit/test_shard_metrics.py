"""Per-shard gauges go away with the shard: ShardTasks removes a lost shard's series of the
gauges its role registered (after the shard's loop stopped), and Service removes the
lost shard's noetl_shard_owner series. Admission's gauges are refreshed by ``measure``
without any submission."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Gauge
from waiting import until

from noetl_api.admission import ACTIVE, QUEUED, Admission
from noetl_common.config import CoreSettings, ShardSettings
from noetl_common.service import SHARD_OWNER, Service
from noetl_common.shardtasks import ShardTasks, forget_on_loss

# A registry of its own: the runtime's registry holds the runtime's metrics only
# (test_metric_conventions.py walks it).
TEST_REGISTRY = CollectorRegistry()
LAG = forget_on_loss("unit-role", Gauge("unit_test_lag_seconds", "test gauge", ["shard"], registry=TEST_REGISTRY))


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def lag(shard: str) -> float | None:
    return TEST_REGISTRY.get_sample_value("unit_test_lag_seconds", {"shard": shard})


class _Worker:
    def __init__(self, shard: int, epoch: int) -> None:
        self.shard, self.epoch = shard, epoch
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        LAG.labels(str(self.shard)).set(100 + self.shard)
        await self._stop.wait()
        LAG.labels(str(self.shard)).set(999)  # a last value on the way out: removed after it


async def test_a_lost_shard_drops_its_gauge_series() -> None:
    tasks = ShardTasks("unit-role", _Worker)
    await tasks.apply({1: 1, 2: 1}, set())
    await until(lambda: lag("1") == 101
                and lag("2") == 102, timeout=5,
                what="both loops setting their gauge", interval=0.01)
    await tasks.apply({}, {1})
    assert lag("1") is None
    assert lag("2") == 102
    # a shard whose loop already ended (e.g. it saw the lease lost first) is forgotten too
    LAG.labels("3").set(5)
    await tasks.apply({}, {3})
    assert lag("3") is None
    # another role's loss does not touch this role's gauges
    await ShardTasks("other-role", _Worker).apply({}, {2})
    assert lag("2") == 102
    await tasks.stop_all()


def test_a_lost_shard_has_no_owner_series() -> None:
    svc = Service(CoreSettings(instance="unit-1"), ShardSettings())
    svc.role = "unit"  # type: ignore[misc]
    for s in (4, 5):
        SHARD_OWNER.labels("unit", str(s), "unit-1").set(1)
    svc._owner_lost({4, 6})  # 6 was never exported: no error
    assert sample("noetl_shard_owner", role="unit", shard="4", instance="unit-1") is None
    assert sample("noetl_shard_owner", role="unit", shard="5", instance="unit-1") == 1


class _Pool:
    def __init__(self) -> None:
        self.calls = 0

    @asynccontextmanager
    async def connection(self) -> Any:
        pool = self

        class Conn:
            async def execute(self, query: str, params: Any) -> Any:
                pool.calls += 1

                class Cur:
                    async def fetchone(self) -> dict[str, int]:
                        return {"running": 3 * pool.calls, "waiting": 1, "queued_commands": 7 * pool.calls}

                return Cur()

            async def commit(self) -> None:
                pass

        yield Conn()


async def test_admission_gauges_refresh_without_submissions() -> None:
    pool = _Pool()
    admission = Admission(pool, max_active=100, max_queued=100, refresh_sec=0.0)  # type: ignore[arg-type]
    await admission.measure()
    assert ACTIVE._value.get() == 4 and QUEUED._value.get() == 7  # type: ignore[attr-defined]
    await admission.measure()
    assert ACTIVE._value.get() == 7 and QUEUED._value.get() == 14  # type: ignore[attr-defined]
    fresh = Admission(pool, max_active=100, max_queued=100, refresh_sec=60.0)  # type: ignore[arg-type]
    await fresh.measure()
    await fresh.measure()  # within refresh_sec: no query
    assert pool.calls == 3
