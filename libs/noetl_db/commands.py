"""Commands, ``noetl.command``: inserted queued and moved through their states by the
engine, claimed and renewed for workers by the api."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from noetl_common import pools
from noetl_common.vocab import CommandStatus
from noetl_flow import CommandUpdate, NewCommand

from ._conn import GUARD, Column, Conn, Write, columns, one, rows, run


class Placement(Protocol):
    """Where a command runs (the engine's ``placing.Placed``)."""

    @property
    def pool(self) -> str: ...
    @property
    def requires(self) -> dict[str, str] | None: ...
    @property
    def priority(self) -> str: ...


async def queued_commands(conn: Conn, shard: int) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT command_id, execution_id, attempt, kind, pool, priority FROM noetl.command"
        f" WHERE shard_id = %s AND status = '{CommandStatus.QUEUED}' ORDER BY created_at", (shard,))
    return list(await cur.fetchall())


class QueuedCommand(NamedTuple):
    """A new command of an execution, with where it runs; ``holder``: the worker it is
    handed to (inserted claimed by it), else None (inserted queued)."""

    execution_id: int
    catalog_id: int
    command: NewCommand
    placement: Placement
    holder: str | None = None


async def insert_commands(conn: Conn, shard: int, commands: Iterable[QueuedCommand], lease_sec: float = 0.0) -> None:
    """Insert the batch's new commands with their placement (one statement): queued, or,
    when handed to a worker, claimed by it with a lease of ``lease_sec``."""
    await run(conn, insert_commands_write(shard, commands, lease_sec))


def insert_commands_write(shard: int, commands: Iterable[QueuedCommand], lease_sec: float = 0.0) -> Write | None:
    """``insert_commands``' statement (None: no commands)."""
    rows = [(c.command_id, eid, shard, catalog_id, c.step, c.kind, c.attempt, json.dumps(c.context),
             float(c.timeout_sec), p.pool, json.dumps(p.requires) if p.requires else None, p.priority,
             q[4] if len(q) > 4 else None)
            for q in commands for eid, catalog_id, c, p in (q[:4],)]
    if not rows:
        return None
    return Write(
        "INSERT INTO noetl.command (command_id, execution_id, shard_id, catalog_id, step, kind, status,"
        " attempt, context, timeout_sec, pool, requires, priority, worker_id, claimed_at, lease_until)"
        f" SELECT c, e, sh, cat, st, k, CASE WHEN w IS NULL THEN '{CommandStatus.QUEUED}'"
        f" ELSE '{CommandStatus.CLAIMED}' END, a, ctx::jsonb, t, po, rq::jsonb, pr, w,"
        " CASE WHEN w IS NOT NULL THEN now() END, CASE WHEN w IS NOT NULL THEN now() + make_interval(secs => %s) END"
        " FROM unnest(%t::text[], %t::bigint[], %t::int[], %t::bigint[], %t::text[], %t::text[], %t::int[],"
        " %t::text[], %t::float8[], %t::text[], %t::text[], %t::text[], %t::text[])"
        f" AS x(c, e, sh, cat, st, k, a, ctx, t, po, rq, pr, w) WHERE {GUARD}"
        " ON CONFLICT (command_id) DO NOTHING",
        [float(lease_sec), *columns(rows, 13)],
    )


async def update_commands(conn: Conn, updates: Iterable[CommandUpdate]) -> None:
    """Apply the batch's command status changes in one statement. Several updates of one
    command in a batch fold in order: the last status, the last attempt given, and the
    worker cleared if it was re-queued on the way."""
    await run(conn, update_commands_write(updates))


def update_commands_write(updates: Iterable[CommandUpdate]) -> Write | None:
    """``update_commands``' statement (None: no updates)."""
    merged: dict[str, tuple[str, str, int | None, bool]] = {}
    for u in updates:
        _, _, attempt, requeued = merged.get(u.command_id, ("", "", None, False))
        merged[u.command_id] = (u.command_id, u.status, u.attempt if u.attempt is not None else attempt,
                                requeued or u.status == CommandStatus.QUEUED)
    if not merged:
        return None
    return Write(
        "UPDATE noetl.command c SET status = u.st, attempt = COALESCE(u.a, c.attempt),"
        " worker_id = CASE WHEN u.rq THEN NULL ELSE c.worker_id END, updated_at = now()"
        " FROM unnest(%t::text[], %t::text[], %t::int[], %t::bool[]) AS u(cid, st, a, rq)"
        f" WHERE c.command_id = u.cid AND {GUARD}",
        columns(list(merged.values()), 4),
    )


_CLAIM = f"""
WITH wanted AS (
  SELECT * FROM unnest(%(ids)t::text[], %(attempts)t::int[]) AS w(command_id, attempt)
), claimed AS (
  UPDATE noetl.command c SET status = '{CommandStatus.CLAIMED}', worker_id = %(worker)s, claimed_at = now(),
         lease_until = now() + make_interval(secs => %(lease)s), updated_at = now()
  FROM wanted w
  WHERE c.command_id = w.command_id
    -- only a worker that qualifies (noetl_common.pools.qualifies says the same)
    AND c.pool = ANY(%(pools)t::text[]) AND (c.requires IS NULL OR c.requires <@ %(labels)s::jsonb)
    AND (cardinality(%(tools)t::text[]) = 0 OR c.kind = ANY(%(tools)t::text[]))
    AND (c.status = '{CommandStatus.QUEUED}' AND (c.attempt = w.attempt OR w.attempt = 0)
         -- the same worker claiming the same attempt again: its first claim committed but the
         -- answer was lost (an api replica died mid-call); it gets the command back
         OR c.status = '{CommandStatus.CLAIMED}' AND c.worker_id = %(worker)s AND c.attempt = w.attempt)
  RETURNING c.*
)
SELECT c.*, li.item AS loop_item, li.idx IS NOT NULL AS has_item, lb.items AS loop_items, r.workload_ref_id,
       CASE WHEN c.execution_id = ANY(%(need_payload)t::bigint[]) AND r.workload_ref_id IS NULL
            THEN r.payload END AS payload
FROM claimed c
LEFT JOIN noetl.execution_request r ON r.execution_id = c.execution_id
LEFT JOIN noetl.loop_item li
  ON li.execution_id = c.execution_id AND li.loop_instance = c.context->'loop'->>'instance'
 AND li.idx = (c.context->'loop'->>'index')::int
-- a batch of iterations (context.loop.count): its items in index order
LEFT JOIN LATERAL (
  SELECT jsonb_agg(b.item ORDER BY b.idx) AS items FROM noetl.loop_item b
  WHERE c.context->'loop' ? 'count'
    AND b.execution_id = c.execution_id AND b.loop_instance = c.context->'loop'->>'instance'
    AND b.idx >= (c.context->'loop'->>'index')::int
    AND b.idx < (c.context->'loop'->>'index')::int + (c.context->'loop'->>'count')::int
) lb ON true
"""


async def claim(conn: Conn, wanted: list[tuple[str, int]], worker_id: str, lease_sec: float, *,
                pools: list[str], labels: dict[str, str], tools: list[str],
                need_payload: list[int]) -> dict[str, dict[str, Any]]:
    """Claim ``wanted`` ((command_id, attempt); attempt 0: any) for ``worker_id`` in ONE
    statement: each claimed row with its loop item (``loop_items``: a batch's, in index
    order) and, for executions in
    ``need_payload``, the submitted payload. Only commands the worker qualifies for
    (``pools``, ``labels``, ``tools``: noetl_common.pools.qualifies says the same)."""
    found = await rows(conn, _CLAIM, {
        "worker": worker_id, "lease": lease_sec, "ids": Column(c for c, _ in wanted), "attempts": Column(a for _, a in wanted),
        "need_payload": Column(need_payload), "pools": Column(pools), "labels": json.dumps(labels),
        "tools": Column(tools)})
    return {r["command_id"]: r for r in found}


async def placement_of(conn: Conn, command_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Who holds which attempt of each command, and where it may run (why a claim failed)."""
    found = await rows(conn, "SELECT command_id, status, attempt, worker_id, pool, requires, kind"
                             " FROM noetl.command WHERE command_id = ANY(%s)", (command_ids,))
    return {r["command_id"]: r for r in found}


async def holder(conn: Conn, command_id: str) -> dict[str, Any] | None:
    """The command as GetCredential checks it: who holds which attempt, its step and pinned
    playbook, the cursor the engine rendered, and the execution's payload (or the
    reference of its workload)."""
    return await one(conn,
        "SELECT c.command_id, c.execution_id, c.step, c.attempt, c.status, c.worker_id, c.catalog_id,"
        " c.context->'cursor' AS cursor, r.payload, r.workload_ref_id"
        " FROM noetl.command c LEFT JOIN noetl.execution_request r ON r.execution_id = c.execution_id"
        " WHERE c.command_id = %s", (command_id,))


async def renew(conn: Conn, command_id: str, worker_id: str, attempt: int, lease_sec: float,
                progress: str | None) -> dict[str, Any] | None:
    """Extend a claimed command's lease (and record its progress) when ``worker_id`` holds
    ``attempt``; its new ``lease_until``, else None."""
    return await one(conn,
        "UPDATE noetl.command SET lease_until = now() + make_interval(secs => %s),"
        " progress = COALESCE(%s::jsonb, progress), updated_at = now()"
        f" WHERE command_id = %s AND worker_id = %s AND attempt = %s AND status = '{CommandStatus.CLAIMED}'"
        " RETURNING lease_until", (lease_sec, progress, command_id, worker_id, attempt))


async def state(conn: Conn, command_id: str) -> dict[str, Any] | None:
    return await one(conn, "SELECT status, attempt, worker_id FROM noetl.command WHERE command_id = %s",
                     (command_id,))


async def expired_claims(conn: Conn, shards: Sequence[int], lease_sec: float,
                         limit: int = 500) -> list[dict[str, Any]]:
    """Claimed commands of ``shards`` whose lease ran out, oldest first, with their
    ``shard_id``; none within a lease of the database's own start (a Postgres restart
    stops every renewal). One query for all the shards a reaper holds."""
    if not shards:
        return []
    return await rows(conn,
        "SELECT command_id, execution_id, attempt, worker_id, shard_id FROM noetl.command"
        f" WHERE shard_id = ANY(%s) AND status = '{CommandStatus.CLAIMED}' AND lease_until < now()"
        " AND pg_postmaster_start_time() < now() - make_interval(secs => %s)"
        " ORDER BY lease_until LIMIT %s", (list(shards), lease_sec, limit))


async def stale_queued(conn: Conn, shards: Sequence[int], older_than_sec: float,
                       limit: int = 500) -> list[dict[str, Any]]:
    """Queued commands of ``shards`` not touched for ``older_than_sec`` (their notices may
    be lost), oldest first, with their ``shard_id`` and the trace their execution continues."""
    if not shards:
        return []
    return await rows(conn,
        "SELECT c.command_id, c.execution_id, c.attempt, c.kind, c.pool, c.priority, c.shard_id, r.traceparent"
        " FROM noetl.command c"
        " LEFT JOIN noetl.execution_request r ON r.execution_id = c.execution_id WHERE c.shard_id = ANY(%s)"
        f" AND c.status = '{CommandStatus.QUEUED}' AND c.updated_at < now() - make_interval(secs => %s)"
        " ORDER BY c.updated_at LIMIT %s", (list(shards), older_than_sec, limit))


async def unschedulable(conn: Conn, shards: Sequence[int]) -> dict[int, dict[str, int]]:
    """Queued commands no live worker qualifies for, per shard of ``shards`` and pool
    (shards with none are left out)."""
    if not shards:
        return {}
    found = await rows(conn,
        f"SELECT c.shard_id, c.pool, count(*) AS n FROM noetl.command c WHERE c.shard_id = ANY(%s)"
        f" AND c.status = '{CommandStatus.QUEUED}' AND {pools.no_live_worker('c')} GROUP BY c.shard_id, c.pool",
        (list(shards),))
    out: dict[int, dict[str, int]] = {}
    for r in found:
        out.setdefault(int(r["shard_id"]), {})[r["pool"]] = int(r["n"])
    return out
