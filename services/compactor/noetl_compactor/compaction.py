"""Compaction of one shard's finished executions (seed 004 section 9); its statements are
the data layer's (``noetl_db.checkpoints``, ``noetl_db.events``).

One batch, in ONE transaction fenced on this member's compactor lease row:

    fence      noetl_db.leases.fence on (compactor, shard, owner, epoch)
               (row lock held to commit; zero rows = lease lost: roll back, stop)
    manifest   one row per execution: status, counts per event type, event id range,
               ref count, then the terminal reference and its chain depth
    parts      one row per step (from the read model): status, the step's final accepted
               envelope (call.done / call.error / loop.done / command.dead_lettered /
               step.kept),
               its terminal reference, and the whole chain as GetTrace returns it
    delete     the batch's events (noetl_db.events.DELETE_EVENTS)

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

from noetl_common.db import REDRIVE_LOCK_CLASS, Conn, Pool, transaction
from noetl_common.ids import snowflake_at
from noetl_common.vocab import PUBLIC_TERMINAL, EventType
from noetl_db import leases
from noetl_db.checkpoints import MANIFEST, PARTS, TERMINAL_REF
from noetl_db.events import DELETE_BARRIERS, DELETE_EVENTS

logger = logging.getLogger(__name__)

ROLE = "compactor"
TERMINAL = tuple(sorted(PUBLIC_TERMINAL))
# step.kept: a rerun's step whose original result it kept (its reference is the original's)
RESULT_EVENTS = (EventType.CALL_DONE, EventType.CALL_ERROR, EventType.LOOP_DONE, EventType.COMMAND_DEAD_LETTERED,
                 EventType.STEP_KEPT)
BARRIER_EVENT = EventType.CHECKPOINT_COMMITTED

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

# An execution being redriven is left out (the engine holds its redrive lock); one this
# batch locks is redriven only after it commits, and then refused (compacted). Then, in a
# new statement (a new snapshot), executions with events past the watermark are left out:
# a redrive committed just before the lock was taken.
LOCK_FOR_COMPACTION = ("SELECT id FROM unnest(%(ids)s::bigint[]) AS id"
                       " WHERE pg_try_advisory_xact_lock_shared(%(lock)s, (id %% 2147483647)::int)")
UNPROJECTED = ("SELECT DISTINCT execution_id FROM noetl.event WHERE execution_id = ANY(%(ids)s)"
               " AND shard_seq > %(projected)s")


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
        await leases.fence(conn, ROLE, self.shard, self.owner, self.epoch)

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
        cur = await conn.execute(LOCK_FOR_COMPACTION, {"ids": [int(r["execution_id"]) for r in chosen],
                                                       "lock": REDRIVE_LOCK_CLASS})
        locked = [int(r["id"]) for r in await cur.fetchall()]
        cur = await conn.execute(UNPROJECTED, {"ids": locked, "projected": params["projected"]})
        keep = set(locked) - {int(r["execution_id"]) for r in await cur.fetchall()}
        out.skipped += sum(1 for r in chosen if int(r["execution_id"]) not in keep)
        chosen = [r for r in chosen if int(r["execution_id"]) in keep]
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
