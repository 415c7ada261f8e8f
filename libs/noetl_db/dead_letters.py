"""Commands that exhausted their attempts: ``noetl.dead_letter``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from noetl_common.vocab import DeadLetterStatus

from ._conn import Conn, columns


async def insert_dead_letters(conn: Conn, shard: int,
                              rows: Sequence[tuple[int, Any]]) -> None:
    """Record the batch's dead letters ((execution_id, DeadLetter)); the worker is the
    result's, else the command row's (the worker that last held it)."""
    if not rows:
        return
    data = [(eid, shard, d.command_id, d.step, d.loop_instance, d.loop_index, d.attempts, d.reason,
             json.dumps(d.error, default=str), d.worker_id or None) for eid, d in rows]
    await conn.execute(
        "INSERT INTO noetl.dead_letter (execution_id, shard_id, command_id, step, loop_instance, loop_index,"
        " attempts, reason, error, worker_id)"
        " SELECT x.e, x.sh, x.c, x.st, x.li, x.ix, x.a, x.r, x.err::jsonb, COALESCE(x.w, c.worker_id)"
        " FROM unnest(%t::bigint[], %t::int[], %t::text[], %t::text[], %t::text[], %t::int[], %t::int[],"
        " %t::text[], %t::text[], %t::text[]) AS x(e, sh, c, st, li, ix, a, r, err, w)"
        " LEFT JOIN noetl.command c ON c.command_id = x.c"
        " ON CONFLICT (command_id) DO NOTHING",
        columns(data, 10))


class RedriveOutcome(NamedTuple):
    """What a batch did with a redrive request: the command it re-issued, or why not."""

    dead_letter_id: int
    command_id: str | None
    refusal: str | None
    requested_by: str


async def record_redrives(conn: Conn, outcomes: Sequence[RedriveOutcome]) -> None:
    """Record what the batch did with redrive requests; ``requests.applied_redrives``
    deletes them."""
    if not outcomes:
        return
    await conn.execute(
        f"UPDATE noetl.dead_letter d SET status = CASE WHEN o.c IS NULL THEN d.status ELSE '{DeadLetterStatus.REDRIVEN}' END,"
        " redrive_command_id = COALESCE(o.c, d.redrive_command_id),"
        " redriven_at = CASE WHEN o.c IS NULL THEN d.redriven_at ELSE now() END,"
        " redriven_by = CASE WHEN o.c IS NULL THEN d.redriven_by ELSE o.who END, refusal = o.why"
        " FROM unnest(%t::bigint[], %t::text[], %t::text[], %t::text[]) AS o(id, c, why, who)"
        " WHERE d.dead_letter_id = o.id", columns(list(outcomes), 4))
