"""Schedules against real Postgres (noetl_db.schedules): a round is fenced on the
reaper lease, fires each tick exactly once across owners and concurrent rounds, and a
recorded tick stays pending (to be submitted with its idempotency key) until an
execution is written back.

Each test moves its schedule to a shard of its own (no role's lease row is touched)."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from noetl_common.db import Pool, autocommit
from noetl_common.errors import Conflict, LeaseLost, NotFound
from noetl_common.schedules import CatchUp, Spec
from noetl_db.schedules import ScheduleStore, idempotency_key

pytestmark = pytest.mark.integration

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
OWNER_A, OWNER_B = 9_000_001, 9_000_002


def s(n: float) -> timedelta:
    return timedelta(seconds=n)


async def _schedule(pool: Pool, store: ScheduleStore, catch_up: CatchUp = CatchUp.ALL,
                    interval_ms: int = 1000) -> tuple[int, int]:
    """A schedule on a shard of its own held by OWNER_A at epoch 1: (schedule_id, shard)."""
    shard = 300_000 + random.randrange(1_000_000)
    row = await store.add(name=f"t-{uuid.uuid4().hex[:10]}", path="tests/sched", version=0, payload={"a": 1},
                          spec=Spec(interval_ms=interval_ms), catch_up=catch_up, paused=False, created_by=None,
                          now=T0)
    async with autocommit(pool) as conn:
        await conn.execute("UPDATE noetl.schedule SET shard_id = %s WHERE schedule_id = %s",
                           (shard, row["schedule_id"]))
        await conn.execute("INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
                           " VALUES ('reaper', %s, %s, 1, now() + interval '1 hour')", (shard, OWNER_A))
    return row["schedule_id"], shard


async def _take_over(pool: Pool, shard: int, owner: int) -> None:
    async with autocommit(pool) as conn:
        await conn.execute("UPDATE noetl.shard_lease SET owner_runtime_id = %s, epoch = epoch + 1"
                           " WHERE role = 'reaper' AND shard_id = %s", (owner, shard))


@pytest.fixture
async def store(pool: Pool) -> ScheduleStore:
    return ScheduleStore(pool, shard_count=16)


async def test_first_tick_is_one_interval_after_add(store: ScheduleStore, pool: Pool) -> None:
    sid, _ = await _schedule(pool, store)
    rows = [r for r in await store.all() if r["schedule_id"] == sid]
    assert rows[0]["next_tick"] == T0 + s(1) and rows[0]["last_tick"] is None


async def test_a_stale_owner_fires_nothing(store: ScheduleStore, pool: Pool) -> None:
    sid, shard = await _schedule(pool, store)
    await _take_over(pool, shard, OWNER_B)
    with pytest.raises(LeaseLost):
        await store.fire_due(shard, OWNER_A, 1, grace_sec=5, now=T0 + s(3.5))
    assert await store.ticks(sid) == []
    got = await store.fire_due(shard, OWNER_B, 2, grace_sec=5, now=T0 + s(3.5))
    assert got.fired == 3
    assert [(t["tick"], t["epoch"]) for t in await store.ticks(sid)] == [(T0 + s(i), 2) for i in (1, 2, 3)]


async def test_every_tick_fires_once_across_concurrent_rounds_and_failovers(store: ScheduleStore,
                                                                            pool: Pool) -> None:
    sid, shard = await _schedule(pool, store)
    owners = [(OWNER_A, 1)]
    for second in range(1, 21):
        now = T0 + s(second + 0.5)
        if second % 5 == 0:  # a failover: the new owner rounds while the old one still tries
            owner = OWNER_B if owners[-1][0] == OWNER_A else OWNER_A
            await _take_over(pool, shard, owner)
            owners.append((owner, owners[-1][1] + 1))
        rounds = [store.fire_due(shard, o, e, grace_sec=5, now=now) for o, e in owners[-2:]] * 2
        results = await asyncio.gather(*rounds, return_exceptions=True)
        assert all(isinstance(r, LeaseLost) for r in results if isinstance(r, Exception))
    ticks = await store.ticks(sid)
    assert [t["tick"] for t in ticks] == [T0 + s(i) for i in range(1, 21)]
    assert {t["epoch"] for t in ticks} == {e for _, e in owners}


async def test_a_recorded_tick_is_pending_until_its_execution_is_written(store: ScheduleStore, pool: Pool) -> None:
    sid, shard = await _schedule(pool, store)
    await store.fire_due(shard, OWNER_A, 1, grace_sec=5, now=T0 + s(1.2))
    pending = (await store.pending([shard])).get(shard, [])
    assert [(p["schedule_id"], p["tick"], p["catalog_path"], p["payload"]) for p in pending] == [
        (sid, T0 + s(1), "tests/sched", {"a": 1})]
    # a crash here: the next owner finds the same tick and submits the same key
    assert [idempotency_key(p["schedule_id"], p["tick"]) for p in (await store.pending([shard])).get(shard, [])] == [
        f"schedule/{sid}/{int((T0 + s(1)).timestamp() * 1000)}"]
    await store.submitted(sid, T0 + s(1), 42)
    await store.submitted(sid, T0 + s(1), 43)  # a late duplicate answer changes nothing
    assert (await store.pending([shard])).get(shard, []) == []
    assert [t["execution_id"] for t in await store.ticks(sid)] == [42]


async def test_a_refused_tick_is_not_pending(store: ScheduleStore, pool: Pool) -> None:
    sid, shard = await _schedule(pool, store)
    await store.fire_due(shard, OWNER_A, 1, grace_sec=5, now=T0 + s(1.2))
    await store.refused(sid, T0 + s(1), "playbook 'tests/sched' not found")
    assert (await store.pending([shard])).get(shard, []) == []
    assert [t["error"] for t in await store.ticks(sid)] == ["playbook 'tests/sched' not found"]


async def test_once_fires_one_run_for_a_missed_stretch(store: ScheduleStore, pool: Pool) -> None:
    sid, shard = await _schedule(pool, store, CatchUp.ONCE)
    got = await store.fire_due(shard, OWNER_A, 1, grace_sec=5, now=T0 + s(30.5))
    assert (got.fired, got.skipped, got.next_due) == (1, 29, T0 + s(31))
    assert [t["tick"] for t in await store.ticks(sid)] == [T0 + s(30)]


async def test_paused_schedules_do_not_fire_and_resume_after_now(store: ScheduleStore, pool: Pool) -> None:
    sid, shard = await _schedule(pool, store)
    name = next(r["name"] for r in await store.all() if r["schedule_id"] == sid)
    assert (await store.pause(name))["paused"] is True
    assert (await store.fire_due(shard, OWNER_A, 1, grace_sec=5, now=T0 + s(10))).fired == 0
    resumed = await store.resume(name, now=T0 + s(10.2))
    assert (resumed["paused"], resumed["next_tick"]) == (False, T0 + s(11.2))
    assert (await store.fire_due(shard, OWNER_A, 1, grace_sec=5, now=T0 + s(11.5))).fired == 1
    assert [t["tick"] for t in await store.ticks(sid)] == [T0 + s(11.2)]


async def test_names_are_unique_and_delete_removes_ticks(store: ScheduleStore, pool: Pool) -> None:
    sid, shard = await _schedule(pool, store)
    name = next(r["name"] for r in await store.all() if r["schedule_id"] == sid)
    with pytest.raises(Conflict, match=r"^name: a schedule named"):
        await store.add(name=name, path="x", version=0, payload={}, spec=Spec(interval_ms=1000),
                        catch_up=CatchUp.SKIP, paused=False, created_by=None)
    await store.fire_due(shard, OWNER_A, 1, grace_sec=5, now=T0 + s(2))
    assert await store.delete(name) is True and await store.delete(name) is False
    assert await store.ticks(sid) == []
    with pytest.raises(NotFound):
        await store.pause(name)
