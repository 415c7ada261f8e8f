"""Result store conformance: the same checks over every tier (memory, Postgres, the
cache over Postgres), plus the Postgres rows themselves. Real Postgres (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from noetl_common.db import make_pool
from noetl_common.errors import NotFound
from noetl_store import CachedResultStore, MemoryResultStore, PostgresResultStore, ResultStore, encode_json

pytestmark = pytest.mark.integration

EXECUTION_ID = 7_000_000_001


@pytest.fixture(scope="module")
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool]:
    p = make_pool(pg_dsn, min_size=1, max_size=4, name="test-store")
    await p.open(wait=True, timeout=30)
    yield p
    await p.close()


TIERS: dict[str, Callable[[AsyncConnectionPool], ResultStore]] = {
    "memory": lambda pool: MemoryResultStore(),
    "postgres": lambda pool: PostgresResultStore(pool),
    "cached-postgres": lambda pool: CachedResultStore(PostgresResultStore(pool), max_items=4),
}


@pytest.fixture(params=sorted(TIERS))
def store(request: pytest.FixtureRequest, pool: AsyncConnectionPool) -> ResultStore:
    return TIERS[request.param](pool)


async def one(pool: AsyncConnectionPool, sql: str, params: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The first row of ``sql`` as a dict (committed)."""
    async with pool.connection() as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(sql, params)
        row = await cur.fetchone()
        await conn.commit()
    assert row is not None
    return row


async def put(store: ResultStore, value: Any, parent: int | None = None, task: str = "t") -> int:
    ref = await store.put(value, execution_id=EXECUTION_ID, step="step_a", command_id="cmd-1", task=task,
                          parent_ref_id=parent)
    return ref.ref_id


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("value", [
    {"status": "ok", "rows": [{"a": 1}, {"b": None}]}, [1, "two", 3.5, True], "text é ✓", 42, None, {},
])
async def test_put_get_round_trip(store: ResultStore, value: Any) -> None:
    ref_id = await put(store, value)
    assert await store.get(ref_id) == value


async def test_large_value(store: ResultStore) -> None:
    value = {"blob": "x" * 2_000_000, "n": list(range(1000))}
    assert await store.get(await put(store, value)) == value


async def test_get_many(store: ResultStore) -> None:
    ids = [await put(store, {"i": i}) for i in range(3)]
    assert await store.get_many(reversed(ids)) == {i: {"i": n} for n, i in enumerate(ids)}
    assert await store.get_many([]) == {}


async def test_missing_reference_is_not_found(store: ResultStore) -> None:
    with pytest.raises(NotFound, match="not found"):
        await store.get(9_999_999_999)
    existing = await put(store, 1)
    assert await store.get_many([existing, 9_999_999_998]) == {existing: 1}  # missing ones left out


async def test_unknown_parent_is_not_found(store: ResultStore) -> None:
    with pytest.raises(NotFound, match="parent"):
        await put(store, {"x": 1}, parent=9_999_999_997)


async def test_concurrent_puts_get_distinct_ids(store: ResultStore) -> None:
    ids = await asyncio.gather(*(put(store, {"n": n}) for n in range(20)))
    assert len(set(ids)) == 20
    assert await store.get_many(ids) == {i: {"n": n} for n, i in enumerate(ids)}


# ---------------------------------------------------------------- Postgres specifics


async def test_postgres_rows_and_parent_chain(pool: AsyncConnectionPool) -> None:
    store = PostgresResultStore(pool)
    first = await store.put({"a": 1}, execution_id=EXECUTION_ID, step="s", command_id="c-9", task="t1",
                            parent_ref_id=None)
    second = await store.put([1, 2], execution_id=EXECUTION_ID, step="s", command_id="c-9", task="t2",
                             parent_ref_id=first.ref_id)
    assert second.type == "db" and second.uri == f"pg://result_payload/{second.ref_id}"
    row = await one(pool, "SELECT * FROM noetl.result_ref WHERE ref_id = %s", (second.ref_id,))
    data = encode_json([1, 2])
    assert (row["tier"], row["uri"], row["size_bytes"], row["sha256"], row["parent_ref_id"]) == (
        "db", second.uri, len(data), hashlib.sha256(data).hexdigest(), first.ref_id)
    assert (row["execution_id"], row["step"], row["command_id"], row["task"]) == (EXECUTION_ID, "s", "c-9", "t2")
    chain = await store.chain(second.ref_id)
    assert [r.ref_id for r in chain] == [second.ref_id, first.ref_id]
    with pytest.raises(NotFound):
        await store.chain(9_999_999_996)


async def test_failed_put_leaves_nothing_behind(pool: AsyncConnectionPool) -> None:
    before = (await one(pool, "SELECT count(*) AS n FROM noetl.result_ref"))["n"]
    with pytest.raises(NotFound):
        await PostgresResultStore(pool).put({"x": 1}, execution_id=EXECUTION_ID, step="s", command_id="c",
                                            task="t", parent_ref_id=9_999_999_995)
    assert (await one(pool, "SELECT count(*) AS n FROM noetl.result_ref"))["n"] == before


async def test_reference_without_payload_is_not_found(pool: AsyncConnectionPool) -> None:
    row = await one(pool, "INSERT INTO noetl.result_ref (execution_id, tier, uri, size_bytes) "
                          "VALUES (%s, 'object_store', 's3://bucket/key', 1) RETURNING ref_id", (EXECUTION_ID,))
    ref_id = row["ref_id"]
    with pytest.raises(NotFound, match="object_store"):
        await PostgresResultStore(pool).get(ref_id)
    assert await PostgresResultStore(pool).get_many([ref_id]) == {}
