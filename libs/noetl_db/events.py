"""The append-only event log, ``noetl.event`` (appended by the engine, deleted only by the
compactor once an execution's manifest holds it), and ``noetl.quarantine`` (engine inputs
that could not be processed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ._conn import GUARD, Conn, Write, columns, run


class EventRow(NamedTuple):
    """One event to append (``result`` and ``meta`` as JSON text)."""

    execution_id: int
    shard_id: int
    shard_seq: int
    event_type: str
    step: str | None
    command_id: str | None
    result: str | None
    meta: str


# Sweeps skip executions with a quarantined input: their input could not be processed,
# and sweeping them again would only quarantine the same failure every tick.
NOT_QUARANTINED = "NOT EXISTS (SELECT 1 FROM noetl.quarantine q WHERE q.execution_id = {col})"


async def quarantine(conn: Conn, shard: int, execution_id: int, kind: str,
                     stream_seq: int | None, attempts: int, error: str, data: bytes | None) -> None:
    await conn.execute(
        "INSERT INTO noetl.quarantine (shard_id, execution_id, input_kind, stream_seq, attempts, error, input)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)", (shard, execution_id, kind, stream_seq, attempts, error[:4000], data))


async def append_events(conn: Conn, rows: Sequence[EventRow]) -> None:
    """Append the batch's events (execution_id, shard_id, shard_seq, type, step, command_id,
    result, meta) in ONE statement (pipeline-friendly, unlike COPY)."""
    await run(conn, append_events_write(rows))


def append_events_write(rows: Sequence[EventRow]) -> Write | None:
    """``append_events``' statement (None: no rows)."""
    if not rows:
        return None
    return Write(
        "INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type, step, command_id, result, meta)"
        " SELECT * FROM unnest(%t::bigint[], %t::int[], %t::bigint[], %t::text[], %t::text[], %t::text[],"
        f" %t::text[]::jsonb[], %t::text[]::jsonb[]) WHERE {GUARD}",
        columns(rows, 8),
    )


# The retention delete (the only statement that ever deletes events).
DELETE_EVENTS = "DELETE FROM noetl.event WHERE execution_id = ANY(%(ids)s)"


DELETE_BARRIERS = "DELETE FROM noetl.event WHERE execution_id = ANY(%(ids)s) AND event_type = %(barrier)s"
