"""The engine's compact state per execution: ``noetl.engine_state``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from noetl_common.vocab import EngineStatus
from noetl_flow import ExecState

from ._conn import GUARD, Column, Conn, Write, columns, run
from .events import NOT_QUARANTINED


async def load_states(conn: Conn, ids: Sequence[int]) -> dict[int, ExecState]:
    return await loaded_states(await send_load_states(conn, ids))


async def send_load_states(conn: Conn, ids: Sequence[int]) -> Any:
    """Send ``load_states``' query and return its cursor unread (None: nothing to read):
    in pipeline mode it travels with the statements around it; ``loaded_states`` reads it."""
    if not ids:
        return None
    return await conn.execute("SELECT execution_id, state FROM noetl.engine_state WHERE execution_id = ANY(%t::bigint[])",
                              (Column(ids),))


async def loaded_states(cursor: Any) -> dict[int, ExecState]:
    if cursor is None:
        return {}
    return {r["execution_id"]: ExecState.from_json(r["state"]) for r in await cursor.fetchall()}


async def overdue(conn: Conn, shard: int, limit: int) -> list[int]:
    cur = await conn.execute(
        f"SELECT s.execution_id FROM noetl.engine_state s WHERE s.shard_id = %s AND s.status = '{EngineStatus.RUNNING}'"
        " AND s.deadline < now() AND " + NOT_QUARANTINED.format(col="s.execution_id") +
        " ORDER BY s.deadline LIMIT %s", (shard, limit))
    return [r["execution_id"] for r in await cur.fetchall()]


def unstarted_gate(ids: Sequence[int]) -> Write:
    """A gate of a ``gated`` statement: none of ``ids`` has engine state or waits in a
    concurrency queue (executions that start in the statement, which the engine folded
    as never seen)."""
    return Write("SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM noetl.engine_state WHERE execution_id = ANY(%t::bigint[]))"
                 f" AND NOT EXISTS (SELECT 1 FROM noetl.concurrency_wait WHERE execution_id = ANY(%t::bigint[]))"
                 f" AND {GUARD}", (Column(ids), Column(ids)))


class StateRow(NamedTuple):
    state: ExecState
    last_shard_seq: int
    deadline: datetime | None


async def save_states(conn: Conn, shard: int, states: Iterable[StateRow]) -> None:
    """Upsert the compact engine state of every touched execution (one statement)."""
    await run(conn, save_states_write(shard, states))


def save_states_write(shard: int, states: Iterable[StateRow]) -> Write | None:
    """``save_states``' statement (None: no states)."""
    rows = [(s.execution_id, shard, s.status, json.dumps(s.to_json()), deadline, seq)
            for s, seq, deadline in states]
    if not rows:
        return None
    return Write(
        "INSERT INTO noetl.engine_state (execution_id, shard_id, status, state, deadline, last_shard_seq)"
        " SELECT e, sh, st, js::jsonb, d, q FROM unnest(%t::bigint[], %t::int[], %t::text[], %t::text[],"
        f" %t::timestamptz[], %t::bigint[]) AS t(e, sh, st, js, d, q) WHERE {GUARD}"
        " ON CONFLICT (execution_id) DO UPDATE SET status = EXCLUDED.status, state = EXCLUDED.state,"
        " deadline = EXCLUDED.deadline, last_shard_seq = EXCLUDED.last_shard_seq, updated_at = now()",
        columns(rows, 6),
    )
