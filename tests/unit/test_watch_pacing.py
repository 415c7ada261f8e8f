"""WatchExecution's pacing (servicers.ExecutionServicer.WatchExecution): a running
execution's read model is read at most every WATCH_MIN_INTERVAL_SEC however often the
projector hints, and at once when a hint says the execution reached a terminal status.
The read model and the hint subscription are stand-ins here: what is tested is when the
servicer reads."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from noetl_api import servicers, watching
from noetl_common import natsio
from noetl_proto.v1 import execution_pb2


class Hints:
    """What the servicer subscribes with: the callback, to be called as the projector's hints."""

    def __init__(self) -> None:
        self.cb: Callable[[Any], Awaitable[None]] | None = None

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        self.cb = cb
        hints = self

        class Sub:
            async def unsubscribe(self) -> None:
                hints.cb = None
        return Sub()

    async def send(self, data: bytes = b"") -> None:
        assert self.cb is not None
        await self.cb(type("Msg", (), {"data": data})())


class ReadModel:
    """A projected execution whose version moves with every read (so every read is sent)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.reads: list[float] = []
        self.checks: list[list[int]] = []
        self.status = "RUNNING"
        self.seq = 0
        self.delay = delay

    async def execution(self, execution_id: int, include_results: bool = False) -> dict[str, Any]:
        self.reads.append(asyncio.get_running_loop().time())
        self.seq += 1
        seq = self.seq
        await asyncio.sleep(self.delay)
        return {"status": self.status, "last_shard_seq": seq, "steps": []}

    async def versions(self, execution_ids: list[int]) -> dict[int, tuple[str, int]]:
        self.checks.append(execution_ids)
        return {1: (self.status, self.seq)}


@pytest.fixture(autouse=True)
def plain_pb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicers, "_execution_pb", lambda row: execution_pb2.Execution(execution_id=1))


async def watch(model: ReadModel, hints: Hints, servicer: servicers.ExecutionServicer | None = None) -> list[Any]:
    servicer = servicer or servicers.ExecutionServicer(None, model, hints, None)  # type: ignore[arg-type]
    return [r async for r in servicer.WatchExecution(execution_pb2.WatchExecutionRequest(execution_id=1), None)]


async def test_frequent_hints_are_coalesced_and_a_terminal_one_is_read_at_once() -> None:
    model, hints = ReadModel(), Hints()
    task = asyncio.create_task(watch(model, hints))
    await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < 0.5:  # a running loop: a hint every 5 ms
        await hints.send()
        await asyncio.sleep(0.005)
    running_reads = len(model.reads)
    assert 3 <= running_reads <= 1 + 0.5 / servicers.WATCH_MIN_INTERVAL_SEC + 2
    model.status = "COMPLETED"
    await hints.send()  # right after a read: still paced
    sent = loop.time()
    await hints.send(natsio.PROGRESS_TERMINAL)
    responses = await asyncio.wait_for(task, timeout=2)
    assert model.reads[-1] - sent < servicers.WATCH_MIN_INTERVAL_SEC / 2  # not held back by the pacing
    assert len(responses) == len(model.reads)  # each read changed the key: each was sent


async def test_without_hints_it_checks_the_version_every_second_and_reads_when_it_moved() -> None:
    model, hints = ReadModel(), Hints()
    task = asyncio.create_task(watch(model, hints))
    await asyncio.sleep(1.2)
    assert len(model.reads) == 1 and 1 <= len(model.checks) <= 2  # checked, nothing moved: not read again
    model.status = "FAILED"  # projected, but its hint was lost
    await asyncio.wait_for(task, timeout=1.5)
    assert len(model.reads) == 2


async def test_the_streams_of_one_execution_share_a_subscription_and_their_reads() -> None:
    model, hints = ReadModel(delay=0.002), Hints()
    servicer = servicers.ExecutionServicer(None, model, hints, None)  # type: ignore[arg-type]
    tasks = [asyncio.create_task(watch(model, hints, servicer)) for _ in range(200)]
    await asyncio.sleep(0.05)
    assert len(model.reads) <= 2  # 200 streams opened together: one read (two if they straddle it)
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < 0.5:  # a hint every 5 ms
        await hints.send()
        await asyncio.sleep(0.005)
    # a few reads per paced round (a hint landing while streams resume asks for a newer
    # one): not one per stream, which was 200 a round
    assert len(model.reads) <= 5 * (2 + 0.5 / servicers.WATCH_MIN_INTERVAL_SEC)
    model.status = "COMPLETED"
    await hints.send(natsio.PROGRESS_TERMINAL)
    for responses in await asyncio.wait_for(asyncio.gather(*tasks), timeout=2):
        assert responses  # each stream got its reads' changes, the terminal one last
    assert hints.cb is None  # the last stream gone: unsubscribed


async def test_the_backstop_of_every_watched_execution_is_one_query() -> None:
    class Quiet:  # 50 running executions that never move
        def __init__(self) -> None:
            self.reads = 0
            self.checks: list[list[int]] = []

        async def execution(self, execution_id: int, include_results: bool = False) -> dict[str, Any]:
            self.reads += 1
            return {"status": "RUNNING", "last_shard_seq": 7, "steps": []}

        async def versions(self, execution_ids: list[int]) -> dict[int, tuple[str, int]]:
            self.checks.append(sorted(execution_ids))
            return dict.fromkeys(execution_ids, ("RUNNING", 7))

    class AnyHints(Hints):
        subs = 0

        async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
            AnyHints.subs += 1
            return await super().subscribe(subject, cb)

    model, hints = Quiet(), AnyHints()
    servicer = servicers.ExecutionServicer(None, model, hints, None)  # type: ignore[arg-type]

    async def stream(eid: int) -> None:
        async for _ in servicer.WatchExecution(execution_pb2.WatchExecutionRequest(execution_id=eid), None):
            pass
    tasks = [asyncio.create_task(stream(eid)) for eid in range(100, 150)]
    await asyncio.sleep(2.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert model.reads == 50 and AnyHints.subs == 50  # one read each when it opened; nothing moved since
    assert 2 <= len(model.checks) <= 3 and all(c == list(range(100, 150)) for c in model.checks)


async def test_a_shared_read_is_never_older_than_the_hint_a_stream_was_woken_by() -> None:
    model = ReadModel(delay=0.05)
    hub = watching.WatchHub(Hints(), model.execution, model.versions)
    async with hub.watching(1, asyncio.Event()) as w:
        first = asyncio.create_task(hub.read(1, False, w))
        await asyncio.sleep(0.01)
        joined = await hub.read(1, False, w)  # no hint since it started: shared
        assert hub.reads == 1 and joined == await first
        slow = asyncio.create_task(hub.read(1, False, w))
        await asyncio.sleep(0.01)
        w.hinted(False)  # a change projected while that read was in flight
        fresh = await hub.read(1, False, w)
        assert hub.reads == 3 and fresh["last_shard_seq"] > (await slow)["last_shard_seq"]


async def test_a_failed_subscription_fails_its_stream_and_the_next_one_subscribes_again() -> None:
    class Flaky(Hints):
        def __init__(self) -> None:
            super().__init__()
            self.attempts = 0
            self.gate = asyncio.Event()

        async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
            self.attempts += 1
            if self.attempts == 1:  # NATS refuses the first one, after a while
                await self.gate.wait()
                raise ConnectionError("nats: connection closed")
            return await super().subscribe(subject, cb)

    model, hints = ReadModel(), Flaky()
    hub = watching.WatchHub(hints, model.execution, model.versions)

    async def stream() -> bool:
        async with hub.watching(1, asyncio.Event()) as w:
            return w.sub is not None

    first = asyncio.create_task(stream())
    await asyncio.sleep(0.01)
    joined = asyncio.create_task(stream())  # arrives while the first subscription is pending
    await asyncio.sleep(0.01)
    hints.gate.set()
    with pytest.raises(ConnectionError):
        await first
    assert await joined is True and hints.attempts == 2  # it made its own subscription
    assert hints.cb is None  # and left none behind
