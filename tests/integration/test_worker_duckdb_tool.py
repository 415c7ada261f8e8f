"""The duckdb tool in real python sandbox children, attaching a real Postgres through
credentials stored (sealed) in noetl.credential and opened the way the api opens them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from credhelp import put_credentials, store_fetch
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from noetl_common.db import make_pool
from noetl_dsl.templates import RenderContext
from noetl_worker.tools import CallInfo, CommandSecrets, Credentials, DuckdbTool, Holder, PythonPool, Tools
from noetl_worker.tools.duckdb import credential_aliases, database_path, sql_of

pytestmark = pytest.mark.integration

FIXTURE_SQL = ("CREATE TABLE users (id INTEGER, name VARCHAR, age INTEGER);\n"
               "INSERT INTO users VALUES (1, 'Alice', 30), (2, 'Bob', 25), (3, 'Charlie', 35);\n"
               "SELECT name, age FROM users WHERE age >= 30 ORDER BY age;\n")
RESULT_BYTES = 64 * 1024


FIELDS_PASSWORD = "duck-fields-pw-0123"


@pytest.fixture(scope="module")
async def runtime_pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool]:
    pool = make_pool(pg_dsn, min_size=1, max_size=2, name="test-duckdb")
    await pool.open(wait=True, timeout=30)
    parts = conninfo_to_dict(pg_dsn)
    # the fields form: a login user with a password (the test Postgres takes SCRAM only) over
    # the DSN's TLS, the server's CA named
    async with pool.connection() as conn:
        await conn.execute("DROP OWNED BY duck_fields" if await (await conn.execute(
            "SELECT 1 FROM pg_roles WHERE rolname = 'duck_fields'")).fetchone() else "SELECT 1")
        await conn.execute("DROP ROLE IF EXISTS duck_fields")
        await conn.execute(f"CREATE ROLE duck_fields LOGIN PASSWORD '{FIELDS_PASSWORD}'")
        await conn.execute("GRANT CREATE, USAGE ON SCHEMA public TO duck_fields")
    fields = {"host": parts.get("host"), "port": parts.get("port"), "user": "duck_fields",
              "password": FIELDS_PASSWORD, "database": parts.get("dbname"), "sslmode": parts.get("sslmode"),
              "sslrootcert": parts.get("sslrootcert")}
    await put_credentials(pool, {"duck_pg_dsn": ("postgres", {"dsn": pg_dsn}),
                                 "duck_pg_fields": ("postgres", fields),
                                 "duck_token": ("http_bearer", {"token": "tok-123456"})})
    async with pool.connection() as conn:
        await conn.execute("DROP TABLE IF EXISTS public.duck_src")
        await conn.execute("CREATE TABLE public.duck_src (id int, label text)")
        await conn.execute("INSERT INTO public.duck_src SELECT g, 'row ' || g FROM generate_series(1, 5) g")
        await conn.execute("GRANT SELECT ON public.duck_src TO duck_fields")
    yield pool
    await pool.close()


@pytest.fixture(scope="module")
async def python() -> AsyncIterator[PythonPool]:
    async with PythonPool(2, memory_mb=1024, result_bytes=RESULT_BYTES) as pool:
        yield pool


@pytest.fixture()
def tool(python: PythonPool, tmp_path: Path) -> DuckdbTool:
    return DuckdbTool(python, tmp_path / "duck", max_result_bytes=RESULT_BYTES, memory_mb=1024)


def secrets_for(pool: AsyncConnectionPool) -> CommandSecrets:
    return Credentials(store_fetch(pool)).for_command(Holder("1:s:1", 1, 1, "s"))


async def test_the_fixture_statements_return_the_last_select(tool: DuckdbTool) -> None:
    out = await tool.run({"query": FIXTURE_SQL, "database": ":memory:"})
    assert out.status == "ok", out.error
    assert out.data == {"status": "ok", "columns": ["name", "age"], "row_count": 2,
                        "rows": [{"name": "Alice", "age": 30}, {"name": "Charlie", "age": 35}]}


async def test_statements_split_by_duckdb_not_by_semicolons_in_literals(tool: DuckdbTool) -> None:
    out = await tool.run({"commands": ["CREATE TABLE t (s VARCHAR)", "INSERT INTO t VALUES ('a;b'), ('it''s; ok')",
                                       "SELECT s FROM t ORDER BY s"]})
    assert out.status == "ok", out.error
    assert [r["s"] for r in out.data["rows"]] == ["a;b", "it's; ok"]


async def test_dml_only_reports_the_changed_rows(tool: DuckdbTool) -> None:
    out = await tool.run({"command": "CREATE TABLE t AS SELECT range AS i FROM range(10); DELETE FROM t WHERE i < 4"})
    assert out.status == "ok", out.error
    assert out.data == {"status": "ok", "row_count": 4}


async def test_values_are_plain_json_and_params_bind(tool: DuckdbTool) -> None:
    out = await tool.run({"sql": "SELECT DATE '2024-01-02' AS d, 1.50::DECIMAL(4,2) AS n, [1, 2] AS l, "
                                 "{'k': 'v'} AS s, NULL AS z, ? AS p", "params": ["x"]})
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"d": "2024-01-02", "n": 1.5, "l": [1, 2], "s": {"k": "v"}, "z": None, "p": "x"}]
    two = await tool.run({"sql": "SELECT ?; SELECT ?", "params": [1]})
    assert two.error is not None and two.error.code == "INVALID_TASK" and "single statement" in two.error.message


async def test_sql_error_carries_duckdb_class_and_message(tool: DuckdbTool) -> None:
    out = await tool.run({"query": "SELECT * FROM no_such_table"})
    assert out.status == "error" and out.error is not None
    assert out.error.code == "SQL_ERROR" and out.error.exception_type == "CatalogException"
    assert "no_such_table" in out.error.message and "traceback" not in out.error.details
    assert out.error.retryable is False


async def test_a_file_database_persists_inside_the_directory_only(tool: DuckdbTool) -> None:
    first = await tool.run({"query": "CREATE TABLE k AS SELECT 7 AS v", "database": "run1/db.duckdb"})
    assert first.status == "ok", first.error
    again = await tool.run({"query": "SELECT v FROM k", "database": "run1/db.duckdb"})
    assert again.status == "ok" and again.data["rows"] == [{"v": 7}]
    assert (tool.directory / "run1" / "db.duckdb").is_file()
    for bad in ("../escape.duckdb", "/etc/passwd", "a/../../x.duckdb"):
        out = await tool.run({"query": "SELECT 1", "database": bad})
        assert out.status == "error" and out.error is not None and out.error.code == "INVALID_TASK", bad
        assert "outside the worker's DuckDB directory" in out.error.message


async def test_rows_past_the_result_limit_fail_the_task(python: PythonPool, tmp_path: Path) -> None:
    tools = Tools(python=python, duckdb=DuckdbTool(python, tmp_path, max_result_bytes=RESULT_BYTES))
    out = await tools.run_task({"kind": "duckdb", "query": "SELECT repeat('x', 100) AS s FROM range(5000)"},
                               RenderContext({}))
    assert out.status == "error" and out.error is not None and out.error.code == "RESULT_TOO_LARGE", out.error
    small = await tools.run_task({"kind": "duckdb", "query": "SELECT 1 AS one"}, RenderContext({}))
    assert small.status == "ok" and small.data["rows"] == [{"one": 1}]  # the child was kept or replaced


async def test_a_timeout_kills_the_query(tool: DuckdbTool) -> None:
    out = await tool.run({"query": "SELECT count(*) FROM range(100000000000) a"}, timeout_sec=1)
    assert out.status == "error" and out.error is not None and out.error.code == "TIMEOUT"


async def test_attach_postgres_through_a_stored_credential(tool: DuckdbTool,
                                                          runtime_pool: AsyncConnectionPool) -> None:
    sql = ("INSTALL postgres; LOAD postgres;\n"
           "ATTACH '' AS pg (TYPE postgres, READ_ONLY);\n"
           "SELECT count(*) AS n, max(label) AS top FROM pg.public.duck_src;")
    out = await tool.run({"query": sql, "auth": "duck_pg_dsn"}, secrets=secrets_for(runtime_pool))
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"n": 5, "top": "row 5"}]


async def test_alias_map_names_the_secret_and_writes_back(tool: DuckdbTool,
                                                         runtime_pool: AsyncConnectionPool) -> None:
    sql = ("ATTACH '' AS pg_db (TYPE postgres, SECRET pg_db);\n"
           "CREATE TABLE pg_db.public.duck_out AS SELECT id * 10 AS v FROM pg_db.public.duck_src;\n"
           "SELECT sum(v) AS total FROM pg_db.public.duck_out;")
    secrets = secrets_for(runtime_pool)
    async with runtime_pool.connection() as conn:
        await conn.execute("DROP TABLE IF EXISTS public.duck_out")
    out = await tool.run({"query": sql, "auth": {"pg_db": {"credential": "duck_pg_fields"}}}, secrets=secrets)
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"total": 150}]
    legacy = await tool.run({"query": "ATTACH '' AS pg_db (TYPE postgres, SECRET pg_db, READ_ONLY);"
                                      "SELECT count(*) AS n FROM pg_db.public.duck_src",
                             "credentials": {"pg_db": {"key": "duck_pg_dsn"}}}, secrets=secrets)
    assert legacy.status == "ok" and legacy.data["rows"] == [{"n": 5}], legacy.error
    async with runtime_pool.connection() as conn:
        rows = await (await conn.execute("SELECT count(*) FROM public.duck_out")).fetchall()
    assert rows == [{"count": 5}]


async def test_credential_failures(tool: DuckdbTool, runtime_pool: AsyncConnectionPool) -> None:
    secrets = secrets_for(runtime_pool)
    missing = await tool.run({"query": "SELECT 1", "credential": "no_such_cred"}, secrets=secrets)
    assert missing.error is not None and missing.error.code == "CREDENTIAL_NOT_FOUND"
    wrong_kind = await tool.run({"query": "SELECT 1", "auth": "duck_token"}, secrets=secrets)
    assert wrong_kind.error is not None and wrong_kind.error.code == "INVALID_TASK"
    assert "cannot be used by duckdb" in wrong_kind.error.message


async def test_rendered_through_tools_with_the_call_secrets(python: PythonPool, tmp_path: Path,
                                                            runtime_pool: AsyncConnectionPool) -> None:
    tools = Tools(python=python, duckdb=DuckdbTool(python, tmp_path))
    call = CallInfo(1, "1:s:1", "s", "k", secrets=secrets_for(runtime_pool))
    task: dict[str, Any] = {"kind": "duckdb", "auth": "{{ cred }}",
                            "query": "ATTACH '' AS pg (TYPE postgres); SELECT id FROM pg.public.duck_src "
                                     "WHERE id = {{ want }}"}
    out = await tools.run_task(task, RenderContext({"cred": "duck_pg_dsn", "want": 3}), call=call)
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"id": 3}]


def test_helpers() -> None:
    assert sql_of({"commands": ["SELECT 1;", " ", "SELECT 2"]}) == "SELECT 1;\nSELECT 2"
    assert sql_of({"query": "  "}) is None
    assert credential_aliases("pg") is None and credential_aliases({"credential": "pg"}) is None
    assert credential_aliases({"a": {"key": "pg"}, "b": "other"}) == {"a": "pg", "b": "other"}
    with pytest.raises(ValueError, match="names no credential"):
        credential_aliases({"a": {"type": "postgres"}})
    root = Path("/srv/duck")
    assert database_path(None, root) == ":memory:" and database_path(":memory:", root) == ":memory:"
    assert database_path("x.duckdb", root) == "/srv/duck/x.duckdb"
    with pytest.raises(ValueError):
        database_path("/tmp/x.duckdb", root)


def test_libpq_settings_reach_the_extension_through_its_environment() -> None:
    """A DuckDB postgres secret has no TLS or passfile option: they go to libpq's PG*
    variables, one value per task (two credentials disagreeing are refused)."""
    from noetl_worker.duckdb_child import DuckdbSetupError, libpq_env

    dsn = {"name": "a", "fields": {"dsn": "host=h dbname=d sslmode=verify-full sslrootcert=/ca.crt passfile=/p"}}
    fields = {"name": "b", "fields": {"host": "h", "sslmode": "verify-full"}}
    assert libpq_env([dsn, fields]) == {"PGSSLMODE": "verify-full", "PGSSLROOTCERT": "/ca.crt", "PGPASSFILE": "/p"}
    with pytest.raises(DuckdbSetupError, match="disagree on sslmode"):
        libpq_env([dsn, {"name": "c", "fields": {"host": "h", "sslmode": "disable"}}])
