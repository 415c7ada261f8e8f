"""Compaction of one shard's finished executions (seed 004 section 9).

One batch, in ONE transaction fenced on this member's compactor lease row:

    fence      UPDATE noetl.shard_lease ... role='compactor' AND shard AND owner AND epoch
               (row lock held to commit; zero rows = lease lost: roll back, stop)
    manifest   one row per execution: status, counts per event type, event id range,
               ref count, then the terminal reference and its chain depth
    parts      one row per step (from the read model): status, the step's final accepted
               envelope (call.done / call.error / loop.done / command.dead_lettered /
               step.kept),
               its terminal reference, and the whole chain as GetTrace returns it
    delete     DELETE FROM noetl.event WHERE execution_id = ANY(batch)

Candidates: executions of the shard whose read model is terminal and ended before the
horizon, that still have events, all of them already projected (``shard_seq`` at or
below the shard's projection watermark). An execution already compacted that got a late
event (a duplicate result) only has that event deleted and counted into its manifest.
Checkpoint barrier events (``checkpoint.committed``, one synthetic execution id per
barrier) older than the horizon are deleted the same way. The read models, commands,
loop tables and result references stay: ``GetExecution`` keeps answering, and result
values keep resolving.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from noetl_common.db import Conn, Pool, transaction
from noetl_common.errors import LeaseLost
from noetl_common.ids import snowflake_at
from noetl_store import TRACE_COLUMNS

logger = logging.getLogger(__name__)

ROLE = "compactor"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
# step.kept: a rerun's step whose original result it kept (its reference is the original's)
RESULT_EVENTS = ("call.done", "call.error", "loop.done", "command.dead_lettered", "step.kept")
BARRIER_EVENT = "checkpoint.committed"
MAX_CHAIN_DEPTH = 10_000

FENCE = ("UPDATE noetl.shard_lease SET updated_at = now() WHERE role = %s AND shard_id = %s"
         " AND owner_runtime_id = %s AND epoch = %s RETURNING shard_id")

WATERMARK = "SELECT COALESCE((SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s), 0) AS seq"

# The oldest execution id below the horizon that still has events on this shard: the
# candidate scan starts there, so its cost follows the backlog, not the history.
LOW = ("SELECT min(execution_id) AS low FROM noetl.event"
       " WHERE shard_id = %(shard)s AND execution_id < %(horizon_id)s")

CANDIDATES = """
SELECT x.execution_id FROM noetl.execution x
WHERE x.execution_id >= %(low)s AND x.execution_id < %(horizon_id)s AND x.shard_id = %(shard)s
  AND x.status = ANY(%(terminal)s)
  AND x.ended_at < now() - make_interval(secs => %(retention_sec)s)
  AND EXISTS (SELECT 1 FROM noetl.event e WHERE e.execution_id = x.execution_id)
ORDER BY x.execution_id
LIMIT %(limit)s
"""

BARRIERS = """
SELECT DISTINCT execution_id FROM noetl.event
WHERE shard_id = %(shard)s AND execution_id >= %(low)s AND execution_id < %(horizon_id)s
  AND event_type = %(barrier)s AND shard_seq <= %(projected)s
  AND created_at < now() - make_interval(secs => %(retention_sec)s)
LIMIT %(limit)s
"""

# Per execution: events by type, id range, last shard_seq. Executions whose events are not
# all projected yet are left for a later round.
STATS = """
WITH t AS (
  SELECT execution_id, event_type, count(*) AS n, min(event_id) AS lo, max(event_id) AS hi,
         max(shard_seq) AS seq
  FROM noetl.event WHERE execution_id = ANY(%(ids)s) GROUP BY execution_id, event_type
)
SELECT execution_id, jsonb_object_agg(event_type, n) AS event_types, sum(n)::bigint AS event_count,
       min(lo) AS first_event_id, max(hi) AS last_event_id, max(seq) AS last_shard_seq
FROM t GROUP BY execution_id
"""

MANIFEST = """
INSERT INTO noetl.manifest (execution_id, shard_id, status, playbook_path, playbook_version, step_count,
                            ref_count, event_count, event_types, first_event_id, last_event_id, last_shard_seq,
                            started_at, ended_at, compactor_epoch)
SELECT x.execution_id, x.shard_id, x.status, x.playbook_path, x.playbook_version,
       (SELECT count(*) FROM noetl.execution_step s WHERE s.execution_id = x.execution_id),
       (SELECT count(*) FROM noetl.result_ref r WHERE r.execution_id = x.execution_id),
       st.event_count, st.event_types, st.first_event_id, st.last_event_id, st.last_shard_seq,
       x.started_at, x.ended_at, %(epoch)s
FROM jsonb_to_recordset(%(stats)s::jsonb) AS st(execution_id bigint, event_count bigint, event_types jsonb,
                                                 first_event_id bigint, last_event_id bigint, last_shard_seq bigint)
JOIN noetl.execution x ON x.execution_id = st.execution_id
ON CONFLICT (execution_id) DO UPDATE SET
  event_count = noetl.manifest.event_count + EXCLUDED.event_count,
  event_types = (SELECT jsonb_object_agg(k, COALESCE((noetl.manifest.event_types ->> k)::bigint, 0)
                                            + COALESCE((EXCLUDED.event_types ->> k)::bigint, 0))
                 FROM jsonb_object_keys(noetl.manifest.event_types || EXCLUDED.event_types) AS k),
  last_event_id = GREATEST(noetl.manifest.last_event_id, EXCLUDED.last_event_id),
  last_shard_seq = GREATEST(noetl.manifest.last_shard_seq, EXCLUDED.last_shard_seq)
RETURNING execution_id, (xmax = 0) AS created
"""

_ENTRY = ", ".join(f"'{c}', rr.{c}" for c in TRACE_COLUMNS)

# The chain walks result_ref by primary key (LATERAL ... LIMIT 1 keeps the planner from
# hashing the whole table), and the batch's events are read once (``ev``).
PARTS = f"""
WITH RECURSIVE chain AS (
  SELECT s.execution_id AS x_id, s.step AS x_step, r.parent_ref_id, r.entry, 1 AS depth
  FROM noetl.execution_step s
  CROSS JOIN LATERAL (SELECT rr.parent_ref_id, jsonb_build_object({_ENTRY}) AS entry
                      FROM noetl.result_ref rr WHERE rr.ref_id = s.result_ref_id LIMIT 1) r
  WHERE s.execution_id = ANY(%(ids)s)
  UNION ALL
  SELECT c.x_id, c.x_step, r.parent_ref_id, r.entry, c.depth + 1
  FROM chain c
  CROSS JOIN LATERAL (SELECT rr.parent_ref_id, jsonb_build_object({_ENTRY}) AS entry
                      FROM noetl.result_ref rr WHERE rr.ref_id = c.parent_ref_id LIMIT 1) r
  WHERE c.depth < {MAX_CHAIN_DEPTH}
), chains AS (
  SELECT x_id, x_step, count(*) AS depth, jsonb_agg(entry ORDER BY depth) AS chain FROM chain GROUP BY x_id, x_step
), ev AS MATERIALIZED (
  SELECT execution_id, step, event_type, event_id, result, (meta ? 'index') AS iteration
  FROM noetl.event WHERE execution_id = ANY(%(ids)s) AND step IS NOT NULL
), finals AS (
  SELECT DISTINCT ON (execution_id, step) execution_id, step, event_type, result
  FROM ev WHERE event_type = ANY(%(result_events)s) AND NOT iteration
  ORDER BY execution_id, step, event_id DESC
), counts AS (
  SELECT execution_id, step, count(*) AS n FROM ev GROUP BY execution_id, step
)
INSERT INTO noetl.manifest_part (execution_id, step, status, visits, event_type, envelope, terminal_ref_id,
                                 chain_depth, chain, event_count)
SELECT s.execution_id, s.step, s.status, s.visits, f.event_type, f.result, s.result_ref_id,
       COALESCE(c.depth, 0), COALESCE(c.chain, '[]'::jsonb), COALESCE(n.n, 0)
FROM noetl.execution_step s
LEFT JOIN chains c ON c.x_id = s.execution_id AND c.x_step = s.step
LEFT JOIN finals f ON f.execution_id = s.execution_id AND f.step = s.step
LEFT JOIN counts n ON n.execution_id = s.execution_id AND n.step = s.step
WHERE s.execution_id = ANY(%(ids)s)
RETURNING execution_id, terminal_ref_id, chain_depth
"""

# The execution's terminal reference: the newest step result (ref ids only grow).
TERMINAL_REF = """
UPDATE noetl.manifest m SET terminal_ref_id = t.ref_id, chain_depth = t.depth
FROM unnest(%(ids)s::bigint[], %(refs)s::bigint[], %(depths)s::int[]) AS t(execution_id, ref_id, depth)
WHERE m.execution_id = t.execution_id
"""

# The retention delete (the only statement that ever deletes events).
DELETE_EVENTS = "DELETE FROM noetl.event WHERE execution_id = ANY(%(ids)s)"
DELETE_BARRIERS = "DELETE FROM noetl.event WHERE execution_id = ANY(%(ids)s) AND event_type = %(barrier)s"


@dataclass
class BatchResult:
    executions: int = 0          # newly compacted (manifest written)
    revisited: int = 0           # already compacted, late events deleted
    events: int = 0              # events deleted
    barriers: int = 0            # checkpoint barrier events deleted
    skipped: int = 0             # candidates left for later (not projected yet, batch full)
    seconds: float = 0.0
    compacted_ids: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.executions or self.revisited or self.events or self.barriers)


def horizon_id(now_ms: int, retention_sec: float) -> int:
    """The smallest execution id that may still be inside the horizon (snowflake time)."""
    return snowflake_at(max(0, now_ms - int(retention_sec * 1000)))


class Compaction:
    """Compacts batches of one shard under one lease (shard, owner, epoch)."""

    def __init__(self, pool: Pool, shard: int, owner: int, epoch: int, *, retention_sec: float,
                 batch_executions: int = 500, batch_events: int = 50_000) -> None:
        self.pool = pool
        self.shard = shard
        self.owner = owner
        self.epoch = epoch
        self.retention_sec = retention_sec
        self.batch_executions = batch_executions
        self.batch_events = batch_events

    async def _fence(self, conn: Conn) -> None:
        cur = await conn.execute(FENCE, (ROLE, self.shard, self.owner, self.epoch))
        if await cur.fetchone() is None:
            raise LeaseLost(f"compactor lease for shard {self.shard} epoch {self.epoch} is no longer held")

    async def batch(self, *, now_ms: int | None = None) -> BatchResult:
        """Compact at most one batch; an empty result means nothing is due."""
        start = time.perf_counter()
        out = BatchResult()
        params: dict[str, Any] = {
            "shard": self.shard, "retention_sec": self.retention_sec, "terminal": list(TERMINAL),
            "horizon_id": horizon_id(now_ms if now_ms is not None else int(time.time() * 1000),
                                     self.retention_sec),
            "limit": self.batch_executions, "barrier": BARRIER_EVENT,
        }
        async with transaction(self.pool) as conn:
            await self._fence(conn)
            # JIT-compiling these one-off statements costs far more than it saves (~1 s a batch).
            await conn.execute("SET LOCAL jit = off")
            cur = await conn.execute(LOW, params)
            low = (await cur.fetchone() or {}).get("low")
            if low is None:
                return out
            params["low"] = low
            cur = await conn.execute(WATERMARK, (self.shard,))
            params["projected"] = (await cur.fetchone() or {}).get("seq") or 0
            cur = await conn.execute(CANDIDATES, params)
            candidates = [int(r["execution_id"]) for r in await cur.fetchall()]
            if candidates:
                await self._compact(conn, candidates, params, out)
            cur = await conn.execute(BARRIERS, params)
            barrier_ids = [int(r["execution_id"]) for r in await cur.fetchall()]
            if barrier_ids:
                cur = await conn.execute(DELETE_BARRIERS, {"ids": barrier_ids, "barrier": BARRIER_EVENT})
                out.barriers = cur.rowcount
        out.seconds = time.perf_counter() - start
        return out

    async def _compact(self, conn: Conn, candidates: list[int], params: dict[str, Any], out: BatchResult) -> None:
        cur = await conn.execute(STATS, {"ids": candidates})
        stats = sorted(await cur.fetchall(), key=lambda r: r["execution_id"])
        chosen: list[dict[str, Any]] = []
        total = 0
        for row in stats:
            if int(row["last_shard_seq"]) > int(params["projected"]):
                out.skipped += 1
                continue
            if chosen and total + int(row["event_count"]) > self.batch_events:
                out.skipped += 1
                continue
            chosen.append(row)
            total += int(row["event_count"])
        if not chosen:
            return
        cur = await conn.execute(MANIFEST, {"stats": json.dumps([dict(r) for r in chosen], default=str),
                                            "epoch": self.epoch})
        written = await cur.fetchall()
        created = [int(r["execution_id"]) for r in written if r["created"]]
        out.revisited = len(written) - len(created)
        if created:
            cur = await conn.execute(PARTS, {"ids": created, "result_events": list(RESULT_EVENTS)})
            terminal: dict[int, tuple[int, int]] = {}
            for part in await cur.fetchall():
                ref = part["terminal_ref_id"]
                if ref is not None and ref > terminal.get(part["execution_id"], (0, 0))[0]:
                    terminal[int(part["execution_id"])] = (int(ref), int(part["chain_depth"]))
            if terminal:
                await conn.execute(TERMINAL_REF, {"ids": list(terminal), "refs": [t[0] for t in terminal.values()],
                                                  "depths": [t[1] for t in terminal.values()]})
        ids = [int(r["execution_id"]) for r in written]
        cur = await conn.execute(DELETE_EVENTS, {"ids": ids})
        out.events = cur.rowcount
        out.executions = len(created)
        out.compacted_ids = created
