"""What every table module shares: the connection type and two readers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from noetl_common.db import Column, Conn, columns

__all__ = ["GUARD", "Column", "Conn", "Write", "columns", "gated", "one", "rows", "run"]

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


async def gated(conn: Conn, gates: Sequence[Write], writes: Sequence[Write]) -> bool:
    """ONE statement (commit it on its own: ``conn`` in autocommit): the ``gates`` are CTEs
    that must each return a row, in order (a gate's ``GUARD`` is that the one before it
    did), and every write is a CTE whose rows pass only when the last gate did. True when
    it did (everything written), False when a gate matched nothing (nothing written but
    what the gates before it changed themselves: a gate that updates a row, a fence,
    comes after the read-only ones). A CTE does not see another's rows: the writes must
    not depend on each other."""
    sql: list[str] = ["WITH "]
    params: list[Any] = []
    last = ""
    for n, gate in enumerate(gates):
        sql.append(f"{', ' if n else ''}g{n} AS ({gate.guarded(f'EXISTS (SELECT 1 FROM {last})' if last else 'TRUE')})")
        params.extend(gate.params)
        last = f"g{n}"
    for n, write in enumerate(writes):
        sql.append(f", w{n} AS ({write.guarded(f'EXISTS (SELECT 1 FROM {last})')})")
        params.extend(write.params)
    sql.append(f" SELECT count(*) AS passed FROM {last}")
    # prepared on its first use on each connection: planning this statement is most of
    # its server time unprepared (parse 0.75 + bind 0.92 of 2.6 ms, Postgres' log in a
    # turnaround run); prepared, its plan goes generic after five custom ones
    cur = await conn.execute("".join(sql), params, prepare=True)
    row = await cur.fetchone()
    return bool(row and row["passed"])


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
