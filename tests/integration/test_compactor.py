"""The compactor against a real Postgres: synthetic finished executions (written the way
the runtime writes them) become manifests in a transaction fenced on the compactor lease,
their events are deleted, GetTrace answers the same chain from the manifest, expired
empty partitions are dropped, and the benchmark helper measures events/s per shard."""

from __future__ import annotations

import random
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest

from noetl_api.queries import Queries
from noetl_common.db import REDRIVE_LOCK_CLASS, Pool, partition_name
from noetl_common.errors import LeaseLost, NotFound
from noetl_compactor.bench import measure
from noetl_compactor.compaction import Compaction
from noetl_compactor.partitions import drop_expired_partitions, expired
from noetl_compactor.synthetic import write_executions
from noetl_db import leases as lease_db
from noetl_store import PostgresResultStore

pytestmark = pytest.mark.integration

SHARDS = 1024
SHARD = 900  # no other test uses it
OWNER, EPOCH = 4242, 3
RETENTION_SEC = 5 * 86_400.0


async def sql(pool: Pool, statement: str, params: Any = ()) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(statement, params)
        rows = list(await cur.fetchall()) if cur.description else []
        await conn.commit()
    return rows


@pytest.fixture(scope="module")
async def lease(pool: Pool) -> None:
    async with pool.connection() as conn:
        await lease_db.assign(conn, "compactor", SHARD, OWNER, EPOCH)
        await conn.commit()


def old_day() -> date:
    """A day in the snowflake era (2024-) long past the horizon, random so reruns do not collide."""
    return date(2024, 2, 1) + timedelta(days=random.randrange(300))


def compaction(pool: Pool, **kw: Any) -> Compaction:
    return Compaction(pool, SHARD, kw.pop("owner", OWNER), kw.pop("epoch", EPOCH), retention_sec=RETENTION_SEC, **kw)


async def events_of(pool: Pool, ids: list[int]) -> int:
    return int((await sql(pool, "SELECT count(*) AS n FROM noetl.event WHERE execution_id = ANY(%s)", (ids,)))[0]["n"])


async def test_compaction_writes_manifests_deletes_events_and_keeps_the_trace(pool: Pool, lease: None) -> None:
    day = old_day()
    made = await write_executions(pool, day=day, count=5, events_per_execution=12, chain=3, shard_count=SHARDS,
                                  shard=SHARD)
    ids = [m.execution_id for m in made]
    queries = Queries(pool, PostgresResultStore(pool))
    target = made[0]
    last = target.steps[-1]
    before, from_manifest = await queries.trace(target.execution_id, last)
    assert not from_manifest and [e["ref_id"] for e in before] == target.chain and len(before) == 3
    assert before[0]["parent_ref_id"] == target.chain[1] and before[-1]["parent_ref_id"] is None
    assert await events_of(pool, ids) == 5 * 12

    # a stale lease holder writes nothing
    with pytest.raises(LeaseLost):
        await compaction(pool, epoch=EPOCH - 1).batch()
    assert await events_of(pool, ids) == 5 * 12

    result = await compaction(pool).batch()
    assert (result.executions, result.events, result.revisited) == (5, 60, 0)
    assert sorted(result.compacted_ids) == sorted(ids)
    assert await events_of(pool, ids) == 0
    assert (await compaction(pool).batch()).empty  # nothing due any more

    after, from_manifest = await queries.trace(target.execution_id, last)
    assert from_manifest and after == [{k: v for k, v in e.items() if k != "depth"} for e in before]
    with pytest.raises(NotFound, match="step 'nope'"):
        await queries.trace(target.execution_id, "nope")
    # the read models stay: GetExecution keeps answering, with results
    view = await queries.execution(target.execution_id, include_results=True)
    assert view["status"] == "COMPLETED" and {s["step"] for s in view["steps"]} == set(target.steps)
    assert all(s["result"]["step"] == s["step"] for s in view["steps"])

    manifest = (await sql(pool, "SELECT * FROM noetl.manifest WHERE execution_id = %s", (target.execution_id,)))[0]
    assert (manifest["shard_id"], manifest["status"], manifest["event_count"]) == (SHARD, "COMPLETED", 12)
    assert (manifest["terminal_ref_id"], manifest["chain_depth"]) == (target.chain[0], 3)
    assert manifest["step_count"] == len(target.steps) and manifest["compactor_epoch"] == EPOCH
    assert manifest["event_types"]["playbook.completed"] == 1 and sum(manifest["event_types"].values()) == 12
    parts = {p["step"]: p for p in await sql(pool, "SELECT * FROM noetl.manifest_part WHERE execution_id = %s",
                                              (target.execution_id,))}
    assert set(parts) == set(target.steps)
    final = parts[last]
    assert (final["event_type"], final["terminal_ref_id"], final["chain_depth"]) == ("call.done", target.chain[0], 3)
    assert final["envelope"]["reference"]["ref_id"] == target.chain[0]
    assert final["envelope"]["parent_ref"] == {"ref_id": target.chain[1]}

    # a late event for a compacted execution (a duplicate result) is deleted and counted
    await sql(pool, "INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type, step)"
                    " VALUES (%s, %s, 0, 'call.duplicate', %s)", (target.execution_id, SHARD, last))
    late = await compaction(pool).batch()
    assert (late.executions, late.revisited, late.events) == (0, 1, 1)
    manifest = (await sql(pool, "SELECT * FROM noetl.manifest WHERE execution_id = %s", (target.execution_id,)))[0]
    assert manifest["event_count"] == 13 and manifest["event_types"]["call.duplicate"] >= 1
    assert (await queries.trace(target.execution_id, last))[0] == after  # the parts are untouched

    # the partition of that day is now empty and past the horizon: dropped
    name = partition_name(day)
    assert await sql(pool, "SELECT 1 FROM pg_class WHERE relname = %s", (name,))
    dropped = await drop_expired_partitions(pool, horizon=datetime.now(UTC) - timedelta(days=5),
                                            keep_from=datetime.now(UTC).date() - timedelta(days=1))
    assert name in dropped
    assert not await sql(pool, "SELECT 1 FROM pg_class WHERE relname = %s", (name,))
    assert (await queries.trace(target.execution_id, last))[0] == after


async def test_unprojected_events_wait_and_full_partitions_stay(pool: Pool, lease: None) -> None:
    day = old_day()
    (made,) = await write_executions(pool, day=day, count=1, events_per_execution=6, shard_count=SHARDS,
                                     shard=SHARD, seq_start=1 << 20)
    projected = await sql(pool, "SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s",
                          (SHARD,))
    seq = int(projected[0]["last_shard_seq"]) if projected else 0
    await sql(pool, "INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type)"
                    " VALUES (%s, %s, %s, 'call.duplicate')", (made.execution_id, SHARD, seq + 10))
    result = await compaction(pool).batch()
    assert result.executions == 0 and result.skipped == 1  # not projected yet: left for later
    name = partition_name(day)
    kept = await drop_expired_partitions(pool, horizon=datetime.now(UTC), keep_from=datetime.now(UTC).date())
    assert name not in kept and await sql(pool, "SELECT 1 FROM pg_class WHERE relname = %s", (name,))
    try:
        await sql(pool, "INSERT INTO noetl.projection_checkpoint (shard_id, last_shard_seq) VALUES (%s, %s)"
                        " ON CONFLICT (shard_id) DO UPDATE SET last_shard_seq = EXCLUDED.last_shard_seq",
                  (SHARD, seq + 10))
        result = await compaction(pool).batch()
        assert (result.executions, result.events) == (1, 7)
    finally:
        await sql(pool, "DELETE FROM noetl.projection_checkpoint WHERE shard_id = %s", (SHARD,))
    await drop_expired_partitions(pool, horizon=datetime.now(UTC), keep_from=datetime.now(UTC).date())
    assert not await sql(pool, "SELECT 1 FROM pg_class WHERE relname = %s", (name,))


async def test_an_execution_being_redriven_is_left_out_and_compacted_after(pool: Pool, lease: None) -> None:
    """The engine holds an execution's redrive lock while it applies a redrive: a batch
    leaves that execution out (the others are compacted) and takes it once the lock is gone."""
    made = await write_executions(pool, day=old_day(), count=3, events_per_execution=4, chain=1,
                                  shard_count=SHARDS, shard=SHARD)
    ids = [m.execution_id for m in made]
    held = ids[1]
    async with pool.connection() as engine:  # the engine's redrive transaction, still open
        await engine.execute("SELECT pg_advisory_xact_lock(%s, (%s %% 2147483647)::int)",
                             (REDRIVE_LOCK_CLASS, held))
        result = await compaction(pool).batch()
        assert sorted(result.compacted_ids) == sorted(i for i in ids if i != held) and result.skipped >= 1
        assert await events_of(pool, [held]) == 4
        await engine.rollback()
    result = await compaction(pool).batch()
    assert result.compacted_ids == [held] and await events_of(pool, [held]) == 0


def test_partition_expiry_rule() -> None:
    today = date(2026, 5, 10)
    horizon = datetime(2026, 5, 1, 6, tzinfo=UTC)
    assert expired(date(2026, 4, 30), horizon=horizon, keep_from=today - timedelta(days=1))
    assert not expired(date(2026, 5, 1), horizon=horizon, keep_from=today)  # ends after the horizon
    assert expired(date(2026, 5, 8), horizon=datetime(2026, 5, 10, tzinfo=UTC), keep_from=date(2026, 5, 9))
    # never a day the maintenance keeps (re)creating, however old the horizon says it is
    assert not expired(date(2026, 5, 9), horizon=datetime(2026, 5, 11, tzinfo=UTC), keep_from=date(2026, 5, 9))


async def test_benchmark_helper_measures_events_per_second(pg_dsn: str) -> None:
    figures = await measure(pg_dsn, executions=40, events=25, shard=SHARD + 1, shard_count=SHARDS, check=True)
    assert figures["executions"] == 40 and figures["events"] == 40 * 25
    assert figures["events_per_second"] > 0
    # what `python -m bench` checks before it reports the rate
    assert figures["events_generated"] == 40 * 25 and figures["written"] == 40
    assert figures["manifests"] == 40 and figures["manifest_events"] == 40 * 25 and figures["events_left"] == 0
