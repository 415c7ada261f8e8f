"""The schema against real Postgres: the SQL shard hash equals the Python one, migrations
are idempotent, event partitions exist ahead of need, and the event result CHECK
admits v3 envelopes only."""

from __future__ import annotations

import json
import random
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest

from noetl_common.db import Pool, ensure_event_partitions, migrate, migrations, partition_name
from noetl_common.ids import SnowflakeGenerator, mix64, shard_for, snowflake_at

pytestmark = pytest.mark.integration

SNOWFLAKES = SnowflakeGenerator(node_id=1021)


async def fetch(pool: Pool, sql: str, params: Any = ()) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        rows = await cur.fetchall()
        await conn.commit()
    return rows


# ---------------------------------------------------------------- mix64 / shard_for


def sample_ids() -> list[int]:
    rng = random.Random(20240101)
    edges = [0, 1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 2, 2**63 - 1, -1, -(2**63)]
    snowflakes = [SNOWFLAKES.next_id() for _ in range(200)]
    return edges + snowflakes + [rng.randrange(1, 2**63) for _ in range(800)]


async def test_sql_mix64_and_shard_for_equal_python(pool: Pool) -> None:
    ids = sample_ids()
    counts = [1, 2, 7, 16, 1000, 4096]
    rows = await fetch(
        pool,
        "SELECT v, noetl.mix64(v) AS mixed, array_agg(noetl.shard_for(v, n) ORDER BY o) AS shards"
        " FROM unnest(%s::bigint[]) v, unnest(%s::int[]) WITH ORDINALITY AS c(n, o) GROUP BY v",
        (ids, counts))
    assert len(rows) == len(set(ids))
    for row in rows:
        v = row["v"]
        assert int(row["mixed"]) == mix64(v), v
        assert row["shards"] == [shard_for(v, n) for n in counts], v


# ---------------------------------------------------------------- migrations


def test_migrations_are_idempotent(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        before = conn.execute("SELECT version, name, applied_at FROM noetl.schema_migration ORDER BY version").fetchall()
    assert [r[0] for r in before] == [m.version for m in migrations()]

    assert migrate(pg_dsn) == []

    with psycopg.connect(pg_dsn) as conn:
        after = conn.execute("SELECT version, name, applied_at FROM noetl.schema_migration ORDER BY version").fetchall()
    assert after == before


# ---------------------------------------------------------------- partitions


async def existing_partitions(pool: Pool) -> set[str]:
    rows = await fetch(
        pool,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace"
        " WHERE n.nspname = 'noetl' AND p.relname = 'event'")
    return {r["relname"] for r in rows}


async def test_event_partitions_exist_around_today(pool: Pool) -> None:
    today = datetime.now(UTC).date()
    existing = await existing_partitions(pool)
    for day in (today - timedelta(days=1), today, today + timedelta(days=1), today + timedelta(days=3)):
        assert partition_name(day) in existing


async def test_ensure_event_partitions_creates_missing_days(pool: Pool) -> None:
    # Far ahead, so no other test or migration has made these yet.
    first = date(2060, 1, 1) + timedelta(days=random.randrange(3000))
    names = [partition_name(first + timedelta(days=i)) for i in range(2)]
    try:
        assert not set(names) & await existing_partitions(pool)
        assert await ensure_event_partitions(pool, first, 2) == names
        assert set(names) <= await existing_partitions(pool)
        assert await ensure_event_partitions(pool, first, 2) == []

        # An id minted at noon of the second day lands in that day's partition.
        noon = datetime(first.year, first.month, first.day, 12, tzinfo=UTC) + timedelta(days=1)
        eid = snowflake_at(int(noon.timestamp() * 1000))
        async with pool.connection() as conn, conn.transaction(force_rollback=True):
            cur = await conn.execute(
                "INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type)"
                " VALUES (%s, 0, 1, 'playbook.started') RETURNING tableoid", (eid,))
            inserted = await cur.fetchone()
            assert inserted is not None
            cur = await conn.execute("SELECT relname FROM pg_class WHERE oid = %s", (inserted["tableoid"],))
            row = await cur.fetchone()
        assert row is not None and row["relname"] == names[1]
    finally:
        async with pool.connection() as conn:
            for name in names:
                await conn.execute(f"DROP TABLE IF EXISTS noetl.{name}".encode())
            await conn.commit()


# ---------------------------------------------------------------- the result CHECK


V3_OK = {"status": "ok", "reference": {"ref_id": 7, "type": "db", "uri": "pg://result_payload/7"},
         "parent_ref": {"ref_id": 6}, "context": {"status": "initialized", "n": 3}}
V3_ERROR = {"status": "error", "reference": None, "parent_ref": None, "context": {},
            "error": {"code": "TOOL_ERROR", "message": "boom", "kind": "ValueError", "retryable": False}}


async def insert_event(pool: Pool, result: Any) -> None:
    """Insert one event with ``result`` and roll back (nothing is left behind)."""
    async with pool.connection() as conn, conn.transaction(force_rollback=True):
        await conn.execute(
            "INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type, step, result)"
            " VALUES (%s, 0, 1, 'call.done', 'start', %s::jsonb)",
            (SNOWFLAKES.next_id(), json.dumps(result) if result is not None else None))


@pytest.mark.parametrize("result", [V3_OK, V3_ERROR, {"status": "ok"}, None], ids=["ok", "error", "minimal", "null"])
async def test_check_accepts_v3_envelopes(pool: Pool, result: Any) -> None:
    await insert_event(pool, result)


@pytest.mark.parametrize("result", [
    {**V3_OK, "rows": [{"id": 1}, {"id": 2}]},   # an inline payload
    {**V3_OK, "data": {"big": "x" * 100}},
    {k: v for k, v in V3_OK.items() if k != "status"},
    [V3_OK],
    "ok",
], ids=["inline-rows", "inline-data", "no-status", "array", "scalar"])
async def test_check_rejects_anything_else(pool: Pool, result: Any) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="chk_event_result_shape"):
        await insert_event(pool, result)
