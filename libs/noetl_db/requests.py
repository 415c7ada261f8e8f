"""What users and parents ask of executions: ``noetl.execution_request`` (submissions),
``noetl.cancel_request`` and ``noetl.redrive_request`` (committed by the api, applied by
the shard's engine, then deleted)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from noetl_common.db import REDRIVE_LOCK_CLASS, Column
from noetl_common.vocab import EngineStatus

from ._conn import Conn, one
from .events import NOT_QUARANTINED


async def load_requests(conn: Conn, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    return await loaded_requests(await send_load_requests(conn, ids))


async def send_load_requests(conn: Conn, ids: Sequence[int]) -> Any:
    """Send ``load_requests``' query and return its cursor unread (None: nothing to read);
    ``loaded_requests`` reads it (as ``engine_state.send_load_states``)."""
    if not ids:
        return None
    return await conn.execute(
        "SELECT r.*, c.path, c.version FROM noetl.execution_request r"
        " JOIN noetl.catalog c ON c.catalog_id = r.catalog_id WHERE r.execution_id = ANY(%t::bigint[])", (Column(ids),))


async def loaded_requests(cursor: Any) -> dict[int, dict[str, Any]]:
    if cursor is None:
        return {}
    return {r["execution_id"]: r for r in await cursor.fetchall()}


async def unstarted(conn: Conn, shard: int, after_id: int, limit: int) -> list[int]:
    cur = await conn.execute(
        "SELECT r.execution_id FROM noetl.execution_request r WHERE r.shard_id = %s AND r.execution_id > %s"
        " AND NOT EXISTS (SELECT 1 FROM noetl.engine_state s WHERE s.execution_id = r.execution_id)"
        # queued by a concurrency limit: the heads of the queues are swept (noetl_db.limits.heads)
        " AND NOT EXISTS (SELECT 1 FROM noetl.concurrency_wait w WHERE w.execution_id = r.execution_id)"
        " AND " + NOT_QUARANTINED.format(col="r.execution_id") + " ORDER BY r.execution_id LIMIT %s",
        (shard, after_id, limit),
    )
    return [r["execution_id"] for r in await cur.fetchall()]


async def sweep_candidates(conn: Conn, engine_role: str, shards: Sequence[int]) -> set[int]:
    """Those of ``shards`` whose engine sweep may find something: a submission past the
    shard's ``sweep_from`` without engine state, a queued execution, a running one past
    its deadline, a cancel or a redrive request. A superset of what the sweep's own
    queries find (it leaves out their quarantine and queue-head conditions), so a shard
    left out certainly has nothing to sweep. One read for every shard an api holds."""
    if not shards:
        return set()
    cur = await conn.execute(
        "SELECT s.shard_id FROM unnest(%s::int[]) AS s(shard_id) WHERE"
        " EXISTS (SELECT 1 FROM noetl.execution_request r WHERE r.shard_id = s.shard_id"
        "   AND r.execution_id > coalesce((SELECT l.sweep_from FROM noetl.shard_lease l"
        "     WHERE l.role = %s AND l.shard_id = s.shard_id), 0)"
        "   AND NOT EXISTS (SELECT 1 FROM noetl.engine_state e WHERE e.execution_id = r.execution_id))"
        " OR EXISTS (SELECT 1 FROM noetl.concurrency_wait w WHERE w.shard_id = s.shard_id)"
        " OR EXISTS (SELECT 1 FROM noetl.engine_state e WHERE e.shard_id = s.shard_id"
        f"   AND e.status = '{EngineStatus.RUNNING}' AND e.deadline < now())"
        " OR EXISTS (SELECT 1 FROM noetl.cancel_request c WHERE c.shard_id = s.shard_id)"
        " OR EXISTS (SELECT 1 FROM noetl.redrive_request d WHERE d.shard_id = s.shard_id)",
        (list(shards), engine_role))
    return {int(r["shard_id"]) for r in await cur.fetchall()}


async def pending_cancels(conn: Conn, shard: int, limit: int) -> list[dict[str, Any]]:
    """Cancellations committed by CancelExecution (or a parent's cascade) not applied yet."""
    cur = await conn.execute(
        "SELECT c.execution_id, c.reason FROM noetl.cancel_request c WHERE c.shard_id = %s AND "
        + NOT_QUARANTINED.format(col="c.execution_id") + " ORDER BY c.requested_at LIMIT %s", (shard, limit))
    return list(await cur.fetchall())


async def applied_cancels(conn: Conn, execution_ids: Sequence[int]) -> None:
    """Pending cancellations the batch applied (or found moot) are done."""
    if execution_ids:
        await conn.execute("DELETE FROM noetl.cancel_request WHERE execution_id = ANY(%t::bigint[])",
                           (Column(execution_ids),))


async def cascade_cancels(conn: Conn, parents: Sequence[int]) -> None:
    """Commit the cancellation of the sub-playbook executions of ``parents`` (their own
    shards' engines apply it), in the batch that cancelled the parents."""
    if parents:
        await conn.execute(
            "INSERT INTO noetl.cancel_request (execution_id, shard_id, reason)"
            " SELECT execution_id, shard_id, 'parent execution cancelled' FROM noetl.execution_request"
            " WHERE parent_execution_id = ANY(%t::bigint[]) ON CONFLICT (execution_id) DO NOTHING",
            (Column(parents),))


async def children(conn: Conn, parents: Sequence[int]) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT execution_id, shard_id FROM noetl.execution_request WHERE parent_execution_id = ANY(%s)",
        (list(parents),))
    return list(await cur.fetchall())


async def pending_redrive_executions(conn: Conn, shard: int, limit: int) -> list[int]:
    """Executions with a committed redrive request not applied yet (the sweep)."""
    cur = await conn.execute(
        "SELECT execution_id FROM noetl.redrive_request r WHERE r.shard_id = %s AND "
        + NOT_QUARANTINED.format(col="r.execution_id")
        + " GROUP BY execution_id ORDER BY min(requested_at) LIMIT %s", (shard, limit))
    return [r["execution_id"] for r in await cur.fetchall()]


async def lock_for_redrive(conn: Conn, execution_id: int) -> bool:
    """Take the execution's redrive lock (waits out a compactor batch holding it); True
    when the execution was compacted (its events are gone: nothing can be redriven)."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s, (%s %% 2147483647)::int)",
                       (REDRIVE_LOCK_CLASS, execution_id))
    cur = await conn.execute("SELECT 1 AS x FROM noetl.manifest WHERE execution_id = %s", (execution_id,))
    return await cur.fetchone() is not None


async def redrive_requests(conn: Conn, execution_id: int) -> list[dict[str, Any]]:
    """The execution's pending redrive requests with their dead letters, oldest first."""
    cur = await conn.execute(
        "SELECT d.dead_letter_id, d.command_id, d.step, d.reason, d.loop_instance, d.loop_index, d.status,"
        " d.redrive_command_id, r.requested_by FROM noetl.redrive_request r"
        " JOIN noetl.dead_letter d ON d.dead_letter_id = r.dead_letter_id"
        " WHERE r.execution_id = %s ORDER BY r.requested_at, r.dead_letter_id", (execution_id,))
    return list(await cur.fetchall())


async def applied_redrives(conn: Conn, dead_letter_ids: Sequence[int]) -> None:
    """The redrive requests the batch applied (or refused) are done."""
    if dead_letter_ids:
        await conn.execute("DELETE FROM noetl.redrive_request WHERE dead_letter_id = ANY(%t::bigint[])",
                           (Column(dead_letter_ids),))


async def insert_submission(conn: Conn, *, execution_id: int, shard_id: int, catalog_id: int, payload: str,
                            idempotency_key: str | None, parent_execution_id: int | None, parent_step: str | None,
                            timeout_sec: float, traceparent: str | None, depth: int, workload_ref_id: int | None,
                            payload_bytes: int, submitted_by: int | None, rerun_of: int | None,
                            rerun_from: str | None, priority: str | None, latest_of: str | None = None) -> bool:
    """Record a submission; False when ``idempotency_key`` was already taken (a concurrent
    retry won: its execution is the one), or, with ``latest_of`` (a catalog path), when
    ``catalog_id`` is no longer the latest version of that path (checked in the same
    statement: an api's remembered catalog entry is a hint, never pinned stale)."""
    return await insert_submission_row(
        conn, execution_id=execution_id, shard_id=shard_id, catalog_id=catalog_id, payload=payload,
        idempotency_key=idempotency_key, parent_execution_id=parent_execution_id, parent_step=parent_step,
        timeout_sec=timeout_sec, traceparent=traceparent, depth=depth, workload_ref_id=workload_ref_id,
        payload_bytes=payload_bytes, submitted_by=submitted_by, rerun_of=rerun_of, rerun_from=rerun_from,
        priority=priority, latest_of=latest_of, whole=False) is not None


async def insert_submission_row(conn: Conn, *, execution_id: int, shard_id: int, catalog_id: int, payload: str,
                                idempotency_key: str | None, parent_execution_id: int | None,
                                parent_step: str | None, timeout_sec: float, traceparent: str | None, depth: int,
                                workload_ref_id: int | None, payload_bytes: int, submitted_by: int | None,
                                rerun_of: int | None, rerun_from: str | None, priority: str | None,
                                latest_of: str | None = None, whole: bool = True) -> dict[str, Any] | None:
    """``insert_submission``, returning the row as committed (what ``load_requests`` reads
    of it, but the catalog's ``path`` and ``version``; only its ``execution_id`` unless
    ``whole``), or None when nothing was."""
    values = (execution_id, shard_id, catalog_id, payload, idempotency_key, parent_execution_id, parent_step,
              timeout_sec, traceparent, depth, workload_ref_id, payload_bytes, submitted_by, rerun_of, rerun_from,
              priority)
    columns = ("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload,"
               " idempotency_key, parent_execution_id, parent_step, timeout_sec, traceparent, depth,"
               " workload_ref_id, payload_bytes, submitted_by, rerun_of, rerun_from, priority)")
    conflict = " ON CONFLICT (idempotency_key) DO NOTHING RETURNING " + ("*" if whole else "execution_id")
    if latest_of is None:
        return await one(conn, columns + " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                         + conflict, values)
    return await one(conn, columns + " SELECT %s::bigint, %s::int, %s::bigint, %s::jsonb, %s::text, %s::bigint,"
                     " %s::text, %s::double precision, %s::text, %s::int, %s::bigint, %s::int, %s::bigint, %s::bigint,"
                     " %s::text, %s::text"
                     " WHERE (SELECT c.catalog_id FROM noetl.catalog c WHERE c.path = %s"
                     " ORDER BY c.version DESC LIMIT 1) = %s" + conflict,
                     (*values, latest_of, catalog_id))


async def request_cancel(conn: Conn, execution_id: int, shard_id: int, reason: str) -> None:
    """Commit a cancellation (the shard's engine applies and deletes it)."""
    await conn.execute("INSERT INTO noetl.cancel_request (execution_id, shard_id, reason) VALUES (%s, %s, %s)"
                       " ON CONFLICT (execution_id) DO NOTHING", (execution_id, shard_id, reason))


async def request_redrive(conn: Conn, dead_letter_id: int, execution_id: int, shard_id: int,
                          requested_by: str) -> None:
    """Commit a redrive of a dead letter (the shard's engine applies and deletes it)."""
    await conn.execute(
        "INSERT INTO noetl.redrive_request (dead_letter_id, execution_id, shard_id, requested_by)"
        " VALUES (%s, %s, %s, %s) ON CONFLICT (dead_letter_id) DO NOTHING",
        (dead_letter_id, execution_id, shard_id, requested_by))
