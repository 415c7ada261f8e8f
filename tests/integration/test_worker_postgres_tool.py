"""The postgres tool against a real Postgres, with credentials stored (sealed) in
noetl.credential and opened the way the api opens them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from credhelp import put_credentials, store_fetch
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from noetl_common.db import make_pool
from noetl_common.redact import MASK
from noetl_dsl.templates import RenderContext
from noetl_store import ResultTooLarge
from noetl_worker.tools import (
    CommandSecrets,
    Credentials,
    Holder,
    PoolRegistry,
    PostgresTool,
    Tools,
    dsn_from,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def runtime_pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool]:
    pool = make_pool(pg_dsn, min_size=1, max_size=2, name="test-pgtool")
    await pool.open(wait=True, timeout=30)
    parts = conninfo_to_dict(pg_dsn)
    # the fields form: a user with a password (SCRAM) over verify-full TLS, the server's CA named
    login(pg_dsn, "pgtool_fields", FIELDS_PASSWORD)
    fields = {"host": parts.get("host"), "port": parts.get("port"), "user": "pgtool_fields",
              "password": FIELDS_PASSWORD, "database": parts.get("dbname"), "sslmode": parts.get("sslmode"),
              "sslrootcert": parts.get("sslrootcert")}
    await put_credentials(pool, {"pg_test_dsn": ("postgres", {"dsn": pg_dsn}),
                                 "pg_test_fields": ("postgres", fields)})
    yield pool
    await pool.close()


FIELDS_PASSWORD = "fields-pw-0123"


def login(owner_dsn: str, user: str, password: str) -> None:
    """A login user of the test Postgres (which takes SCRAM passwords only) with ``password``."""
    with psycopg.connect(owner_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP ROLE IF EXISTS {}").format(pgsql.Identifier(user)))
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(pgsql.Identifier(user),
                                                                                 pgsql.Literal(password)))


def as_user(owner_dsn: str, user: str, password: str) -> str:
    """``owner_dsn`` (host, port, TLS) as ``user`` with an inline password."""
    params = {k: v for k, v in conninfo_to_dict(owner_dsn).items() if k not in ("passfile", "user", "password")}
    return make_conninfo(**params, user=user, password=password)  # type: ignore[arg-type]


class CredentialedTool(PostgresTool):
    """The tool with one command's credential access (what a TaskCaller's CallInfo gives it)."""

    def __init__(self, pools: PoolRegistry, secrets: CommandSecrets, **kw: Any) -> None:
        super().__init__(pools, **kw)
        self.secrets = secrets

    async def run(self, sql: str, auth: Any, *, timeout_sec: float | None = None,
                  secrets: CommandSecrets | None = None) -> Any:
        return await super().run(sql, auth, timeout_sec=timeout_sec, secrets=secrets or self.secrets)


def command_secrets(pool: AsyncConnectionPool) -> CommandSecrets:
    return Credentials(store_fetch(pool)).for_command(Holder("1:s:1", 1, 1, "s"))


@pytest.fixture(scope="module")
async def tool(runtime_pool: AsyncConnectionPool) -> AsyncIterator[PostgresTool]:
    t = CredentialedTool(PoolRegistry(max_size=2), command_secrets(runtime_pool))
    yield t
    await t.pools.close()


async def test_select_rows_shape(tool: PostgresTool) -> None:
    out = await tool.run("SELECT 1 AS a, 'x' AS b UNION ALL SELECT 2, 'y' ORDER BY a", "pg_test_dsn")
    assert out.status == "ok", out.error
    rows = [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    # upstream's Rust shape at the top, its Python reference's per statement
    assert out.data == {"status": "ok", "rows": rows, "row_count": 2, "columns": ["a", "b"],
                        "command_0": {"status": "success", "rows": rows, "row_count": 2, "columns": ["a", "b"]}}


async def test_values_are_plain_json(tool: PostgresTool) -> None:
    out = await tool.run("SELECT DATE '2024-01-02' AS d, 1.50::numeric AS n, 3::numeric AS i, "
                         "'{\"k\": [1]}'::jsonb AS j, NULL AS z", "pg_test_fields")
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"d": "2024-01-02", "n": 1.5, "i": 3, "j": {"k": [1]}, "z": None}]


async def test_ddl_and_multiple_statements(tool: PostgresTool) -> None:
    sql = ("DROP TABLE IF EXISTS public.worker_tool_t; CREATE TABLE public.worker_tool_t (id int PRIMARY KEY, v text);"
           "INSERT INTO public.worker_tool_t VALUES (1, 'a'), (2, 'b');"
           "UPDATE public.worker_tool_t SET v = 'c' WHERE id = 2;")
    out = await tool.run(sql, "pg_test_dsn")
    assert out.data == {
        "status": "ok", "row_count": 1,
        "command_0": {"status": "success", "row_count": 0, "message": "DROP TABLE"},
        "command_1": {"status": "success", "row_count": 0, "message": "CREATE TABLE"},
        "command_2": {"status": "success", "row_count": 2, "message": "INSERT 0 2"},
        "command_3": {"status": "success", "row_count": 1, "message": "UPDATE 1"}}
    out = await tool.run("CREATE TABLE IF NOT EXISTS public.worker_tool_t (id int)", "pg_test_dsn")
    assert out.data == {"status": "ok", "row_count": 0,
                        "command_0": {"status": "success", "row_count": 0, "message": "CREATE TABLE"}}


async def test_last_statement_returning_rows_wins(tool: PostgresTool) -> None:
    sql = "SELECT 1 AS first; SELECT id, v FROM public.worker_tool_t ORDER BY id; DELETE FROM public.worker_tool_t WHERE false"
    await tool.run("CREATE TABLE IF NOT EXISTS public.worker_tool_t (id int PRIMARY KEY, v text); "
                   "INSERT INTO public.worker_tool_t VALUES (10, 'z') ON CONFLICT DO NOTHING", "pg_test_dsn")
    out = await tool.run(sql, "pg_test_dsn")
    assert out.status == "ok"
    assert out.data["columns"] == ["id", "v"] and {"id": 10, "v": "z"} in out.data["rows"]
    assert out.data["command_0"]["rows"] == [{"first": 1}]
    assert out.data["command_1"]["rows"] == out.data["rows"]
    assert out.data["command_2"] == {"status": "success", "row_count": 0, "message": "DELETE 0"}


async def test_syntax_error_surfaces_sqlstate_and_server_message(tool: PostgresTool) -> None:
    """broken_sql.yaml."""
    out = await tool.run("SELECT\n  COUNT(*) as row_count,\nFROM patient_info;", "pg_test_dsn")
    assert out.status == "error" and out.error is not None
    assert out.error.code == "SQL_ERROR" and out.error.exception_type == "SyntaxError"
    assert out.error.to_dict()["pg_code"] == "42601"
    assert "42601" in out.error.message
    assert 'syntax error at or near "FROM"' in out.error.message
    assert out.error.details["sqlstate"] == "42601" and not out.error.retryable


async def test_unknown_table_error(tool: PostgresTool) -> None:
    out = await tool.run("SELECT * FROM no_such_table_xyz", "pg_test_dsn")
    assert out.error is not None and "42P01" in out.error.message and "no_such_table_xyz" in out.error.message


async def test_unknown_credential_names_it(tool: PostgresTool) -> None:
    out = await tool.run("SELECT 1", "pg_missing")
    assert out.status == "error" and out.error is not None
    assert out.error.code == "CREDENTIAL_NOT_FOUND"
    assert out.error.message == "credential 'pg_missing' not found"


async def test_statement_timeout(tool: PostgresTool) -> None:
    out = await tool.run("SELECT pg_sleep(5)", "pg_test_dsn", timeout_sec=0.3)
    assert out.error is not None and out.error.code == "TIMEOUT" and "57014" in out.error.message
    again = await tool.run("SHOW statement_timeout", "pg_test_dsn")
    assert again.data["rows"][0]["statement_timeout"] == "0"


async def test_one_pool_per_dsn(tool: PostgresTool) -> None:
    for _ in range(3):
        await tool.run("SELECT 1", "pg_test_dsn")
    assert len(tool.pools) <= 2  # one per distinct DSN (the dsn and the fields credentials)


async def test_bad_dsn_fails_with_the_connection_error(runtime_pool: AsyncConnectionPool) -> None:
    await put_credentials(runtime_pool, {"pg_bad": ("postgres", {"host": "127.0.0.1", "port": 1, "dbname": "x"})})
    tool = CredentialedTool(PoolRegistry(), command_secrets(runtime_pool))
    out = await tool.run("SELECT 1", "pg_bad")
    assert out.error is not None and out.error.code == "SQL_ERROR" and out.error.retryable
    await tool.pools.close()


async def test_rendered_through_tools(tool: PostgresTool) -> None:
    """iterator_save_test shape: templated auth and SQL rendered as text."""
    tools = Tools(postgres=tool)
    scope = RenderContext({"pg_auth": "pg_test_dsn", "execution_id": 55, "iter": {"item": {"name": "o'k"}}})
    task = {"kind": "postgres", "auth": "{{ pg_auth }}",
            "command": "SELECT '{{ execution_id }}:{{ iter.item.name | replace(\"'\", \"''\") }}' AS id"}
    out = await tools.run_task(task, scope)
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"id": "55:o'k"}]
    bad = await tools.run_task({"kind": "postgres", "auth": "{{ nope }}", "query": "SELECT 1"}, scope)
    assert bad.error is not None and bad.error.code == "TEMPLATE_ERROR" and "{{ nope }}" in bad.error.message


# ---------------------------------------------------------------- result size limit (NOETL_LIMIT_RESULT_BYTES)

MIB = 1024 * 1024
WIDE = "SELECT n, repeat('x', 1000) AS pad FROM generate_series(1, {rows}) AS n"


async def test_rows_past_the_limit_stop_the_conversion(runtime_pool: AsyncConnectionPool) -> None:
    """20 MB of rows, 1 MiB allowed: refused once the converted rows pass the limit (a batch
    of FETCH_ROWS at most beyond it), not after turning all of them into objects."""
    limited = CredentialedTool(PoolRegistry(max_size=1), command_secrets(runtime_pool), max_result_bytes=MIB)
    with pytest.raises(ResultTooLarge) as caught:
        await limited.run(WIDE.format(rows=20_000), "pg_test_dsn")
    assert caught.value.limit == MIB and not caught.value.exact
    assert MIB < caught.value.size < 3 * MIB  # stopped within about one batch (~1 MB) of the limit
    small = await limited.run(WIDE.format(rows=900), "pg_test_dsn")  # ~0.9 MB: under the limit
    assert small.status == "ok" and small.data["row_count"] == 900
    assert small.data["rows"][0] == {"n": 1, "pad": "x" * 1000}
    out = await Tools(postgres=limited).run_task({"kind": "postgres", "name": "dump", "auth": "pg_test_dsn",
                                                  "query": WIDE.format(rows=20_000)}, RenderContext({}))
    assert out.error is not None and (out.error.code, out.error.retryable) == ("RESULT_TOO_LARGE", False)
    assert out.error.message.startswith("result of task 'dump' is at least ")
    assert out.error.message.endswith(f" bytes; limit NOETL_LIMIT_RESULT_BYTES={MIB}")
    again = await limited.run("SHOW statement_timeout", "pg_test_dsn")  # the connection went back clean
    assert again.status == "ok"
    await limited.pools.close()


def test_dsn_from_fields() -> None:
    dsn = dsn_from({"db_host": "h", "db_port": 5433, "username": "u", "password": "p w", "database": "d"})
    assert conninfo_to_dict(dsn) == {"host": "h", "port": "5433", "user": "u", "password": "p w", "dbname": "d"}
    assert dsn_from({"dsn": "postgresql://x"}) == "postgresql://x"
    with pytest.raises(ValueError):
        dsn_from({"user": "u"})


async def test_the_password_of_the_dsn_used_is_known_to_the_redactor(runtime_pool: AsyncConnectionPool,
                                                                      pg_dsn: str) -> None:
    """A DSN's password (stored or inline) is added to the command's redactor; an error that
    quotes it is masked with it (the runner masks every outcome with it: test_worker_secrets)."""
    login(pg_dsn, "pgtool_stored", "sql-s3cret-pw")
    login(pg_dsn, "pgtool_inline", "inline-s3cret")
    await put_credentials(runtime_pool, {"pg_pw": ("postgres", {"dsn": as_user(pg_dsn, "pgtool_stored",
                                                                               "sql-s3cret-pw")})})
    secrets = command_secrets(runtime_pool)
    tool = CredentialedTool(PoolRegistry(), secrets)
    out = await tool.run("SELECT 'sql-s3cret-pw'::int", "pg_pw")
    assert out.error is not None and "sql-s3cret-pw" in out.error.message  # the server quotes it
    assert secrets.redactor.text(out.error.message) == out.error.message.replace("sql-s3cret-pw", MASK)
    inline = await tool.run("SELECT 1", {"dsn": as_user(pg_dsn, "pgtool_inline", "inline-s3cret")})
    assert inline.status == "ok" and secrets.redactor.text("inline-s3cret") == MASK
    bad = await tool.run("SELECT 1", {"user": "x", "password": "inline-s3cret"})  # no dsn/host: named nothing
    assert bad.error is not None and "inline-s3cret" not in bad.error.message
    await tool.pools.close()
