"""The postgres tool: run a task's SQL with the connection its ``auth`` credential names.

* ``auth`` (or ``credential``) names a stored credential (``credentials.py``: the worker
  asks the api for it, for the command it runs) whose data holds a ``dsn`` or
  host/port/user/password/dbname (``database`` and ``db_*`` spellings too); a mapping
  holding ``dsn``/``host`` itself is an inline connection. The DSN's password is added to
  the command's redactor either way, and errors name the credential, never its fields.
* One ``AsyncConnectionPool`` per DSN per process (``PoolRegistry``), opened lazily on
  first use after one direct connection attempt (so a bad DSN fails with the server's
  message instead of a pool timeout), closed on shutdown. Connections are autocommit:
  a multi-statement text runs as one implicit transaction. Cursor loops claim rows
  through the same pools (``cursor_drivers/postgres.py``), growing one to their
  ``pool_size`` when asked.
* The SQL text may hold several statements. The value has both of upstream's shapes:
  its Rust runtime's at the top, the last statement that returned rows (``{"status":
  "ok", "rows", "row_count", "columns"}``), else ``{"status": "ok", "row_count"}`` of the
  last statement; and its Python reference's ``command_<i>`` per statement, in order
  (``{"status": "success", "rows", "row_count", "columns"}`` for a statement returning
  rows, ``{"status": "success", "row_count", "message"}`` (the server's command tag,
  ``INSERT 0 1``) otherwise). Playbooks read either (``{{ step.rows }}``,
  ``{{ step.command_0.rows }}``). The rows of the last row-returning statement are
  encoded twice in the stored result (docs/CONFORMANCE.md).
* SQL errors carry the SQLSTATE and the server's message.
* Rows are turned into plain JSON values ``FETCH_ROWS`` at a time, and their encoded size
  is counted as they are: once it passes ``max_result_bytes`` (``NOETL_LIMIT_RESULT_BYTES``)
  the task fails with ``ResultTooLarge`` without converting the rest (libpq has received
  the whole result by then: a client-side cursor; the Python objects, several times
  larger, are what is bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from noetl_common.errors import NoetlError, NotFound
from noetl_dsl.credrefs import reference_of
from noetl_store import check_result_size, decode_json, encode_json

from .credentials import CommandSecrets, credential_failure
from .outcome import INVALID_TASK, SQL_ERROR, TIMEOUT, ErrorDetail, ToolOutcome

logger = logging.getLogger(__name__)

_CONNINFO_KEYS: dict[str, tuple[str, ...]] = {
    "host": ("host", "db_host", "hostname"),
    "port": ("port", "db_port"),
    "user": ("user", "username", "db_user"),
    "password": ("password", "db_password"),
    "dbname": ("dbname", "database", "db_name", "db"),
    "sslmode": ("sslmode", "ssl_mode"),
    # the CA file for sslmode=verify-full (a path on the worker)
    "sslrootcert": ("sslrootcert", "ssl_root_cert"),
}
# SQLSTATE classes worth retrying: connection, transaction rollback, resources, operator intervention.
_RETRYABLE_CLASSES = ("08", "40", "53", "57P")
FETCH_ROWS = 1000  # rows converted (and measured) at a time


def dsn_from(data: Mapping[str, Any]) -> str:
    """A libpq connection string from a credential's data."""
    dsn = data.get("dsn") or data.get("conninfo") or data.get("url")
    if dsn:
        return str(dsn)
    params = {}
    for key, names in _CONNINFO_KEYS.items():
        for name in names:
            if data.get(name) not in (None, ""):
                params[key] = str(data[name])
                break
    if not params.get("host") and not params.get("dbname"):
        raise ValueError("credential data has neither `dsn` nor host/dbname")
    return make_conninfo(**params)


class PoolRegistry:
    """One autocommit connection pool per DSN for this process."""

    def __init__(self, *, max_size: int = 8, timeout: float = 30.0) -> None:
        self.max_size = max_size
        self.timeout = timeout
        self._pools: dict[str, AsyncConnectionPool] = {}
        self._lock = asyncio.Lock()

    async def get(self, dsn: str, *, max_size: int | None = None) -> AsyncConnectionPool:
        """The pool of ``dsn`` (created on first use). ``max_size`` sizes a new pool and
        grows an existing smaller one; a pool never shrinks while the process runs."""
        want = max(1, max_size or self.max_size)
        pool = self._pools.get(dsn)
        if pool is not None and pool.max_size >= want:
            return pool
        async with self._lock:
            pool = self._pools.get(dsn)
            if pool is None:
                # Fail fast with the server's message when the DSN is wrong.
                conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=10, autocommit=True)
                await conn.close()
                pool = AsyncConnectionPool(dsn, min_size=1, max_size=want, open=False,
                                           timeout=self.timeout, name="noetl-worker-tool",
                                           kwargs={"autocommit": True})
                await pool.open(wait=False)
                self._pools[dsn] = pool
            elif pool.max_size < want:
                await pool.resize(pool.min_size, want)
        return pool

    async def close(self) -> None:
        async with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            try:
                await pool.close(timeout=2)
            except Exception:  # pragma: no cover - shutdown best effort
                logger.exception("closing a postgres tool pool failed")

    def __len__(self) -> int:
        return len(self._pools)


def sql_error(exc: psycopg.Error) -> ErrorDetail:
    """The error detail of a psycopg error: SQLSTATE, the server's message, retryable
    for connection / rollback / resource classes, ``TIMEOUT`` for a cancelled statement."""
    diag = exc.diag
    sqlstate = exc.sqlstate or ""
    primary = (diag.message_primary or str(exc)).strip()
    message = f"SQLSTATE {sqlstate}: {primary}" if sqlstate else primary
    details = {k: v for k, v in {"sqlstate": sqlstate, "detail": diag.message_detail,
                                 "hint": diag.message_hint, "position": diag.statement_position}.items() if v}
    if sqlstate == "57014":  # query_canceled, e.g. by statement_timeout
        return ErrorDetail(TIMEOUT, message, type(exc).__name__, True, details)
    retryable = (isinstance(exc, psycopg.OperationalError) and not sqlstate) or \
        any(sqlstate.startswith(c) for c in _RETRYABLE_CLASSES)
    return ErrorDetail(SQL_ERROR, message, type(exc).__name__, retryable, details)


def _sql_failure(exc: psycopg.Error) -> ToolOutcome:
    return ToolOutcome("error", None, sql_error(exc))


def describe_auth(auth: Any) -> str:
    """What an ``auth`` value names, for messages: never its fields (an inline mapping may
    hold a password)."""
    ref = reference_of(auth)
    if ref is not None:
        return f"credential {ref!r}"
    return "the inline connection" if isinstance(auth, Mapping) else f"auth of type {type(auth).__name__}"


async def resolve_dsn(secrets: CommandSecrets | None, auth: Any) -> str:
    """``auth`` is a credential name, or a mapping naming one (``credential``/``key``/
    ``name``) or holding connection fields inline. NotFound / CredentialDenied / Conflict /
    Unavailable from the credential lookup, ValueError for one without connection fields.
    The DSN's password is added to ``secrets``' redactor."""
    ref = reference_of(auth)
    if ref is not None:
        if secrets is None:
            raise NotFound(f"credential {ref!r} not found (this worker has no credential access)")
        dsn = dsn_from((await secrets.get(ref.strip())).data)
    elif isinstance(auth, Mapping):
        dsn = dsn_from(auth)
    else:
        raise ValueError(f"`auth` must name a credential, got {type(auth).__name__}")
    if secrets is not None:
        secrets.add_dsn(dsn)
    return dsn


class PostgresTool:
    def __init__(self, pools: PoolRegistry, *, max_result_bytes: int = 0) -> None:
        """``max_result_bytes``: the largest rows (encoded JSON) a task may return; 0 = no limit."""
        self.pools = pools
        self.max_result_bytes = max(0, max_result_bytes)

    async def run(self, sql: str, auth: Any, *, timeout_sec: float | None = None,
                  secrets: CommandSecrets | None = None) -> ToolOutcome:
        if not sql or not sql.strip():
            return ToolOutcome.failure(INVALID_TASK, "postgres task needs a `command` or `query`",
                                       kind="ValueError")
        if auth in (None, ""):
            return ToolOutcome.failure(INVALID_TASK, "postgres task needs `auth` (a credential name)",
                                       kind="ValueError")
        try:
            dsn = await resolve_dsn(secrets, auth)
        except ValueError as exc:
            return ToolOutcome.failure(INVALID_TASK, f"{describe_auth(auth)}: {exc}", kind="ValueError")
        except NoetlError as exc:
            return credential_failure(exc, describe_auth(auth))
        try:
            pool = await self.pools.get(dsn)
            async with pool.connection() as conn:
                return ToolOutcome.success(await _execute(conn, sql, timeout_sec, self.max_result_bytes))
        except psycopg.Error as exc:
            return _sql_failure(exc)
        except PoolTimeout as exc:
            return ToolOutcome.failure(SQL_ERROR, f"no postgres connection available: {exc}",
                                       kind="PoolTimeout", retryable=True)


async def _fetch_rows(cur: psycopg.AsyncCursor[Any], limit: int) -> list[Any]:
    """The current result's rows as plain JSON values (what a reader gets back from the
    store), ``FETCH_ROWS`` at a time; ``ResultTooLarge`` as soon as their encoded size
    passes ``limit`` (> 0)."""
    rows: list[Any] = []
    size = 0
    while batch := await cur.fetchmany(FETCH_ROWS):
        data = encode_json(batch)
        size += len(data) - (1 if rows else 0)  # the size of the rows as one JSON array
        check_result_size(size, limit, exact=False)
        rows.extend(decode_json(data))
    return rows


async def _execute(conn: psycopg.AsyncConnection[Any], sql: str, timeout_sec: float | None,
                   limit: int = 0) -> dict[str, Any]:
    if timeout_sec:
        await conn.execute("SELECT set_config('statement_timeout', %s, false)",
                           (str(max(1, int(timeout_sec * 1000))),))
    try:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(sql)  # no parameters: several statements may run in one go
        value = await _collect(cur, limit)
    finally:
        if timeout_sec and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.execute("RESET statement_timeout")
    return value


async def _collect(cur: psycopg.AsyncCursor[Any], limit: int) -> dict[str, Any]:
    """The task's value from every result of the executed text: upstream's Rust shape at
    the top (the last statement that returned rows, else the last row count) and its
    Python reference's ``command_<i>`` entry per statement (module docstring). The rows
    of a statement are one list object under both keys."""
    top: dict[str, Any] | None = None
    statements: dict[str, Any] = {}
    row_count = 0
    while True:
        # psycopg reports -1 for statements without a row count (DDL): none affected.
        row_count = max(cur.rowcount, 0)
        entry: dict[str, Any]
        if cur.description is not None:
            rows = await _fetch_rows(cur, limit)
            columns = [c.name for c in cur.description]
            top = {"status": "ok", "rows": rows, "row_count": len(rows), "columns": columns}
            entry = {"status": "success", "rows": rows, "row_count": len(rows), "columns": columns}
        else:
            entry = {"status": "success", "row_count": row_count, "message": cur.statusmessage or ""}
        statements[f"command_{len(statements)}"] = entry
        if not cur.nextset():
            break
    return {**(top or {"status": "ok", "row_count": row_count}), **statements}
