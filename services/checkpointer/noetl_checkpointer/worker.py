"""One shard's checkpoint loop (ARCHITECTURE.md section 6).

Every ``NOETL_CHECKPOINT_INTERVAL_MS``:
* if the engine appended a barrier that is not sealed yet, seal it once the projection
  has passed it: ``INSERT noetl.checkpoint (shard, epoch, last_shard_seq)`` in a
  transaction fenced on this member's checkpointer lease;
* otherwise, if the shard's log grew since the last sealed epoch, ask the engine for a
  new barrier (``CheckpointBarrier`` on ``noetl.events.{shard}.barrier``); the engine
  appends ``checkpoint.committed`` in order, exactly once per epoch. The checkpointer
  never writes events itself.

``noetl_checkpoint_age_ms{shard}`` is the time since the last seal while there is
unsealed work, 0 when the shard is idle and fully sealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge

from noetl_common import natsio
from noetl_common.db import Pool, transaction
from noetl_common.errors import LeaseLost, NoetlError
from noetl_common.ids import SnowflakeGenerator
from noetl_common.shards import ShardOwnership
from noetl_common.shardtasks import forget_on_loss
from noetl_proto.v1 import messages_pb2

logger = logging.getLogger(__name__)

AGE = Gauge("noetl_checkpoint_age_ms", "Time since the shard's last sealed checkpoint while work is unsealed",
            ["shard"])
forget_on_loss("checkpointer", AGE)
SEALED = Counter("noetl_checkpoints_sealed_total", "Checkpoint epochs sealed", ["shard"])
BARRIERS = Counter("noetl_checkpoint_barriers_requested_total", "Barriers requested from the engine", ["shard"])

ROLE = "checkpointer"


class ShardCheckpointer:
    def __init__(self, pool: Pool, js: JetStreamContext, ownership: ShardOwnership, ids: SnowflakeGenerator,
                 shard: int, epoch: int, *, interval_sec: float) -> None:
        self.pool = pool
        self.js = js
        self.ownership = ownership
        self.ids = ids
        self.shard = shard
        self.epoch = epoch
        self.interval = interval_sec
        self._stop = asyncio.Event()
        self._requested: tuple[int, float] | None = None  # (epoch, monotonic time asked)
        self._held_since = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.ownership.epoch(self.shard) != self.epoch:
                    raise LeaseLost(f"checkpointer shard {self.shard} epoch {self.epoch} no longer trusted")
                try:
                    await self.tick()
                except LeaseLost:
                    raise
                except NoetlError as exc:
                    logger.warning("checkpointer shard %s: %s", self.shard, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=self.interval)
        except LeaseLost as exc:
            logger.warning("%s; stopping", exc)

    async def tick(self) -> str:
        """One round; returns what it did: sealed | requested | waiting | idle."""
        async with transaction(self.pool) as conn:
            cur = await conn.execute(
                "UPDATE noetl.shard_lease SET updated_at = now() WHERE role = %s AND shard_id = %s"
                " AND owner_runtime_id = %s AND epoch = %s RETURNING shard_id",
                (ROLE, self.shard, self.ownership.runtime_id, self.epoch))
            if await cur.fetchone() is None:
                raise LeaseLost(f"checkpointer lease for shard {self.shard} epoch {self.epoch} is no longer held")
            state = await self._state(conn)
            sealed_epoch, sealed_seq, sealed_at = state["sealed_epoch"], state["sealed_seq"], state["sealed_at"]
            if state["barrier_epoch"] > sealed_epoch:
                if state["projected_seq"] >= state["barrier_seq"]:
                    await conn.execute(
                        "INSERT INTO noetl.checkpoint (shard_id, epoch, last_shard_seq) VALUES (%s, %s, %s)"
                        " ON CONFLICT DO NOTHING", (self.shard, state["barrier_epoch"], state["barrier_seq"]))
                    sealed_seq, sealed_at = state["barrier_seq"], state["now"]
                    outcome = "sealed"
                else:
                    outcome = "waiting"
            elif state["event_seq"] > sealed_seq:
                outcome = "request"
            else:
                outcome = "idle"
        unsealed = state["event_seq"] > sealed_seq
        if not unsealed:
            age_ms = 0.0
        elif sealed_at is not None:
            age_ms = (state["now"] - sealed_at).total_seconds() * 1000
        else:  # never sealed on this shard: count from when this member took it
            age_ms = (time.monotonic() - self._held_since) * 1000
        AGE.labels(str(self.shard)).set(max(age_ms, 0.0))
        if outcome == "sealed":
            SEALED.labels(str(self.shard)).inc()
        if outcome == "request":
            await self._request_barrier()
            return "requested"
        return outcome

    async def _request_barrier(self) -> None:
        # Ask again only if the engine has not answered a previous request for a while
        # (a lost nudge or a takeover in between).
        if self._requested is not None and time.monotonic() - self._requested[1] < 5 * self.interval:
            return
        epoch = self.ids.next_id()
        msg = messages_pb2.EngineInput(barrier=messages_pb2.CheckpointBarrier(shard_id=self.shard,
                                                                              checkpoint_epoch=epoch))
        await natsio.publish(self.js, natsio.events_subject(self.shard, natsio.KIND_BARRIER), msg.SerializeToString(),
                             msg_id=f"barrier#{self.shard}#{epoch}")
        self._requested = (epoch, time.monotonic())
        BARRIERS.labels(str(self.shard)).inc()

    async def _state(self, conn: Any) -> dict[str, Any]:
        cur = await conn.execute(
            "SELECT e.event_seq, e.barrier_epoch, e.barrier_seq, now() AS now,"
            " COALESCE(p.last_shard_seq, 0) AS projected_seq,"
            " COALESCE(c.epoch, 0) AS sealed_epoch, COALESCE(c.last_shard_seq, 0) AS sealed_seq, c.sealed_at"
            " FROM noetl.shard_lease e"
            " LEFT JOIN noetl.projection_checkpoint p ON p.shard_id = e.shard_id"
            " LEFT JOIN LATERAL (SELECT epoch, last_shard_seq, sealed_at FROM noetl.checkpoint"
            "   WHERE shard_id = e.shard_id ORDER BY epoch DESC LIMIT 1) c ON true"
            " WHERE e.role = 'api' AND e.shard_id = %s", (self.shard,))
        row = await cur.fetchone()
        if row is None:
            return {"event_seq": 0, "barrier_epoch": 0, "barrier_seq": 0, "projected_seq": 0, "sealed_epoch": 0,
                    "sealed_seq": 0, "sealed_at": None, "now": None}
        if self._requested is not None and row["barrier_epoch"] >= self._requested[0]:
            self._requested = None
        return dict(row)
