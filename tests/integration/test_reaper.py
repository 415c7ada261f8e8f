"""The reaper against real Postgres and NATS JetStream: a claim whose lease ran out is
reported to the shard's engine as ``EngineInput{expired}`` on ``noetl.events.{shard}.expired``,
and a command left queued is republished as a ``CommandNotice`` on ``noetl.commands.{shard}``.
The reaper only reads Postgres: the engine decides what happens to the command.

Each test uses a shard id of its own, deletes its command rows and purges its subjects."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from waiting import until

from noetl_common import natsio
from noetl_common.config import CommandSettings
from noetl_common.db import Pool, make_pool
from noetl_common.ids import SnowflakeGenerator
from noetl_proto.v1 import messages_pb2
from noetl_reaper.worker import ReapRounds, ShardReaper

pytestmark = pytest.mark.integration

SNOWFLAKES = SnowflakeGenerator(node_id=1023)
LEASE_SEC = 2.0


@dataclass
class Shard:
    pool: Pool
    nc: NATS
    shard: int = field(default_factory=lambda: 200_000 + random.randrange(1_000_000))
    command_ids: list[str] = field(default_factory=list)
    expired: asyncio.Queue[messages_pb2.EngineInput] = field(default_factory=asyncio.Queue)
    notices: asyncio.Queue[messages_pb2.CommandNotice] = field(default_factory=asyncio.Queue)
    subs: list[Any] = field(default_factory=list)

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    async def listen(self) -> None:
        async def on_expired(msg: Any) -> None:
            self.expired.put_nowait(messages_pb2.EngineInput.FromString(msg.data))

        async def on_notice(msg: Any) -> None:
            self.notices.put_nowait(messages_pb2.CommandNotice.FromString(msg.data))

        self.subs = [await self.nc.subscribe(natsio.events_subject(self.shard, natsio.KIND_EXPIRED), cb=on_expired),
                     await self.nc.subscribe(natsio.commands_subject('default', 'normal', self.shard), cb=on_notice)]
        await self.nc.flush()  # the subscriptions are registered before anything is published

    async def command(self, status: str, *, attempt: int = 1, kind: str = "python", worker: str | None = None,
                      lease: str | None = None, age: str = "0 seconds", shard: int | None = None) -> tuple[str, int]:
        """Insert a command row; ``lease`` / ``age`` are intervals relative to now()."""
        eid = SNOWFLAKES.next_id()
        cid = f"{eid}:step:1"
        self.command_ids.append(cid)
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO noetl.command (command_id, execution_id, shard_id, catalog_id, step, kind, status,"
                " attempt, context, worker_id, claimed_at, lease_until, created_at, updated_at)"
                " VALUES (%s, %s, %s, 1, 'step', %s, %s, %s, '{}'::jsonb, %s,"
                " CASE WHEN %s::text IS NULL THEN NULL ELSE now() - interval '1 minute' END,"
                " now() + %s::interval, now() - %s::interval, now() - %s::interval)",
                (cid, eid, self.shard if shard is None else shard, kind, status, attempt, worker, worker,
                 lease, age, age))
        return cid, eid

    async def command_rows(self) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT * FROM noetl.command WHERE command_id = ANY(%s) ORDER BY command_id",
                                     (self.command_ids,))
            out = await cur.fetchall()
            await conn.commit()
        return out

    def reaper(self, pool: Pool | None = None, *, interval: float = 1.0) -> ShardReaper:
        # claims are never judged within a command lease of Postgres' own start: a short lease
        # (the fixture waits it out) so the outcome does not depend on which test ran first
        return ShardReaper(pool or self.pool, self.js, self.shard, 1,
                           CommandSettings(republish_after_sec=60, lease_sec=LEASE_SEC), interval)

    async def cleanup(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("DELETE FROM noetl.command WHERE command_id = ANY(%s)", (self.command_ids,))
        # nothing of ours is left for the workers' consumer or an engine
        await self.js.purge_stream(natsio.EVENTS_STREAM, subject=f"noetl.events.{self.shard}.>")
        await self.js.purge_stream(natsio.COMMANDS_STREAM, subject=natsio.commands_subject('default', 'normal', self.shard))


@pytest.fixture
async def shard(pool: Pool, nc: NATS) -> AsyncIterator[Shard]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT extract(epoch FROM now() - pg_postmaster_start_time()) AS age")
        age = float((await cur.fetchone())["age"])
        await conn.commit()
    if age < LEASE_SEC + 0.5:  # a sleep, not a wait: the server's age is the condition, this is what is left of it
        await asyncio.sleep(LEASE_SEC + 0.5 - age)
    sh = Shard(pool, nc)
    await sh.listen()
    try:
        yield sh
    finally:
        await sh.cleanup()


async def test_reports_expired_claims_and_republishes_stale_queued_commands(shard: Shard) -> None:
    expired_id, expired_eid = await shard.command("claimed", attempt=2, worker="w-lost", lease="-1 minute")
    await shard.command("claimed", worker="w-busy", lease="1 minute")          # still leased: left alone
    stale_id, stale_eid = await shard.command("queued", kind="http", age="2 hours")
    await shard.command("queued")                                              # just queued: left alone
    await shard.command("done", worker="w-ok", lease="-1 hour", age="2 hours")  # finished: left alone
    await shard.command("claimed", worker="w-lost", lease="-1 minute", shard=shard.shard + 1)  # not our shard
    before = await shard.command_rows()

    assert await shard.reaper().reap_once() == (1, 1)

    report = await asyncio.wait_for(shard.expired.get(), timeout=10)
    assert report.WhichOneof("input") == "expired"
    assert (report.expired.command_id, report.expired.execution_id, report.expired.attempt) == (
        expired_id, expired_eid, 2)
    assert "w-lost" in report.expired.reason
    notice = await asyncio.wait_for(shard.notices.get(), timeout=10)
    assert notice == messages_pb2.CommandNotice(command_id=stale_id, execution_id=stale_eid, shard_id=shard.shard,
                                                attempt=1, kind="http")

    # both are stored in their streams (the engine and the workers read them from there)
    subject = natsio.events_subject(shard.shard, natsio.KIND_EXPIRED)
    stored = await shard.js.get_last_msg(natsio.EVENTS_STREAM, subject)
    assert messages_pb2.EngineInput.FromString(stored.data) == report
    queued = await shard.js.get_last_msg(natsio.COMMANDS_STREAM, natsio.commands_subject('default', 'normal', shard.shard))
    assert messages_pb2.CommandNotice.FromString(queued.data) == notice

    # the reaper decides nothing: the rows are as they were
    assert await shard.command_rows() == before

    # reaping again before the engine acted reports again, deduplicated in the stream
    assert await shard.reaper().reap_once() == (1, 1)
    await asyncio.wait_for(shard.expired.get(), timeout=10)
    assert (await shard.js.get_last_msg(natsio.EVENTS_STREAM, subject)).seq == stored.seq


async def test_the_shard_loops_of_a_process_read_their_rounds_in_one_transaction(shard: Shard) -> None:
    """Two shards of one reaper: one transaction for both rounds, each shard reporting its
    own rows only; a shard whose expiries are held gets no expired claims from the round."""
    a, b = shard, Shard(shard.pool, shard.nc, shard=shard.shard + 1)
    pool = shard.pool
    await b.listen()
    try:
        a_expired, _ = await a.command("claimed", worker="w-lost", lease="-1 minute")
        a_stale, _ = await a.command("queued", age="2 hours")
        await b.command("claimed", worker="w-lost", lease="-1 minute")
        b_stale, _ = await b.command("queued", age="2 hours")
        cfg = CommandSettings(republish_after_sec=60, lease_sec=LEASE_SEC)
        rounds = ReapRounds(pool, cfg)
        ra = ShardReaper(pool, a.js, a.shard, 1, cfg, 1.0, rounds=rounds)
        rb = ShardReaper(pool, b.js, b.shard, 1, cfg, 1.0, rounds=rounds, hold_expiries=lambda: True)
        assert await asyncio.gather(ra.reap_once(), rb.reap_once()) == [(1, 1), (0, 1)]
        assert rounds.transactions == 1
        assert (await asyncio.wait_for(a.expired.get(), timeout=10)).expired.command_id == a_expired
        assert (await asyncio.wait_for(a.notices.get(), timeout=10)).command_id == a_stale
        assert (await asyncio.wait_for(b.notices.get(), timeout=10)).command_id == b_stale
        assert b.expired.empty() and a.notices.empty()
    finally:
        await b.cleanup()


async def test_nothing_to_reap(shard: Shard) -> None:
    await shard.command("claimed", worker="w", lease="1 minute")
    await shard.command("queued")
    assert await shard.reaper().reap_once() == (0, 0)


async def test_run_loop_survives_a_lost_database_connection(shard: Shard, pg_dsn: str) -> None:
    own_pool = make_pool(pg_dsn, min_size=1, max_size=1, name="test-reaper-run")
    await own_pool.open(wait=True, timeout=30)
    reaper = shard.reaper(own_pool, interval=0.1)
    running = asyncio.ensure_future(reaper.run())

    async def next_report(limit: float = 10.0) -> messages_pb2.EngineInput:
        getter = asyncio.ensure_future(shard.expired.get())
        done, _ = await asyncio.wait({getter, running}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            raise AssertionError("the reaper loop died" if running.done() else f"no report within {limit}s")
        return getter.result()

    try:
        first, _ = await shard.command("claimed", worker="w1", lease="-1 minute")
        assert (await next_report()).expired.command_id == first

        async with own_pool.connection() as conn:
            backend = conn.info.backend_pid
        async with shard.pool.connection() as conn:
            await conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
            await conn.commit()

        second, _ = await shard.command("claimed", worker="w2", lease="-1 minute")
        # `first` is reported again each round until the engine acts on it; wait for `second`
        async def second_reported() -> bool:
            return (await next_report()).expired.command_id == second

        await until(second_reported, timeout=15, what="the second expiry reported", interval=0)
    finally:
        reaper.stop()
        await asyncio.wait_for(running, timeout=10)
        await own_pool.close()
