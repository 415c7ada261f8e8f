"""API tokens (``noetl.api_token``: only their sha256 is stored) and the keys the runtime
keeps for itself (``noetl.runtime_secret``)."""

from __future__ import annotations

from typing import Any

import psycopg

from ._conn import Conn, one, rows

_REGISTER = ("INSERT INTO noetl.api_token (name, role, token_sha256, created_by) VALUES (%s, %s, %s, %s)"
             " ON CONFLICT (token_sha256) DO NOTHING RETURNING token_id")


async def register(conn: Conn, name: str, role: str, token_sha256: str, created_by: str | None) -> int | None:
    """A new token's id; None when that token is registered already. A live token with the
    same name is a Conflict (a unique index)."""
    row = await one(conn, _REGISTER, (name, role, token_sha256, created_by))
    return None if row is None else int(row["token_id"])


def register_sync(conn: psycopg.Connection[Any], name: str, role: str, token_sha256: str, created_by: str) -> None:
    """:func:`register` on a blocking connection (the CLI's local stack at ``dev up``)."""
    conn.execute(_REGISTER, (name, role, token_sha256, created_by))


async def revoke(conn: Conn, name_or_id: str) -> bool:
    return await one(conn,
        "UPDATE noetl.api_token SET revoked_at = now() WHERE revoked_at IS NULL"
        " AND (name = %s OR token_id::text = %s) RETURNING token_id", (name_or_id, name_or_id)) is not None


async def listed(conn: Conn, include_revoked: bool) -> list[dict[str, Any]]:
    return await rows(conn,
        "SELECT token_id, name, role, created_at, revoked_at, created_by FROM noetl.api_token"
        " WHERE %s OR revoked_at IS NULL ORDER BY token_id", (include_revoked,))


async def identity(conn: Conn, token_sha256: str) -> dict[str, Any] | None:
    """The live token with that hash (``noetl.token_identity``: readable by roles that may
    not read the table)."""
    return await one(conn, "SELECT token_id, name, role FROM noetl.token_identity(%s)", (token_sha256,))


async def runtime_secret(conn: Conn, name: str, fresh: bytes) -> bytes:
    """The runtime's key ``name``, created as ``fresh`` by whichever process asks first."""
    await conn.execute("INSERT INTO noetl.runtime_secret (name, value) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                       (name, fresh))
    row = await one(conn, "SELECT value FROM noetl.runtime_secret WHERE name = %s", (name,))
    assert row is not None
    return bytes(row["value"])
