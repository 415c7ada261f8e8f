"""The engine's statements. Every one runs inside the shard's fenced batch transaction."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import psycopg

from noetl_common.db import columns
from noetl_common.errors import LeaseLost
from noetl_flow import CommandUpdate, ExecState, NewCommand

ROLE = "api"

# The lease must be ours (owner and epoch) and not run out on the database's clock.
FENCE = (
    "UPDATE noetl.shard_lease SET stream_seq = {stream_seq}, updated_at = now()"
    " WHERE role = %s AND shard_id = %s AND owner_runtime_id = %s AND epoch = %s"
    " AND leased_until > clock_timestamp()"
    " RETURNING event_seq, stream_seq, sweep_from, barrier_epoch, barrier_seq"
)
_FENCE_ADVANCE = FENCE.format(stream_seq="GREATEST(stream_seq, %s)")
_FENCE_RESET = FENCE.format(stream_seq="%s")


async def fence(conn: psycopg.AsyncConnection[Any], shard: int, owner: int, epoch: int,
                stream_seq: int, *, reset: bool = False) -> dict[str, Any]:
    """Lock our lease row (serialising against a takeover) or raise LeaseLost. The
    recorded stream position only moves forward, unless ``reset`` (the stream lost
    messages it had acknowledged, or was recreated: its sequence went back)."""
    cur = await conn.execute(_FENCE_RESET if reset else _FENCE_ADVANCE, (stream_seq, ROLE, shard, owner, epoch))
    row = await cur.fetchone()
    if row is None:
        raise LeaseLost(f"engine lease for shard {shard} epoch {epoch} is no longer held")
    return row


async def assert_lease(conn: psycopg.AsyncConnection[Any], shard: int, owner: int, epoch: int) -> None:
    """The batch's last statement before COMMIT: aborts the transaction (LeaseLost) when
    the lease ran out meanwhile (this process froze mid-batch), so nothing commits late."""
    await conn.execute("SELECT noetl.assert_lease(%s, %s, %s, %s)", (ROLE, shard, owner, epoch))


async def finish_batch(conn: psycopg.AsyncConnection[Any], shard: int, event_seq: int, sweep_from: int,
                       barrier_epoch: int, barrier_seq: int) -> None:
    await conn.execute(
        "UPDATE noetl.shard_lease SET event_seq = %s, sweep_from = GREATEST(sweep_from, %s),"
        " barrier_epoch = %s, barrier_seq = %s WHERE role = %s AND shard_id = %s",
        (event_seq, sweep_from, barrier_epoch, barrier_seq, ROLE, shard),
    )


async def load_states(conn: psycopg.AsyncConnection[Any], ids: Sequence[int]) -> dict[int, ExecState]:
    if not ids:
        return {}
    cur = await conn.execute("SELECT execution_id, state FROM noetl.engine_state WHERE execution_id = ANY(%s)",
                             (list(ids),))
    return {r["execution_id"]: ExecState.from_json(r["state"]) for r in await cur.fetchall()}


async def load_requests(conn: psycopg.AsyncConnection[Any], ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    if not ids:
        return {}
    cur = await conn.execute(
        "SELECT r.*, c.path, c.version FROM noetl.execution_request r"
        " JOIN noetl.catalog c ON c.catalog_id = r.catalog_id WHERE r.execution_id = ANY(%s)", (list(ids),))
    return {r["execution_id"]: r for r in await cur.fetchall()}


# Sweeps skip executions with a quarantined input: their input could not be processed,
# and sweeping them again would only quarantine the same failure every tick.
_NOT_QUARANTINED = "NOT EXISTS (SELECT 1 FROM noetl.quarantine q WHERE q.execution_id = {col})"


async def unstarted(conn: psycopg.AsyncConnection[Any], shard: int, after_id: int, limit: int) -> list[int]:
    cur = await conn.execute(
        "SELECT r.execution_id FROM noetl.execution_request r WHERE r.shard_id = %s AND r.execution_id > %s"
        " AND NOT EXISTS (SELECT 1 FROM noetl.engine_state s WHERE s.execution_id = r.execution_id)"
        # queued by a concurrency limit: the heads of the queues are swept (limits.startable)
        " AND NOT EXISTS (SELECT 1 FROM noetl.concurrency_wait w WHERE w.execution_id = r.execution_id)"
        " AND " + _NOT_QUARANTINED.format(col="r.execution_id") + " ORDER BY r.execution_id LIMIT %s",
        (shard, after_id, limit),
    )
    return [r["execution_id"] for r in await cur.fetchall()]


async def overdue(conn: psycopg.AsyncConnection[Any], shard: int, limit: int) -> list[int]:
    cur = await conn.execute(
        "SELECT s.execution_id FROM noetl.engine_state s WHERE s.shard_id = %s AND s.status = 'running'"
        " AND s.deadline < now() AND " + _NOT_QUARANTINED.format(col="s.execution_id") +
        " ORDER BY s.deadline LIMIT %s", (shard, limit))
    return [r["execution_id"] for r in await cur.fetchall()]


async def pending_cancels(conn: psycopg.AsyncConnection[Any], shard: int, limit: int) -> list[dict[str, Any]]:
    """Cancellations committed by CancelExecution (or a parent's cascade) not applied yet."""
    cur = await conn.execute(
        "SELECT c.execution_id, c.reason FROM noetl.cancel_request c WHERE c.shard_id = %s AND "
        + _NOT_QUARANTINED.format(col="c.execution_id") + " ORDER BY c.requested_at LIMIT %s", (shard, limit))
    return list(await cur.fetchall())


async def applied_cancels(conn: psycopg.AsyncConnection[Any], execution_ids: Sequence[int]) -> None:
    """Pending cancellations the batch applied (or found moot) are done."""
    if execution_ids:
        await conn.execute("DELETE FROM noetl.cancel_request WHERE execution_id = ANY(%b::bigint[])",
                           (list(execution_ids),))


async def cascade_cancels(conn: psycopg.AsyncConnection[Any], parents: Sequence[int]) -> None:
    """Commit the cancellation of the sub-playbook executions of ``parents`` (their own
    shards' engines apply it), in the batch that cancelled the parents."""
    if parents:
        await conn.execute(
            "INSERT INTO noetl.cancel_request (execution_id, shard_id, reason)"
            " SELECT execution_id, shard_id, 'parent execution cancelled' FROM noetl.execution_request"
            " WHERE parent_execution_id = ANY(%b::bigint[]) ON CONFLICT (execution_id) DO NOTHING",
            (list(parents),))


async def children(conn: psycopg.AsyncConnection[Any], parents: Sequence[int]) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT execution_id, shard_id FROM noetl.execution_request WHERE parent_execution_id = ANY(%s)",
        (list(parents),))
    return list(await cur.fetchall())


async def quarantine(conn: psycopg.AsyncConnection[Any], shard: int, execution_id: int, kind: str,
                     stream_seq: int | None, attempts: int, error: str, data: bytes | None) -> None:
    await conn.execute(
        "INSERT INTO noetl.quarantine (shard_id, execution_id, input_kind, stream_seq, attempts, error, input)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)", (shard, execution_id, kind, stream_seq, attempts, error[:4000], data))


async def queued_commands(conn: psycopg.AsyncConnection[Any], shard: int) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT command_id, execution_id, attempt, kind FROM noetl.command"
        " WHERE shard_id = %s AND status = 'queued' ORDER BY created_at", (shard,))
    return list(await cur.fetchall())


async def append_events(conn: psycopg.AsyncConnection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
    """Append the batch's events (execution_id, shard_id, shard_seq, type, step, command_id,
    result, meta) in ONE statement (pipeline-friendly, unlike COPY)."""
    if not rows:
        return
    await conn.execute(
        "INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type, step, command_id, result, meta)"
        " SELECT * FROM unnest(%b::bigint[], %b::int[], %b::bigint[], %b::text[], %b::text[], %b::text[],"
        " %b::text[]::jsonb[], %b::text[]::jsonb[])",
        columns(rows, 8),
    )


async def save_states(conn: psycopg.AsyncConnection[Any], shard: int,
                      states: Iterable[tuple[ExecState, int, datetime | None]]) -> None:
    """Upsert the compact engine state of every touched execution (one statement)."""
    rows = [(s.execution_id, shard, s.status, json.dumps(s.to_json()), deadline, seq)
            for s, seq, deadline in states]
    if not rows:
        return
    await conn.execute(
        "INSERT INTO noetl.engine_state (execution_id, shard_id, status, state, deadline, last_shard_seq)"
        " SELECT e, sh, st, js::jsonb, d, q FROM unnest(%b::bigint[], %b::int[], %b::text[], %b::text[],"
        " %b::timestamptz[], %b::bigint[]) AS t(e, sh, st, js, d, q)"
        " ON CONFLICT (execution_id) DO UPDATE SET status = EXCLUDED.status, state = EXCLUDED.state,"
        " deadline = EXCLUDED.deadline, last_shard_seq = EXCLUDED.last_shard_seq, updated_at = now()",
        columns(rows, 6),
    )


async def insert_commands(conn: psycopg.AsyncConnection[Any], shard: int,
                          commands: Iterable[tuple[int, int, NewCommand]]) -> None:
    """Insert the batch's new commands, queued (one statement)."""
    rows = [(c.command_id, eid, shard, catalog_id, c.step, c.kind, c.attempt, json.dumps(c.context),
             float(c.timeout_sec)) for eid, catalog_id, c in commands]
    if not rows:
        return
    await conn.execute(
        "INSERT INTO noetl.command (command_id, execution_id, shard_id, catalog_id, step, kind, status,"
        " attempt, context, timeout_sec)"
        " SELECT c, e, sh, cat, st, k, 'queued', a, ctx::jsonb, t FROM unnest(%b::text[], %b::bigint[],"
        " %b::int[], %b::bigint[], %b::text[], %b::text[], %b::int[], %b::text[], %b::float8[])"
        " AS x(c, e, sh, cat, st, k, a, ctx, t)"
        " ON CONFLICT (command_id) DO NOTHING",
        columns(rows, 9),
    )


async def update_commands(conn: psycopg.AsyncConnection[Any], updates: Iterable[CommandUpdate]) -> None:
    """Apply the batch's command status changes in one statement. Several updates of one
    command in a batch fold in order: the last status, the last attempt given, and the
    worker cleared if it was re-queued on the way."""
    merged: dict[str, tuple[str, str, int | None, bool]] = {}
    for u in updates:
        _, _, attempt, requeued = merged.get(u.command_id, ("", "", None, False))
        merged[u.command_id] = (u.command_id, u.status, u.attempt if u.attempt is not None else attempt,
                                requeued or u.status == "queued")
    if not merged:
        return
    await conn.execute(
        "UPDATE noetl.command c SET status = u.st, attempt = COALESCE(u.a, c.attempt),"
        " worker_id = CASE WHEN u.rq THEN NULL ELSE c.worker_id END, updated_at = now()"
        " FROM unnest(%b::text[], %b::text[], %b::int[], %b::bool[]) AS u(cid, st, a, rq) WHERE c.command_id = u.cid",
        columns(list(merged.values()), 4),
    )


LOOP_ITEMS_CHUNK = 10_000


async def store_loop_items(conn: psycopg.AsyncConnection[Any], execution_id: int, instance: str,
                           items: list[Any]) -> None:
    """A loop's collection, rendered once at entry, one row per item (binary arrays in
    chunks: the engine's transaction runs in pipeline mode, where COPY is not available)."""
    for start in range(0, len(items), LOOP_ITEMS_CHUNK):
        chunk = items[start:start + LOOP_ITEMS_CHUNK]
        await conn.execute(
            "INSERT INTO noetl.loop_item (execution_id, loop_instance, idx, item)"
            " SELECT %b, %b, %b + i.ord - 1, i.item::jsonb FROM unnest(%b::text[]) WITH ORDINALITY AS i(item, ord)",
            (execution_id, instance, start, [json.dumps(item, default=str) for item in chunk]))


async def store_loop_results(conn: psycopg.AsyncConnection[Any],
                             rows: Iterable[tuple[int, str, int, str, int | None]]) -> None:
    rows = list(rows)
    if not rows:
        return
    await conn.execute(
        "INSERT INTO noetl.loop_result (execution_id, loop_instance, idx, status, ref_id)"
        " SELECT * FROM unnest(%b::bigint[], %b::text[], %b::int[], %b::text[], %b::bigint[])"
        " ON CONFLICT DO NOTHING", columns(rows, 5))


async def loop_reference(conn: psycopg.AsyncConnection[Any], execution_id: int, step: str, uri: str,
                         stats: dict[str, Any]) -> int:
    """A result_ref row (tier ``loop``) for a finished loop: its payload is the stats; the
    result store reads the ordered iteration results from ``noetl.loop_result``."""
    data = json.dumps({"stats": stats}).encode()
    cur = await conn.execute(
        "INSERT INTO noetl.result_ref (execution_id, step, tier, uri, size_bytes) VALUES (%s, %s, 'loop', %s, %s)"
        " RETURNING ref_id", (execution_id, step, uri, len(data)))
    row = await cur.fetchone()
    assert row is not None
    await conn.execute("INSERT INTO noetl.result_payload (ref_id, data) VALUES (%s, %s)", (row["ref_id"], data))
    return int(row["ref_id"])


async def loop_results(conn: psycopg.AsyncConnection[Any], execution_id: int, instance: str) -> dict[int, int | None]:
    """{index: ref_id} of a loop instance's accepted iteration results."""
    cur = await conn.execute(
        "SELECT idx, ref_id FROM noetl.loop_result WHERE execution_id = %s AND loop_instance = %s",
        (execution_id, instance))
    return {int(r["idx"]): r["ref_id"] for r in await cur.fetchall()}


async def ok_ranges(conn: psycopg.AsyncConnection[Any], execution_id: int, instance: str) -> list[tuple[int, int]]:
    """The successful iterations of a loop instance as [start, end) index ranges (islands:
    O(ranges) rows whatever the collection's size)."""
    cur = await conn.execute(
        "SELECT min(idx) AS lo, max(idx) + 1 AS hi FROM (SELECT idx, idx - row_number() OVER (ORDER BY idx) AS g"
        " FROM noetl.loop_result WHERE execution_id = %s AND loop_instance = %s AND status = 'ok') x"
        " GROUP BY g ORDER BY lo", (execution_id, instance))
    return [(int(r["lo"]), int(r["hi"])) for r in await cur.fetchall()]


async def copy_loop(conn: psycopg.AsyncConnection[Any], source: int, source_instance: str, execution_id: int,
                    instance: str) -> None:
    """A rerun's resumed loop: the original instance's items, and its successful iteration
    results (references: the payloads stay the original's), into the new instance."""
    await conn.execute(
        "INSERT INTO noetl.loop_item (execution_id, loop_instance, idx, item)"
        " SELECT %s, %s, idx, item FROM noetl.loop_item WHERE execution_id = %s AND loop_instance = %s"
        " ON CONFLICT DO NOTHING", (execution_id, instance, source, source_instance))
    await conn.execute(
        "INSERT INTO noetl.loop_result (execution_id, loop_instance, idx, status, ref_id)"
        " SELECT %s, %s, idx, status, ref_id FROM noetl.loop_result WHERE execution_id = %s AND loop_instance = %s"
        " AND status = 'ok' ON CONFLICT DO NOTHING", (execution_id, instance, source, source_instance))
