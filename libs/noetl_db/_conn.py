"""What every table module shares: the connection type and two readers."""

from __future__ import annotations

from typing import Any

from noetl_common.db import Conn, columns

__all__ = ["Conn", "columns", "one", "rows"]


async def one(conn: Conn, query: str, params: Any = None) -> dict[str, Any] | None:
    """The first row of ``query`` (None when there is none)."""
    cur = await conn.execute(query, params)
    return await cur.fetchone()


async def rows(conn: Conn, query: str, params: Any = None) -> list[dict[str, Any]]:
    cur = await conn.execute(query, params)
    return list(await cur.fetchall())
