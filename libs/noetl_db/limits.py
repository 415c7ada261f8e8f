"""Concurrency limits: the limits an operator sets (``noetl.concurrency_limit``), the slots
running executions hold (``noetl.concurrency_slot``, taken by ``noetl.take_slot``) and the
queues of executions waiting for one (``noetl.concurrency_wait``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._conn import GUARD, Column, Conn, Write, one, rows, run


async def all_limits(conn: Conn) -> list[dict[str, Any]]:
    return await rows(conn, "SELECT limit_id, path, key_template, max_running FROM noetl.concurrency_limit")


async def set_limit(conn: Conn, path: str, key_template: str, max_running: int) -> dict[str, Any]:
    row = await one(conn,
        "INSERT INTO noetl.concurrency_limit (path, key_template, max_running) VALUES (%s, %s, %s)"
        " ON CONFLICT (path, key_template) DO UPDATE SET max_running = EXCLUDED.max_running RETURNING *",
        (path, key_template, max_running))
    assert row is not None
    return row


async def limits_of(conn: Conn, path: str) -> list[dict[str, Any]]:
    """The limits of ``path`` ('' = every path)."""
    return await rows(conn, "SELECT * FROM noetl.concurrency_limit WHERE %s = '' OR path = %s ORDER BY path, limit_id",
                      (path, path))


async def keys_of(conn: Conn, limit_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Running and waiting executions per (limit, key)."""
    return await rows(conn,
        "SELECT limit_id, key, sum(running)::int AS running, sum(waiting)::int AS waiting FROM ("
        " SELECT limit_id, key, 1 AS running, 0 AS waiting FROM noetl.concurrency_slot"
        " UNION ALL SELECT limit_id, key, 0, 1 FROM noetl.concurrency_wait) k"
        " WHERE limit_id = ANY(%s) GROUP BY limit_id, key ORDER BY limit_id, key", (list(limit_ids),))


async def delete_limit(conn: Conn, limit_id: int) -> bool:
    """Delete a limit and its slots (its queue stays until each waiter's shard sweeps it: a
    waiter whose limit is gone starts). False when there is no such limit."""
    if await one(conn, "DELETE FROM noetl.concurrency_limit WHERE limit_id = %s RETURNING limit_id",
                 (limit_id,)) is None:
        return False
    await conn.execute("DELETE FROM noetl.concurrency_slot WHERE limit_id = %s", (limit_id,))
    return True


async def take_slot(conn: Conn, limit_id: int, key: str, max_running: int, execution_id: int, shard: int) -> bool:
    """A slot of (limit, key) for the execution, in submission order (``noetl.take_slot``)."""
    row = await one(conn, "SELECT noetl.take_slot(%s, %s, %s, %s, %s) AS ok",
                    (limit_id, key, max_running, execution_id, shard))
    return bool(row is not None and row["ok"])


async def give_back(conn: Conn, limit_id: int, key: str, execution_id: int) -> None:
    await conn.execute("DELETE FROM noetl.concurrency_slot WHERE limit_id = %s AND key = %s AND execution_id = %s",
                       (limit_id, key, execution_id))


async def enqueue(conn: Conn, limit_id: int, key: str, execution_id: int, shard: int) -> None:
    await conn.execute("INSERT INTO noetl.concurrency_wait (limit_id, key, execution_id, shard_id)"
                       " VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING", (limit_id, key, execution_id, shard))


async def dequeue(conn: Conn, execution_id: int) -> None:
    await conn.execute("DELETE FROM noetl.concurrency_wait WHERE execution_id = %s", (execution_id,))


async def release(conn: Conn, ended: Sequence[int]) -> None:
    """Free the slots and queue places of executions that ended."""
    for write in release_writes(ended):
        await run(conn, write)


def release_writes(ended: Sequence[int]) -> list[Write]:
    """``release``' statements (none when nothing ended)."""
    if not ended:
        return []
    ids = (Column(ended),)
    return [Write(f"DELETE FROM noetl.concurrency_slot WHERE execution_id = ANY(%t::bigint[]) AND {GUARD}", ids),
            Write(f"DELETE FROM noetl.concurrency_wait WHERE execution_id = ANY(%t::bigint[]) AND {GUARD}", ids)]


_HEADS = """
SELECT DISTINCT w.execution_id, w.shard_id FROM noetl.concurrency_wait w
LEFT JOIN noetl.concurrency_limit l ON l.limit_id = w.limit_id
WHERE {where}
  AND NOT EXISTS (SELECT 1 FROM noetl.engine_state s WHERE s.execution_id = w.execution_id)
  AND (l.limit_id IS NULL OR (
  w.execution_id = (SELECT min(w2.execution_id) FROM noetl.concurrency_wait w2
                    WHERE w2.limit_id = w.limit_id AND w2.key = w.key)
  AND (SELECT count(*) FROM noetl.concurrency_slot s WHERE s.limit_id = w.limit_id AND s.key = w.key)
      < l.max_running))
ORDER BY 1 LIMIT %s
"""


async def heads(conn: Conn, *, shard: int | None, limit: int) -> list[tuple[int, int]]:
    """(execution_id, shard) of queued executions that may start now: the oldest of a queue
    with a free slot, or queued by a limit that no longer exists; of ``shard`` only, or
    every shard's."""
    where, params = ("w.shard_id = %s", (shard, limit)) if shard is not None else ("true", (limit,))
    return [(r["execution_id"], r["shard_id"]) for r in await rows(conn, _HEADS.format(where=where), params)]


async def waits(conn: Conn, execution_id: int) -> list[dict[str, Any]]:
    """Where a queued execution waits: per limit, its path, running and waiting ahead."""
    return await rows(conn,
        "SELECT w.limit_id, w.key, l.path, l.max_running,"
        " (SELECT count(*) FROM noetl.concurrency_slot s WHERE s.limit_id = w.limit_id AND s.key = w.key) AS running,"
        " (SELECT count(*) FROM noetl.concurrency_wait w2 WHERE w2.limit_id = w.limit_id AND w2.key = w.key"
        "  AND w2.execution_id < w.execution_id) AS ahead"
        " FROM noetl.concurrency_wait w LEFT JOIN noetl.concurrency_limit l ON l.limit_id = w.limit_id"
        " WHERE w.execution_id = %s ORDER BY w.limit_id", (execution_id,))
