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

from noetl_api import servicers
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
    def __init__(self) -> None:
        self.reads: list[float] = []
        self.status = "RUNNING"
        self.seq = 0

    async def execution(self, execution_id: int, include_results: bool = False) -> dict[str, Any]:
        self.reads.append(asyncio.get_running_loop().time())
        self.seq += 1
        return {"status": self.status, "last_shard_seq": self.seq, "steps": []}


@pytest.fixture(autouse=True)
def plain_pb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicers, "_execution_pb", lambda row: execution_pb2.Execution(execution_id=1))


async def watch(model: ReadModel, hints: Hints) -> list[Any]:
    servicer = servicers.ExecutionServicer(None, model, hints, None)  # type: ignore[arg-type]
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


async def test_without_hints_it_still_reads_every_second() -> None:
    model, hints = ReadModel(), Hints()
    task = asyncio.create_task(watch(model, hints))
    await asyncio.sleep(1.2)
    assert len(model.reads) == 2
    model.status = "FAILED"
    await asyncio.wait_for(task, timeout=2)
