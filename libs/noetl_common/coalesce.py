"""Group concurrent requests into batches (group commit).

While one batch is being flushed, new requests queue up; when the flush returns, all
of them go out as the next batch. By default there is no waiting window: a lone request
is flushed at once, so latency under light load is unchanged, and under load each round
trip carries many requests. ``gather_sec`` > 0 waits that long after a batch's first
request: periodic loops that wake together (the shard loops of one process) make one
round trip for all of them (``ShardRounds``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
K = TypeVar("K")

Flush = Callable[[Sequence[T]], Awaitable[Sequence[R | BaseException]]]


class Coalescer(Generic[T, R]):
    """``await submit(item)`` returns that item's result from ``flush(batch)``, which
    returns one result (or an exception, raised to that caller only) per item, in order.
    If ``flush`` itself raises, every caller of the batch gets the error."""

    def __init__(self, flush: Flush[T, R], *, max_batch: int = 64, gather_sec: float = 0.0) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if gather_sec < 0:
            raise ValueError("gather_sec must not be negative")
        self._flush = flush
        self._max = max_batch
        self._gather = gather_sec
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._runner: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        if self._gather:
            await asyncio.sleep(self._gather)
        while self._queue:
            batch, self._queue = self._queue[: self._max], self._queue[self._max:]
            live = [(item, fut) for item, fut in batch if not fut.cancelled()]
            if not live:
                continue
            try:
                results = await self._flush([item for item, _ in live])
            except BaseException as exc:
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, fut), result in zip(live, results, strict=True):
                if fut.done():
                    continue
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)


def to_boundary(period: float) -> float:
    """Seconds to the next multiple of ``period`` on the monotonic clock: the shard loops of
    a process that sleep this long wake together, and their reads go out as one
    (``ShardRounds``)."""
    return period - time.monotonic() % period


class ShardRounds(Generic[K, R]):
    """One read for the periodic rounds of all the shard loops of a process.

    The loops wake on shared interval boundaries (``to_boundary``) and ``await get(key)``; the keys asked
    for within ``gather_sec`` of the first are read together by ``read(keys)``, which
    returns a value per key it found something for (a key it leaves out gets ``missing``).
    A failed read fails the round of every loop in it. ``reads`` counts the reads made."""

    def __init__(self, read: Callable[[list[K]], Awaitable[Mapping[K, R]]], missing: R, *,
                 gather_sec: float = 0.005) -> None:
        self._read = read
        self._missing = missing
        self.reads = 0
        self._rounds: Coalescer[K, R] = Coalescer(self._flush, max_batch=1_000_000, gather_sec=gather_sec)

    async def get(self, key: K) -> R:
        return await self._rounds.submit(key)

    async def _flush(self, keys: Sequence[K]) -> list[R]:
        self.reads += 1
        found = await self._read(list(dict.fromkeys(keys)))
        return [found.get(key, self._missing) for key in keys]
