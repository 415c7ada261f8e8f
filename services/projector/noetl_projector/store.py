"""Read-model statements. Everything runs inside the shard's fenced transaction."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from noetl_common.errors import LeaseLost
from noetl_flow.projection import ExecutionView, StepView

ROLE = "projector"


async def fence(conn: psycopg.AsyncConnection[Any], shard: int, owner: int, epoch: int) -> None:
    cur = await conn.execute(
        "UPDATE noetl.shard_lease SET updated_at = now() WHERE role = %s AND shard_id = %s"
        " AND owner_runtime_id = %s AND epoch = %s RETURNING shard_id", (ROLE, shard, owner, epoch))
    if await cur.fetchone() is None:
        raise LeaseLost(f"projector lease for shard {shard} epoch {epoch} is no longer held")


async def watermark(conn: psycopg.AsyncConnection[Any], shard: int) -> int:
    await conn.execute("INSERT INTO noetl.projection_checkpoint (shard_id) VALUES (%s) ON CONFLICT DO NOTHING",
                       (shard,))
    cur = await conn.execute("SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s", (shard,))
    row = await cur.fetchone()
    return int(row["last_shard_seq"]) if row else 0


async def events_after(conn: psycopg.AsyncConnection[Any], shard: int, after: int, limit: int) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT execution_id, shard_seq, event_type, step, command_id, result, meta, created_at FROM noetl.event"
        " WHERE shard_id = %s AND shard_seq > %s ORDER BY shard_seq LIMIT %s", (shard, after, limit))
    return list(await cur.fetchall())


async def load_views(conn: psycopg.AsyncConnection[Any], shard: int, ids: Sequence[int]) -> dict[int, ExecutionView]:
    cur = await conn.execute("SELECT * FROM noetl.execution WHERE execution_id = ANY(%s)", (list(ids),))
    views: dict[int, ExecutionView] = {}
    for r in await cur.fetchall():
        views[r["execution_id"]] = ExecutionView(
            execution_id=r["execution_id"], shard_id=r["shard_id"], status=r["status"], catalog_id=r["catalog_id"],
            playbook_path=r["playbook_path"], playbook_version=r["playbook_version"],
            parent_execution_id=r["parent_execution_id"], error=r["error"], created_at=r["created_at"],
            started_at=r["started_at"], ended_at=r["ended_at"], last_shard_seq=r["last_shard_seq"])
    cur = await conn.execute("SELECT * FROM noetl.execution_step WHERE execution_id = ANY(%s)", (list(views),))
    for r in await cur.fetchall():
        views[r["execution_id"]].steps[r["step"]] = StepView(
            step=r["step"], status=r["status"], visits=r["visits"], attempts=r["attempts"],
            result_ref_id=r["result_ref_id"], error=r["error"], started_at=r["started_at"], ended_at=r["ended_at"])
    for eid in ids:
        views.setdefault(eid, ExecutionView(execution_id=eid, shard_id=shard))
    return views


async def save_views(conn: psycopg.AsyncConnection[Any], views: Iterable[ExecutionView]) -> None:
    views = list(views)
    async with conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO noetl.execution (execution_id, shard_id, catalog_id, playbook_path, playbook_version,"
            " parent_execution_id, status, error, created_at, started_at, ended_at, last_shard_seq, updated_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, now())"
            " ON CONFLICT (execution_id) DO UPDATE SET catalog_id = EXCLUDED.catalog_id,"
            " playbook_path = EXCLUDED.playbook_path, playbook_version = EXCLUDED.playbook_version,"
            " parent_execution_id = EXCLUDED.parent_execution_id, status = EXCLUDED.status, error = EXCLUDED.error,"
            " created_at = EXCLUDED.created_at, started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at,"
            " last_shard_seq = EXCLUDED.last_shard_seq, updated_at = now()",
            [(v.execution_id, v.shard_id, v.catalog_id, v.playbook_path, v.playbook_version, v.parent_execution_id,
              v.status, v.error, v.created_at, v.started_at, v.ended_at, v.last_shard_seq) for v in views],
        )
        steps = [(v.execution_id, s) for v in views for s in v.steps.values() if s.dirty]
        if steps:
            await cur.executemany(
                "INSERT INTO noetl.execution_step (execution_id, step, status, visits, attempts, result_ref_id,"
                " error, started_at, ended_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (execution_id, step) DO UPDATE SET status = EXCLUDED.status, visits = EXCLUDED.visits,"
                " attempts = EXCLUDED.attempts, result_ref_id = EXCLUDED.result_ref_id, error = EXCLUDED.error,"
                " started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at",
                [(eid, s.step, s.status, s.visits, s.attempts, s.result_ref_id, s.error, s.started_at, s.ended_at)
                 for eid, s in steps],
            )


async def advance(conn: psycopg.AsyncConnection[Any], shard: int, last_seq: int, lag_ms: int) -> None:
    await conn.execute(
        "UPDATE noetl.projection_checkpoint SET last_shard_seq = %s, last_projected_at = now(), lag_ms = %s"
        " WHERE shard_id = %s", (last_seq, lag_ms, shard))
