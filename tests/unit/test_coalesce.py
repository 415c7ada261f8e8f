"""The group-commit coalescer: batches while a flush is in flight, per-item errors."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from noetl_common.coalesce import Coalescer, ShardRounds


async def test_concurrent_submissions_share_flushes_and_keep_order() -> None:
    batches: list[list[int]] = []
    flushing = asyncio.Event()

    async def flush(items: Sequence[int]) -> list[int | BaseException]:
        batches.append(list(items))
        flushing.set()
        await asyncio.sleep(0.01)  # a slow flush (not a wait): the others queue while it is in flight
        return [i * 10 for i in items]

    c: Coalescer[int, int] = Coalescer(flush, max_batch=50)
    first = asyncio.create_task(c.submit(0))
    await flushing.wait()  # the lone first request goes out at once
    rest = await asyncio.gather(*(c.submit(i) for i in range(1, 20)))
    assert await first == 0 and rest == [i * 10 for i in range(1, 20)]
    assert batches == [[0], list(range(1, 20))]  # the others queued behind it: one flush


async def test_per_item_errors_and_batch_errors() -> None:
    async def flush(items: Sequence[int]) -> list[int | BaseException]:
        if 99 in items:
            raise RuntimeError("whole batch failed")
        return [ValueError(f"bad {i}") if i % 2 else i for i in items]

    c: Coalescer[int, int] = Coalescer(flush, max_batch=3)
    assert await c.submit(2) == 2
    with pytest.raises(ValueError, match="bad 3"):
        await c.submit(3)
    with pytest.raises(RuntimeError, match="whole batch"):
        await c.submit(99)
    assert await c.submit(4) == 4


async def test_max_batch_bounds_each_flush() -> None:
    sizes: list[int] = []

    async def flush(items: Sequence[int]) -> list[int | BaseException]:
        sizes.append(len(items))
        await asyncio.sleep(0)  # a flush that yields once (not a wait), as a real one does
        return list(items)

    c: Coalescer[int, int] = Coalescer(flush, max_batch=4)
    await asyncio.gather(*(c.submit(i) for i in range(13)))
    assert max(sizes) <= 4 and sum(sizes) == 13


async def test_a_gather_window_joins_requests_that_come_soon_after_the_first() -> None:
    batches: list[list[int]] = []

    async def flush(items: Sequence[int]) -> list[int]:
        batches.append(list(items))
        return [i * 10 for i in items]

    gathered: Coalescer[int, int] = Coalescer(flush, gather_sec=0.05)

    async def later(i: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return await gathered.submit(i)

    # without a window the first would go alone; with one, all three make one flush
    assert await asyncio.gather(later(1, 0), later(2, 0.01), later(3, 0.02)) == [10, 20, 30]
    assert batches == [[1, 2, 3]]
    with pytest.raises(ValueError):
        Coalescer(flush, gather_sec=-1)


async def test_shard_rounds_read_the_keys_asked_together_once_and_default_the_rest() -> None:
    asked: list[list[int]] = []

    async def read(shards: list[int]) -> dict[int, str]:
        asked.append(shards)
        return {s: f"s{s}" for s in shards if s % 2 == 0}

    rounds: ShardRounds[int, str | None] = ShardRounds(read, None, gather_sec=0.02)
    # three loops of one process (one of them a second loop of shard 4) at one boundary
    assert await asyncio.gather(rounds.get(4), rounds.get(7), rounds.get(4)) == ["s4", None, "s4"]
    assert asked == [[4, 7]] and rounds.reads == 1

    async def broken(shards: list[int]) -> dict[int, str]:
        raise RuntimeError("database down")

    failing: ShardRounds[int, str | None] = ShardRounds(broken, None)
    results = await asyncio.gather(failing.get(1), failing.get(2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)  # every loop of the round sees it
