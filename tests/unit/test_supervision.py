"""Supervised shard loops (ShardTasks), the one retry classifier, and the fault points
tests arm: a crashed loop is started again with capped backoff while its shard is
wanted; a loop that ends on its own waits for the lease to be trusted again; nothing
restarts a shard that was given up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import psycopg
import pytest
from prometheus_client import REGISTRY
from waiting import until

from noetl_common import faults
from noetl_common.errors import Conflict, InvalidInput, LeaseLost, NoetlError, NotFound, Unavailable
from noetl_common.retry import is_transient, retry_transient
from noetl_common.shardtasks import ShardTasks


class Crashy:
    """Crashes its first ``crashes`` runs, then runs until stopped."""

    runs: dict[int, int] = {}
    crashes = 2

    def __init__(self, shard: int, epoch: int) -> None:
        self.shard, self.epoch = shard, epoch
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        n = Crashy.runs[self.shard] = Crashy.runs.get(self.shard, 0) + 1
        if n <= Crashy.crashes:
            raise RuntimeError(f"crash {n}")
        await self._stop.wait()


def restarts(role: str) -> float:
    return REGISTRY.get_sample_value("noetl_shard_loop_restarts_total", {"role": role}) or 0.0


async def test_a_crashed_loop_is_started_again_with_backoff_and_counted() -> None:
    Crashy.runs = {}
    tasks = ShardTasks("unit-crashy", Crashy, restart_backoff=(0.01, 0.05))
    before = restarts("unit-crashy")
    await tasks.apply({1: 1}, set())
    await until(lambda: Crashy.runs.get(1) == 3 and tasks.shards == [1], timeout=5,
                what="shard 1's loop running after two crashes", interval=0.01)
    assert restarts("unit-crashy") == before + 2
    assert tasks.unhealthy(0.0) == []
    await tasks.stop_all()


async def test_a_loop_that_keeps_crashing_is_reported_unhealthy_and_a_lost_shard_is_not_restarted() -> None:
    Crashy.runs = {}
    Crashy.crashes = 10**6
    try:
        tasks = ShardTasks("unit-always", Crashy, restart_backoff=(0.01, 0.02))
        await tasks.apply({2: 1}, set())
        await until(lambda: Crashy.runs.get(2, 0) >= 3, timeout=5, what="shard 2's loop crashing thrice",
                    interval=0.01)
        await until(lambda: tasks.unhealthy(0.0) == [2], timeout=5, what="shard 2 reported unhealthy",
                    interval=0.01)
        await tasks.apply({}, {2})
        runs = Crashy.runs[2]
        await asyncio.sleep(0.1)  # a sleep, not a wait: several restart backoffs in which no restart may happen
        assert Crashy.runs[2] == runs, "a lost shard's loop was started again"
        assert tasks.unhealthy(0.0) == []
    finally:
        Crashy.crashes = 2


class Returns:
    """Returns at once (it found its lease not trusted) its first run, then runs."""

    runs = 0

    def __init__(self, shard: int, epoch: int) -> None:
        self.epoch = epoch
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        Returns.runs += 1
        if Returns.runs > 1:
            await self._stop.wait()


async def test_a_loop_that_ended_starts_again_once_the_lease_is_trusted() -> None:
    trusted = {"now": False}
    tasks = ShardTasks("unit-returns", Returns, still_held=lambda _s, _e: trusted["now"],
                       restart_backoff=(0.01, 0.02))
    await tasks.apply({3: 4}, set())
    await until(lambda: Returns.runs == 1 and not tasks.shards, timeout=5, what="the first run to end",
                interval=0.01)
    await asyncio.sleep(0.05)  # a sleep, not a wait: restart backoffs in which no restart may happen
    assert Returns.runs == 1, "started again while the lease was not trusted"
    trusted["now"] = True
    tasks.ensure()  # the membership loop calls this after every renewal
    await until(lambda: tasks.shards == [3] and Returns.runs == 2, timeout=5,
                what="shard 3's loop started again", interval=0.01)
    await tasks.stop_all()


def test_the_classifier_tells_outages_from_everything_else() -> None:
    assert is_transient(Unavailable("postgres unavailable"))
    assert is_transient(psycopg.OperationalError("server closed the connection"))
    assert is_transient(psycopg.errors.SerializationFailure("could not serialize"))
    assert is_transient(TimeoutError())
    assert is_transient(ConnectionResetError())
    wrapped = NoetlError("store error")
    wrapped.__cause__ = psycopg.OperationalError("reset")
    assert is_transient(wrapped)
    for exc in (InvalidInput("bad"), NotFound("x"), Conflict("race"), LeaseLost("gone"), NoetlError("bug"),
                ValueError("x"), KeyError("k"), psycopg.errors.UniqueViolation("dup")):
        assert not is_transient(exc), exc

    class Rpc(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

    assert is_transient(Rpc(grpc.StatusCode.UNAVAILABLE)) and is_transient(Rpc(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert not is_transient(Rpc(grpc.StatusCode.INVALID_ARGUMENT))


async def test_retry_transient_waits_out_an_outage_and_gives_up_on_anything_else() -> None:
    calls = {"n": 0}

    async def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 3:
            raise Unavailable("down")
        return "ok"

    assert await retry_transient("flaky", flaky, deadline_sec=5, initial=0.01, cap=0.02) == "ok"
    assert calls["n"] == 3

    async def broken() -> str:
        calls["n"] += 1
        raise InvalidInput("never")

    calls["n"] = 0
    with pytest.raises(InvalidInput):
        await retry_transient("broken", broken, deadline_sec=5, initial=0.01)
    assert calls["n"] == 1

    async def down() -> str:
        raise Unavailable("still down")

    with pytest.raises(Unavailable):
        await retry_transient("down", down, deadline_sec=0.1, initial=0.01, cap=0.02)


def test_fault_points_fire_once_or_always(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "READ_EVERY_SEC", 0.0)
    path = tmp_path / "armed"
    path.write_text("engine.loop 3\nengine.input 9 *\n")
    state = faults._Faults()
    state.configure(str(path))
    state.check("engine.loop", 4)  # another shard: nothing
    with pytest.raises(faults.InjectedFault):
        state.check("engine.loop", 3)
    state.check("engine.loop", 3)  # consumed
    assert "engine.loop 3" not in path.read_text()
    for _ in range(3):
        with pytest.raises(faults.InjectedFault):
            state.check("engine.input", 9)
    off = faults._Faults()
    off.check("engine.input", 9)  # no file configured: never fires
