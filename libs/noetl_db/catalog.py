"""Registered playbooks, every version kept: ``noetl.catalog``."""

from __future__ import annotations

import json
from typing import Any

from ._conn import Conn, one


async def lock_path(conn: Conn, path: str) -> None:
    """Serialise registrations of one path (to the end of the transaction)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"catalog:{path}",))


async def insert(conn: Conn, *, path: str, version: int, kind: str, name: str, content: str, sha256: str,
                 doc: dict[str, Any]) -> dict[str, Any]:
    row = await one(conn,
        "INSERT INTO noetl.catalog (path, version, kind, name, content, content_sha256, doc)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING *",
        (path, version, kind, name, content, sha256, json.dumps(doc, default=str)))
    assert row is not None
    return row
