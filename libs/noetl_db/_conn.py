"""What every table module shares: the connection type and two readers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from noetl_common.db import Conn, columns

__all__ = ["GUARD", "Conn", "Write", "columns", "one", "rows", "run"]

# Where a write statement's rows may be made conditional on a guard: a composed statement
# (``leases.fenced_batch``) puts its fence's condition there; on its own it is TRUE.
GUARD = "/*guard*/TRUE"


@dataclass(frozen=True)
class Write:
    """One write statement of a batch and its parameters; its text holds ``GUARD`` once,
    in the WHERE clause that every row it writes passes."""

    sql: str
    params: Sequence[Any]

    def guarded(self, condition: str) -> str:
        return self.sql.replace(GUARD, condition)


async def run(conn: Conn, write: Write | None) -> None:
    """Execute ``write`` on its own (nothing to do for None, an empty batch's)."""
    if write is not None:
        await conn.execute(write.sql, write.params)


async def one(conn: Conn, query: str, params: Any = None) -> dict[str, Any] | None:
    """The first row of ``query`` (None when there is none)."""
    cur = await conn.execute(query, params)
    return await cur.fetchone()


async def rows(conn: Conn, query: str, params: Any = None) -> list[dict[str, Any]]:
    cur = await conn.execute(query, params)
    return list(await cur.fetchall())
