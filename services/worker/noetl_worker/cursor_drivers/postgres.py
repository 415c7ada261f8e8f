"""The postgres cursor driver: a claim is the user's SQL run in one transaction.

    claim(statement):  BEGIN; <statement> -> at most one row; (caller records the row);
                       COMMIT on a normal exit, ROLLBACK on an exception

The statement is typically ``UPDATE work SET status = 'claimed' WHERE id = (SELECT id FROM
work WHERE status = 'pending' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING ...``:
atomicity lives in the statement, concurrent slots never claim the same row. A
statement returning several rows is rolled back and fails the slot (claim one row at a
time: a row claimed but never run would otherwise be stranded).

Connections come from the worker's ``PoolRegistry``: one pool per DSN per process,
shared with the postgres tool and grown to ``options.pool_size`` (default 8). A claim
holds its connection only while the claim runs, never while a row's tasks run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from noetl_common.errors import NoetlError, ToolError
from noetl_store import to_jsonable

from ..tools.credentials import CommandSecrets, credential_failure
from ..tools.outcome import SQL_ERROR
from ..tools.postgres import PoolRegistry, describe_auth, resolve_dsn, sql_error
from .base import CursorDriver, CursorError, CursorSpec, Row

KIND = "postgres"


def _tool_error(exc: psycopg.Error) -> ToolError:
    detail = sql_error(exc)
    return ToolError(f"cursor claim failed: {detail.message}", code=detail.code, kind=detail.kind,
                     retryable=detail.retryable, details=detail.details)


class PostgresCursorDriver:
    kind = KIND

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool

    @asynccontextmanager
    async def claim(self, statement: str) -> AsyncIterator[Row | None]:
        try:
            async with self.pool.connection() as conn, conn.transaction():
                yield await _claim_row(conn, statement)
        except psycopg.Error as exc:
            raise _tool_error(exc) from exc
        except PoolTimeout as exc:
            raise ToolError(f"cursor claim failed: no postgres connection available: {exc}", code=SQL_ERROR,
                            kind="PoolTimeout", retryable=True) from exc


async def _claim_row(conn: psycopg.AsyncConnection[Any], statement: str) -> Row | None:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(statement)  # no parameters: the engine rendered the statement once
    rows: list[dict[str, Any]] | None = None
    while True:
        if cur.description is not None:
            rows = await cur.fetchall()
        if not cur.nextset():
            break
    if not rows:
        return None
    if len(rows) > 1:
        raise CursorError(f"the cursor claim returned {len(rows)} rows; it must claim at most one row "
                          "per statement (add LIMIT 1)")
    row = to_jsonable(rows[0])
    return dict(row) if isinstance(row, dict) else {"value": row}


class PostgresCursorFactory:
    """Opens postgres cursor drivers over the worker's shared pools."""

    def __init__(self, pools: PoolRegistry) -> None:
        self.pools = pools

    async def open(self, spec: CursorSpec, secrets: CommandSecrets | None = None) -> CursorDriver:
        if spec.auth in (None, ""):
            raise CursorError("a postgres cursor needs `auth` (a credential name)")
        try:
            dsn = await resolve_dsn(secrets, spec.auth)
        except ValueError as exc:
            raise CursorError(f"{describe_auth(spec.auth)}: {exc}") from exc
        except NoetlError as exc:
            error = credential_failure(exc, describe_auth(spec.auth)).error
            assert error is not None
            raise ToolError(error.message, code=error.code, kind=error.kind, retryable=error.retryable) from exc
        size = spec.pool_size
        try:
            pool = await self.pools.get(dsn, max_size=size)
        except psycopg.Error as exc:
            raise _tool_error(exc) from exc
        return PostgresCursorDriver(pool)

    async def close(self) -> None:
        await self.pools.close()
