"""Why a watermark reader never skips an event: ``shard_seq`` is allocated under the
row lock of the shard's lease row (the engine's fence), so commit order is ``shard_seq``
order. Real Postgres, the engine's own statements (``noetl_db``).

* K writers run the engine batch concurrently on one shard (fence -> append N events
  with ``event_seq + 1..`` -> random delay -> record ``event_seq`` -> commit) while a
  reader polls ``shard_seq > watermark ORDER BY shard_seq``: it sees every seq exactly
  once, in order.
* Negative control: ids from a plain sequence taken outside any lock *can* be skipped
  by the same reader (shown with random timing within a bounded number of rounds, and
  deterministically by ordering two commits by hand).
* The fence: a takeover's epoch bump waits for the in-flight batch, and the old owner's
  next batch is refused (LeaseLost) with nothing appended."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from waiting import until

from noetl_common.errors import LeaseLost
from noetl_common.ids import SnowflakeGenerator
from noetl_db import events as event_log
from noetl_db import leases

pytestmark = pytest.mark.integration

IDS = SnowflakeGenerator(node_id=1021)
OWNER = 8_000_000_000 + random.randrange(1_000_000)  # a fake api member
WRITERS = 4
BATCHES = 60  # per writer

Conn = psycopg.AsyncConnection[dict[str, Any]]


async def connect(dsn: str, *, autocommit: bool = False) -> Conn:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit, row_factory=dict_row)


@pytest.fixture
async def shard(pg_dsn: str) -> AsyncIterator[int]:
    """An engine lease row of a shard nobody else uses, held by OWNER at epoch 1."""
    shard_id = 500_000 + random.randrange(1_000_000)
    async with await connect(pg_dsn, autocommit=True) as conn:
        await conn.execute("INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
                           " VALUES ('api', %s, %s, 1, now() + interval '1 minute')", (shard_id, OWNER))
        try:
            yield shard_id
        finally:
            await conn.execute("DELETE FROM noetl.event WHERE shard_id = %s", (shard_id,))
            await conn.execute("DELETE FROM noetl.shard_lease WHERE role = 'api' AND shard_id = %s", (shard_id,))


async def engine_batch(conn: Conn, shard: int, epoch: int, events: int, delay: float) -> list[int]:
    """What ShardEngine._process does to the log, in one transaction; returns the seqs."""
    async with conn.transaction():
        lease = await leases.fence(conn, "api", shard, OWNER, epoch, stream_seq=0)
        seq = int(lease["event_seq"])
        eid = IDS.next_id()
        seqs = list(range(seq + 1, seq + events + 1))
        await event_log.append_events(conn, [(eid, shard, s, "test.fence", None, None, None, json.dumps({"w": 1}))
                                       for s in seqs])
        await asyncio.sleep(delay)  # a sleep, not a wait: commits late (a slow batch, a GC pause)
        await leases.finish_engine_batch(conn, "api", shard, seqs[-1], 0, 0, 0)
    return seqs


async def watermark_reader(dsn: str, query: str, params: Callable[[int], tuple[Any, ...]],
                           writers: Awaitable[Any]) -> list[int]:
    """Poll ``query`` (ids past the watermark, ordered) until the writers are done, then
    once more; the watermark advances to the last id read, as the projector's does."""
    seen: list[int] = []
    watermark = 0
    task = asyncio.ensure_future(writers)
    async with await connect(dsn, autocommit=True) as conn:
        while True:
            done = task.done()
            rows = await (await conn.execute(query, params(watermark))).fetchall()
            if rows:
                seen.extend(r["id"] for r in rows)
                watermark = seen[-1]
            if done:
                break
            await asyncio.sleep(random.uniform(0, 0.002))  # a jitter, not a wait: reads interleave with commits
    await task
    return seen


async def test_fenced_shard_seq_is_never_skipped_by_a_watermark_reader(pg_dsn: str, shard: int) -> None:
    conns = [await connect(pg_dsn) for _ in range(WRITERS)]
    written: list[int] = []

    async def writer(conn: Conn) -> None:
        for _ in range(BATCHES):
            written.extend(await engine_batch(conn, shard, 1, random.randint(1, 4), random.uniform(0, 0.004)))

    try:
        seen = await watermark_reader(
            pg_dsn, "SELECT shard_seq AS id FROM noetl.event WHERE shard_id = %s AND shard_seq > %s"
                    " ORDER BY shard_seq", lambda w: (shard, w),
            asyncio.gather(*(writer(c) for c in conns)))
    finally:
        for c in conns:
            await c.close()
    total = len(written)
    assert sorted(written) == list(range(1, total + 1)), "the fence allocated a gap or a duplicate"
    assert seen == list(range(1, total + 1)), (
        f"reader saw {len(seen)} of {total}; missing {sorted(set(range(1, total + 1)) - set(seen))[:10]}")


@pytest.fixture
async def unfenced(pg_dsn: str) -> AsyncIterator[str]:
    """A table whose ids come from a plain sequence (like ``event_id``), no lock taken."""
    table = f"noetl_test_unfenced_{random.randrange(1_000_000)}"
    async with await connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(f"CREATE TABLE public.{table} (id bigint PRIMARY KEY)")
        await conn.execute(f"CREATE SEQUENCE public.{table}_seq")
        try:
            yield table
        finally:
            await conn.execute(f"DROP TABLE public.{table}")
            await conn.execute(f"DROP SEQUENCE public.{table}_seq")


async def test_unfenced_sequence_ids_can_be_skipped(pg_dsn: str, unfenced: str) -> None:
    """Negative control with random timing: the same reader over ids from ``nextval``
    outside any lock misses late-committing lower ids (bounded number of rounds)."""
    table = unfenced
    conns = [await connect(pg_dsn) for _ in range(WRITERS)]
    written: list[int] = []

    async def writer(conn: Conn) -> None:
        for _ in range(BATCHES):
            async with conn.transaction():
                cur = await conn.execute(f"SELECT nextval('public.{table}_seq') AS id"
                                         f" FROM generate_series(1, %s)", (random.randint(1, 4),))
                ids = [r["id"] for r in await cur.fetchall()]
                async with conn.cursor() as c:
                    await c.executemany(f"INSERT INTO public.{table} (id) VALUES (%s)", [(i,) for i in ids])
                await asyncio.sleep(random.uniform(0, 0.004))  # a jitter, not a wait: commits in any order
            written.extend(ids)

    skipped: set[int] = set()
    try:
        for _ in range(5):  # rounds; one is almost always enough
            written.clear()
            seen = await watermark_reader(
                pg_dsn, f"SELECT id FROM public.{table} WHERE id > %s ORDER BY id", lambda w: (w,),
                asyncio.gather(*(writer(c) for c in conns)))
            skipped = set(written) - set(seen)
            if skipped:
                break
    finally:
        for c in conns:
            await c.close()
    assert skipped, "the unfenced control never skipped an id: the reader check would prove nothing"


async def test_unfenced_skip_by_ordered_commits(pg_dsn: str, unfenced: str) -> None:
    """Negative control, deterministic: A takes id 1, B takes id 2 and commits first; a
    reader at watermark 0 reads 2 and moves past 1, which A commits afterwards."""
    table = unfenced
    a, b, reader = await connect(pg_dsn), await connect(pg_dsn), await connect(pg_dsn, autocommit=True)
    try:
        await a.execute(f"INSERT INTO public.{table} (id) SELECT nextval('public.{table}_seq')")
        await b.execute(f"INSERT INTO public.{table} (id) SELECT nextval('public.{table}_seq')")
        await b.commit()
        first = [r["id"] for r in await (await reader.execute(
            f"SELECT id FROM public.{table} WHERE id > 0 ORDER BY id")).fetchall()]
        assert first == [2]
        await a.commit()
        later = [r["id"] for r in await (await reader.execute(
            f"SELECT id FROM public.{table} WHERE id > %s ORDER BY id", (first[-1],))).fetchall()]
        assert later == [], "id 1 committed below the watermark: the reader never sees it"
        all_ids = [r["id"] for r in await (await reader.execute(f"SELECT id FROM public.{table}")).fetchall()]
        assert sorted(all_ids) == [1, 2]
    finally:
        for c in (a, b, reader):
            await c.close()


async def test_takeover_waits_for_the_in_flight_batch_then_fences_the_old_owner_out(
        pg_dsn: str, shard: int) -> None:
    old, leader = await connect(pg_dsn), await connect(pg_dsn, autocommit=True)
    observer = await connect(pg_dsn, autocommit=True)

    async def activity(conn: Conn) -> dict[str, Any]:
        cur = await observer.execute("SELECT backend_xid IS NOT NULL AS writing, wait_event_type FROM"
                                     " pg_stat_activity WHERE pid = %s", (conn.info.backend_pid,))
        row = await cur.fetchone()
        assert row is not None
        return row

    try:
        batch = asyncio.ensure_future(engine_batch(old, shard, 1, 3, 1.0))
        # the batch has fenced (its UPDATE gave it a transaction id and the row lock)
        await until(lambda: _field(activity(old), "writing"), timeout=10, what="the batch to fence", interval=0.01)
        # the shard-manager's epoch bump (membership.rebalance) waits on the row lock...
        bump = asyncio.ensure_future(leader.execute(
            "UPDATE noetl.shard_lease SET owner_runtime_id = %s, epoch = epoch + 1 WHERE role = 'api'"
            " AND shard_id = %s", (OWNER + 1, shard)))
        await until(lambda: _equals(activity(leader), "wait_event_type", "Lock"), timeout=10,
                    what="the takeover to wait on the row lock", interval=0.01)
        assert not batch.done() and not bump.done()
        assert await batch == [1, 2, 3]  # the in-flight batch commits
        await asyncio.wait_for(bump, 5)  # then the takeover goes through
        # ...and the old owner's next batch is refused, appending nothing
        with pytest.raises(LeaseLost):
            await engine_batch(old, shard, 1, 2, 0)
        rows = await (await observer.execute("SELECT shard_seq FROM noetl.event WHERE shard_id = %s ORDER BY 1",
                                             (shard,))).fetchall()
        assert [r["shard_seq"] for r in rows] == [1, 2, 3]
    finally:
        for c in (old, leader, observer):
            await c.close()


async def _field(row: Awaitable[dict[str, Any]], name: str) -> bool:
    return bool((await row)[name])


async def _equals(row: Awaitable[dict[str, Any]], name: str, value: Any) -> bool:
    return (await row)[name] == value
