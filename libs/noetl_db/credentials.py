"""Stored credentials, sealed (``noetl.credential``: envelope-encrypted; a row's ``data``
is plaintext only until the api seals it)."""

from __future__ import annotations

from typing import Any

from ._conn import Conn, one


async def reseal(conn: Conn, name: str, sealed: Any) -> None:
    """Replace a row's sealed value (``sealed``: key_id, wrapped_key, nonce, ciphertext),
    dropping any plaintext it had."""
    await conn.execute(
        "UPDATE noetl.credential SET data = NULL, key_id = %s, wrapped_key = %s, nonce = %s,"
        " ciphertext = %s WHERE name = %s",
        (sealed.key_id, sealed.wrapped_key, sealed.nonce, sealed.ciphertext, name))


async def put(conn: Conn, name: str, kind: str, sealed: Any) -> bool:
    """Store a sealed credential; True when it was created, False when replaced."""
    row = await one(conn,
        "INSERT INTO noetl.credential (name, kind, data, key_id, wrapped_key, nonce, ciphertext)"
        " VALUES (%s, %s, NULL, %s, %s, %s, %s)"
        " ON CONFLICT (name) DO UPDATE SET kind = EXCLUDED.kind, data = NULL, key_id = EXCLUDED.key_id,"
        " wrapped_key = EXCLUDED.wrapped_key, nonce = EXCLUDED.nonce, ciphertext = EXCLUDED.ciphertext,"
        " updated_at = now()"
        " RETURNING (xmax = 0) AS created",
        (name, kind, sealed.key_id, sealed.wrapped_key, sealed.nonce, sealed.ciphertext))
    return bool(row and row["created"])
