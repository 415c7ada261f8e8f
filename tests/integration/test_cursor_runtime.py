"""Cursor loop slots against a real work table in Postgres: K concurrent slots claim
with FOR UPDATE SKIP LOCKED, a sink insert with ON CONFLICT counts how often each row
ran; the claimed row is reported before its claim commits; one pool per DSN."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from credhelp import put_credentials, store_fetch
from psycopg_pool import AsyncConnectionPool

from noetl_common.db import make_pool
from noetl_proto.v1 import messages_pb2
from noetl_store import PostgresResultStore, envelope_from_proto
from noetl_worker.cursor import CURSOR_KIND, run_cursor_slot
from noetl_worker.cursor_drivers import CursorSpec, Row, default_drivers
from noetl_worker.tools import CommandSecrets, Credentials, Holder, PoolRegistry, PostgresTool, Tools

pytestmark = pytest.mark.integration

CRED = "cursor_test_pg"
_tables = itertools.count(1)


@pytest.fixture(scope="module")
async def runtime_pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool]:
    pool = make_pool(pg_dsn, min_size=1, max_size=4, name="test-cursor")
    await pool.open(wait=True, timeout=30)
    await put_credentials(pool, {CRED: ("postgres", {"dsn": pg_dsn})})
    yield pool
    await pool.close()


@pytest.fixture
async def tools(runtime_pool: AsyncConnectionPool) -> AsyncIterator[Tools]:
    pools = PoolRegistry()
    t = Tools(postgres=PostgresTool(pools), cursors=default_drivers(pools))
    t.test_credentials = Credentials(store_fetch(runtime_pool))  # type: ignore[attr-defined]
    yield t
    await t.close()


def secrets_of(tools: Tools, command: messages_pb2.Command) -> CommandSecrets:
    credentials: Credentials = tools.test_credentials  # type: ignore[attr-defined]
    return credentials.for_command(Holder(command.command_id, command.attempt, command.execution_id, command.step))


async def run_slot(command: messages_pb2.Command, store: Any, tools: Tools, **kw: Any) -> messages_pb2.CallResult:
    """run_cursor_slot with the command's credential access (as the worker gives it)."""
    return await run_cursor_slot(command, store, tools, secrets=secrets_of(tools, command), **kw)


class Work:
    """A work table with ``rows`` pending rows and a sink counting runs per id."""

    def __init__(self, dsn: str, rows: int) -> None:
        n = next(_tables)
        self.dsn = dsn
        self.rows = rows
        self.table = f"public.cursor_work_{n}"
        self.sink = f"public.cursor_sink_{n}"

    async def create(self) -> Work:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {self.table}; DROP TABLE IF EXISTS {self.sink}")
            await conn.execute(f"CREATE TABLE {self.table} (id int PRIMARY KEY, status text NOT NULL DEFAULT 'pending')")
            await conn.execute(f"INSERT INTO {self.table} (id) SELECT generate_series(1, {self.rows})")
            await conn.execute(f"CREATE TABLE {self.sink} (id int PRIMARY KEY, slot int, hits int NOT NULL DEFAULT 1,"
                               " seq bigserial)")
        return self

    @property
    def claim(self) -> str:
        return (f"UPDATE {self.table} SET status = 'claimed' WHERE id = (SELECT id FROM {self.table} "
                "WHERE status = 'pending' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id")

    @property
    def sink_task(self) -> dict[str, Any]:
        return {"name": "save", "kind": "postgres", "auth": CRED,
                "command": f"INSERT INTO {self.sink} (id, slot) VALUES ({{{{ row.id }}}}, {{{{ loop_index }}}}) "
                           f"ON CONFLICT (id) DO UPDATE SET hits = {self.sink}.hits + 1"}

    async def query(self, sql: str) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(sql)
            return list(await cur.fetchall())


def slot_command(work: Work, slot: int, *, tool: Any = None, resume: Any = None, claim: str | None = None,
                 kind: str = "postgres", pool_size: int = 4) -> messages_pb2.Command:
    execution_id = 9_100_000_000 + next(_tables)
    context = {"execution_id": execution_id, "workload": {}, "ctx": {}, "steps": {}, "known_steps": [],
               "event": {}, "iter": {"_index": slot}, "loop_index": slot, "resume": resume,
               "loop": {"instance": "drain:1", "index": slot, "iterator": "row", "mode": "cursor"},
               "cursor": {"kind": kind, "auth": CRED, "claim": claim or work.claim,
                          "options": {"pool_size": pool_size}}}
    spec = {"step": "drain", "tool": tool or [work.sink_task]}
    return messages_pb2.Command(command_id=f"{execution_id}:drain:1:{slot}", execution_id=execution_id,
                                shard_id=2, step="drain", attempt=1, kind=CURSOR_KIND,
                                spec_json=json.dumps(spec), context_json=json.dumps(context))


async def test_concurrent_slots_process_every_row_exactly_once(pg_dsn: str, tools: Tools,
                                                               runtime_pool: AsyncConnectionPool) -> None:
    work = await Work(pg_dsn, 120).create()
    reported: list[Row] = []

    async def report(row: Row, counts: dict[str, int]) -> None:
        reported.append(row)

    store = PostgresResultStore(runtime_pool)
    results = await asyncio.gather(*(run_slot(slot_command(work, k), store, tools, report=report)
                                     for k in range(4)))
    envs = [envelope_from_proto(r.envelope) for r in results]
    assert all(e["status"] == "ok" for e in envs), envs
    assert sum(e["context"]["processed"] for e in envs) == 120
    assert sum(e["context"]["succeeded"] for e in envs) == 120
    assert all(e["context"]["failed"] == 0 for e in envs)
    for env in envs:  # the slot's counts are stored once (persist-before-emit)
        assert await store.get(env["reference"]["ref_id"]) == env["context"]
    assert await work.query(f"SELECT count(*), min(hits), max(hits) FROM {work.sink}") == [(120, 1, 1)]
    assert await work.query(f"SELECT count(*) FROM {work.table} WHERE status <> 'claimed'") == [(0,)]
    assert sorted(r["id"] for r in reported) == list(range(1, 121))
    assert len(await work.query(f"SELECT DISTINCT slot FROM {work.sink}")) > 1  # the slots shared the work
    assert len(tools.postgres.pools) == 1  # type: ignore[union-attr]  # one pool per DSN, claims and tasks


async def test_resume_row_is_run_first(pg_dsn: str, tools: Tools, runtime_pool: AsyncConnectionPool) -> None:
    work = await Work(pg_dsn, 5).create()
    # A previous attempt of the slot claimed row 3 and died while running it.
    await work.query(f"UPDATE {work.table} SET status = 'claimed' WHERE id = 3 RETURNING id")
    result = await run_slot(slot_command(work, 0, resume={"id": 3}), PostgresResultStore(runtime_pool),
                                   tools)
    env = envelope_from_proto(result.envelope)
    assert env["context"] == {"processed": 5, "succeeded": 5, "failed": 0}
    assert await work.query(f"SELECT id, hits FROM {work.sink} ORDER BY seq") == [
        (3, 1), (1, 1), (2, 1), (4, 1), (5, 1)]


async def test_the_row_is_reported_before_its_claim_commits(pg_dsn: str, tools: Tools,
                                                            runtime_pool: AsyncConnectionPool) -> None:
    work = await Work(pg_dsn, 3).create()
    seen: list[tuple[int, str]] = []

    async def report(row: Row, counts: dict[str, int]) -> None:
        # Another session still sees the row pending: the claim has not committed.
        [(status,)] = await work.query(f"SELECT status FROM {work.table} WHERE id = {row['id']}")
        seen.append((row["id"], status))

    await run_slot(slot_command(work, 0), PostgresResultStore(runtime_pool), tools, report=report)
    assert seen == [(1, "pending"), (2, "pending"), (3, "pending")]
    assert await work.query(f"SELECT count(*) FROM {work.table} WHERE status = 'claimed'") == [(3,)]


async def test_failing_rows_are_counted(pg_dsn: str, tools: Tools, runtime_pool: AsyncConnectionPool) -> None:
    work = await Work(pg_dsn, 6).create()
    tool = [{"name": "check", "kind": "postgres", "auth": CRED, "query": "SELECT 1 / ({{ row.id }} % 2) AS x"},
            work.sink_task]
    env = envelope_from_proto((await run_slot(slot_command(work, 0, tool=tool),
                                                     PostgresResultStore(runtime_pool), tools)).envelope)
    assert env["status"] == "ok"
    assert {k: env["context"][k] for k in ("processed", "succeeded", "failed")} == {
        "processed": 6, "succeeded": 3, "failed": 3}
    assert "division by zero" in env["context"]["last_error"]
    assert await work.query(f"SELECT id FROM {work.sink} ORDER BY id") == [(1,), (3,), (5,)]


async def test_claim_sql_error_fails_the_slot(pg_dsn: str, tools: Tools, runtime_pool: AsyncConnectionPool) -> None:
    work = await Work(pg_dsn, 1).create()
    command = slot_command(work, 0, claim="UPDATE public.no_such_work SET status = 'x' RETURNING id")
    env = envelope_from_proto((await run_slot(command, PostgresResultStore(runtime_pool), tools)).envelope)
    assert env["status"] == "error" and env["error"]["code"] == "SQL_ERROR"
    assert 'relation "public.no_such_work" does not exist' in env["error"]["message"]
    assert env["context"] == {"processed": 0, "succeeded": 0, "failed": 0}


async def test_a_claim_of_several_rows_is_rolled_back(pg_dsn: str, tools: Tools,
                                                      runtime_pool: AsyncConnectionPool) -> None:
    work = await Work(pg_dsn, 3).create()
    command = slot_command(work, 0, claim=f"UPDATE {work.table} SET status = 'claimed' RETURNING id")
    env = envelope_from_proto((await run_slot(command, PostgresResultStore(runtime_pool), tools)).envelope)
    assert env["status"] == "error" and env["error"]["code"] == "CURSOR_ERROR"
    assert "returned 3 rows" in env["error"]["message"]
    assert await work.query(f"SELECT count(*) FROM {work.table} WHERE status = 'pending'") == [(3,)]


async def test_unknown_kind_and_unknown_credential(pg_dsn: str, tools: Tools,
                                                   runtime_pool: AsyncConnectionPool) -> None:
    work = await Work(pg_dsn, 1).create()
    store = PostgresResultStore(runtime_pool)
    env = envelope_from_proto((await run_slot(slot_command(work, 0, kind="mysql"), store, tools)).envelope)
    assert env["status"] == "error" and env["error"]["code"] == "CURSOR_ERROR"
    assert env["error"]["message"] == "unknown cursor kind 'mysql' (this worker has drivers for: postgres)"
    command = slot_command(work, 0)
    context = json.loads(command.context_json)
    context["cursor"]["auth"] = "no_such_credential"
    command.context_json = json.dumps(context)
    env = envelope_from_proto((await run_slot(command, store, tools)).envelope)
    assert env["status"] == "error" and env["error"]["code"] == "CREDENTIAL_NOT_FOUND"
    assert "no_such_credential" in env["error"]["message"]


async def test_one_pool_per_dsn_sized_by_the_largest_pool_size(pg_dsn: str, tools: Tools) -> None:
    assert tools.cursors is not None
    secrets = tools.test_credentials.for_command(Holder("1:s:1", 1, 1, "s"))  # type: ignore[attr-defined]
    small = await tools.cursors.open(CursorSpec("postgres", CRED, "SELECT 1", {"pool_size": 3}), secrets)
    large = await tools.cursors.open(CursorSpec("postgres", {"credential": CRED}, "SELECT 2", {"pool_size": 12}),
                                     secrets)
    assert small.pool is large.pool  # type: ignore[attr-defined]
    assert large.pool.max_size == 12  # type: ignore[attr-defined]
    async with small.claim("SELECT 7 AS n") as row:
        assert row == {"n": 7}
    async with small.claim("SELECT 1 WHERE false") as row:
        assert row is None
