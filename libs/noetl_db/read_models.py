"""The read model the projector folds the event log into: ``noetl.execution``,
``noetl.execution_step`` and its watermark ``noetl.projection_checkpoint``. The
projector's statements run inside its shard's fenced transaction, in pipeline mode
(``pipelined_transaction``): statements are sent without waiting, a read waits for what
was sent before it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from noetl_flow.projection import ExecutionView, StepView

from . import leases
from ._conn import GUARD, Column, Conn, Write, columns, run

ROLE = "projector"


async def fence_and_read(conn: Conn, shard: int, owner: int, epoch: int,
                         limit: int) -> list[dict[str, Any]]:
    """Fence on our lease row and read up to ``limit`` events past the watermark, sent
    together (pipeline mode: one round trip). LeaseLost when the lease is not ours."""
    fence = await leases.send_fence(conn, ROLE, shard, owner, epoch)
    await conn.execute("INSERT INTO noetl.projection_checkpoint (shard_id) VALUES (%s) ON CONFLICT DO NOTHING",
                       (shard,))
    events = await conn.execute(
        "SELECT execution_id, shard_seq, event_type, step, command_id, result, meta, created_at FROM noetl.event"
        " WHERE shard_id = %s AND shard_seq > (SELECT last_shard_seq FROM noetl.projection_checkpoint"
        " WHERE shard_id = %s) ORDER BY shard_seq LIMIT %s", (shard, shard, limit))
    await leases.fenced(fence, ROLE, shard, epoch)
    return list(await events.fetchall())


# One index probe per shard and partition (a LATERAL subquery is evaluated row by row;
# ordered by shard_seq, each partition's index scan stops at its first entry past the
# watermark, however long the backlog): written as a plain EXISTS, the planner hashed the
# whole log once it held a few thousand events (a seq scan of every partition on every
# projector tick: 10 ms at 8,000 events, linear in them).
_SHARDS_BEHIND = (
    "SELECT s.shard_id FROM unnest(%s::int[]) AS s(shard_id)"
    " LEFT JOIN noetl.projection_checkpoint c ON c.shard_id = s.shard_id"
    " CROSS JOIN LATERAL (SELECT 1 FROM noetl.event e WHERE e.shard_id = s.shard_id"
    " AND e.shard_seq > coalesce(c.last_shard_seq, 0) ORDER BY e.shard_seq LIMIT 1) AS behind")


async def shards_behind(conn: Conn, shards: Sequence[int]) -> set[int]:
    """Those of ``shards`` with events past their projection watermark (a shard never
    projected counts from 0). One read for every shard a projector holds, no fence: it
    decides only whether a shard's fenced round (``fence_and_read``) has anything to do.
    Its cost does not grow with the log (``_SHARDS_BEHIND``)."""
    if not shards:
        return set()
    cur = await conn.execute(_SHARDS_BEHIND, (list(shards),))
    return {int(r["shard_id"]) for r in await cur.fetchall()}


async def load_views(conn: Conn, shard: int, ids: Sequence[int]) -> dict[int, ExecutionView]:
    cur = await conn.execute("SELECT * FROM noetl.execution WHERE execution_id = ANY(%t::bigint[])", (Column(ids),))
    step_cur = await conn.execute("SELECT * FROM noetl.execution_step WHERE execution_id = ANY(%t::bigint[])",
                                  (Column(ids),))
    views: dict[int, ExecutionView] = {}
    for r in await cur.fetchall():
        views[r["execution_id"]] = ExecutionView(
            execution_id=r["execution_id"], shard_id=r["shard_id"], status=r["status"], catalog_id=r["catalog_id"],
            playbook_path=r["playbook_path"], playbook_version=r["playbook_version"],
            parent_execution_id=r["parent_execution_id"], rerun_of=r.get("rerun_of"), error=r["error"],
            created_at=r["created_at"],
            started_at=r["started_at"], ended_at=r["ended_at"], last_shard_seq=r["last_shard_seq"])
    for eid in ids:
        views.setdefault(eid, ExecutionView(execution_id=eid, shard_id=shard))
    for r in await step_cur.fetchall():
        views[r["execution_id"]].steps[r["step"]] = StepView(
            step=r["step"], status=r["status"], visits=r["visits"], attempts=r["attempts"],
            result_ref_id=r["result_ref_id"], error=r["error"], started_at=r["started_at"], ended_at=r["ended_at"],
            loop_total=r["loop_total"], loop_done=r["loop_done"], loop_failed=r["loop_failed"])
    return views


async def save_views(conn: Conn, views: Iterable[ExecutionView]) -> None:
    """Upsert the touched executions and their changed steps (one statement each over
    ``Column`` arrays)."""
    for write in save_views_writes(views):
        await run(conn, write)


def save_views_writes(views: Iterable[ExecutionView]) -> list[Write]:
    """``save_views``' statements (none when no view)."""
    views = list(views)
    if not views:
        return []
    writes = [Write(
        "INSERT INTO noetl.execution (execution_id, shard_id, catalog_id, playbook_path, playbook_version,"
        " parent_execution_id, status, error, created_at, started_at, ended_at, last_shard_seq, rerun_of, updated_at)"
        " SELECT *, now() FROM unnest(%t::bigint[], %t::int[], %t::bigint[], %t::text[], %t::int[], %t::bigint[],"
        " %t::text[], %t::text[], %t::timestamptz[], %t::timestamptz[], %t::timestamptz[], %t::bigint[],"
        f" %t::bigint[]) WHERE {GUARD}"
        " ON CONFLICT (execution_id) DO UPDATE SET catalog_id = EXCLUDED.catalog_id,"
        " playbook_path = EXCLUDED.playbook_path, playbook_version = EXCLUDED.playbook_version,"
        " parent_execution_id = EXCLUDED.parent_execution_id, status = EXCLUDED.status, error = EXCLUDED.error,"
        " created_at = EXCLUDED.created_at, started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at,"
        " last_shard_seq = EXCLUDED.last_shard_seq, rerun_of = EXCLUDED.rerun_of, updated_at = now()",
        columns([(v.execution_id, v.shard_id, v.catalog_id, v.playbook_path, v.playbook_version,
                   v.parent_execution_id, v.status, v.error, v.created_at, v.started_at, v.ended_at,
                   v.last_shard_seq, v.rerun_of) for v in views], 13),
    )]
    steps = [(v.execution_id, s.step, s.status, s.visits, s.attempts, s.result_ref_id, s.error, s.started_at,
              s.ended_at, s.loop_total, s.loop_done, s.loop_failed)
             for v in views for s in v.steps.values() if s.dirty]
    if steps:
        writes.append(Write(
            "INSERT INTO noetl.execution_step (execution_id, step, status, visits, attempts, result_ref_id,"
            " error, started_at, ended_at, loop_total, loop_done, loop_failed)"
            " SELECT * FROM unnest(%t::bigint[], %t::text[], %t::text[], %t::int[], %t::int[], %t::bigint[],"
            f" %t::text[], %t::timestamptz[], %t::timestamptz[], %t::bigint[], %t::bigint[], %t::bigint[]) WHERE {GUARD}"
            " ON CONFLICT (execution_id, step) DO UPDATE SET status = EXCLUDED.status, visits = EXCLUDED.visits,"
            " attempts = EXCLUDED.attempts, result_ref_id = EXCLUDED.result_ref_id, error = EXCLUDED.error,"
            " started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at, loop_total = EXCLUDED.loop_total,"
            " loop_done = EXCLUDED.loop_done, loop_failed = EXCLUDED.loop_failed",
            columns(steps, 12),
        ))
    return writes


def advance_write(shard: int, from_seq: int, last_seq: int, lag_ms: int) -> Write:
    """``advance`` as a gate of a ``gated`` statement: only from ``from_seq``, the
    watermark the batch read past (a projector's idea of it is never trusted blindly)."""
    return Write("UPDATE noetl.projection_checkpoint SET last_shard_seq = %s, last_projected_at = now(), lag_ms = %s"
                 f" WHERE shard_id = %s AND last_shard_seq = %s AND {GUARD} RETURNING 1",
                 (last_seq, lag_ms, shard, from_seq))


async def read_past(conn: Conn, shard: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
    """(the shard's watermark, up to ``limit`` events past it), without a fence: a batch
    that writes what it folds from them fences its one statement (``advance_write`` gated
    by ``leases.fence_write``). The watermark is -1 when the shard has none yet."""
    cur = await conn.execute(
        "WITH w AS (SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s)"
        " SELECT (SELECT last_shard_seq FROM w) AS watermark, e.execution_id, e.shard_seq, e.event_type, e.step,"
        " e.command_id, e.result, e.meta, e.created_at FROM (SELECT 1) AS one LEFT JOIN LATERAL"
        " (SELECT * FROM noetl.event WHERE shard_id = %s AND shard_seq > (SELECT last_shard_seq FROM w)"
        " ORDER BY shard_seq LIMIT %s) AS e ON TRUE", (shard, shard, limit))
    found = list(await cur.fetchall())
    watermark = found[0]["watermark"] if found else None
    return (-1 if watermark is None else int(watermark),
            [{k: v for k, v in r.items() if k != "watermark"} for r in found if r["shard_seq"] is not None])


async def advance(conn: Conn, shard: int, last_seq: int, lag_ms: int) -> None:
    await conn.execute(
        "UPDATE noetl.projection_checkpoint SET last_shard_seq = %s, last_projected_at = now(), lag_ms = %s"
        " WHERE shard_id = %s", (last_seq, lag_ms, shard))
