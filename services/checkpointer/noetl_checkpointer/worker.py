"""One shard's checkpoint loop (ARCHITECTURE.md section 6).

Every ``NOETL_CHECKPOINT_INTERVAL_MS`` (a fixed cadence, tick start to tick start), one
round, ONE statement (``checkpoints.seal_round``):
* if the engine appended a barrier that is not sealed yet and the projection has passed
  it, seal it, fenced on this member's checkpointer lease (the lease row locked by the
  statement): ``INSERT noetl.checkpoint (shard, epoch, last_shard_seq)``; a round with
  nothing to seal writes nothing (the lease is checked, not locked);
* then, if the shard's log grew past the last sealed epoch (and no barrier is still
  outstanding), ask the engine for a new barrier (``CheckpointBarrier`` on
  ``noetl.events.{shard}.barrier``); the engine appends ``checkpoint.committed`` in its
  log order, exactly once per epoch. The checkpointer never writes events itself.

Between ticks, while a barrier is outstanding, the seal does not wait for the next tick:
the projector hints ``noetl.checkpointer.{shard}`` when a batch it projected held a
barrier, and the checkpointer then runs the same round at once (it seals if the seal
condition holds). A probe every ``poll_sec`` is the backstop for a lost hint (then every
2x longer until the next tick). A seal that comes after a tick went by (the barrier still
outstanding) asks for the next barrier at once if the last request is an interval old.
An idle, fully sealed shard costs no round: the ticks of all the shards of a process
start with one shared read (``seal_rounds``), and only a shard with something to seal or
ask for takes its round.

``noetl_checkpoint_age_seconds{shard}`` (seed 004 section 12) is the age of the oldest event of
the shard not yet covered by a sealed checkpoint, 0 when everything is sealed. It is
computed when scraped: the oldest unsealed event's ``created_at`` is read from the log
by every round, and the engine's append hint on ``noetl.projector.{shard}`` marks the
moment a fully sealed shard gets new work (checked against the log at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge

from noetl_common import natsio
from noetl_common.coalesce import ShardRounds, to_boundary
from noetl_common.db import Pool, autocommit
from noetl_common.errors import LeaseLost, NoetlError
from noetl_common.ids import SnowflakeGenerator
from noetl_common.shards import ShardOwnership
from noetl_common.shardtasks import forget_on_loss
from noetl_common.vocab import barrier_msg_id
from noetl_db import checkpoints
from noetl_proto.v1 import messages_pb2

logger = logging.getLogger(__name__)

AGE = Gauge("noetl_checkpoint_age_seconds",
            "Age of the shard's oldest event not yet covered by a sealed checkpoint (0 when all are sealed)",
            ["shard"])
forget_on_loss("checkpointer", AGE)
SEALED = Counter("noetl_checkpoints_sealed_total", "Checkpoint epochs sealed", ["shard"])
BARRIERS = Counter("noetl_checkpoint_barriers_requested_total", "Barriers requested from the engine", ["shard"])

ROLE = "checkpointer"
ENGINE_ROLE = "api"  # whose lease row holds the engine's positions



def seal_rounds(pool: Pool) -> ShardRounds[int, dict[str, Any] | None]:
    """The ticks' first read (``checkpoints.seal_states``), made once for every shard
    checkpointer of a process: the loops tick on the same interval boundaries, and a
    shard found idle (everything sealed, no barrier outstanding) skips its fenced tick,
    so an idle checkpointer makes one query a tick, not one round per shard."""

    async def read(shards: list[int]) -> dict[int, dict[str, Any] | None]:
        async with autocommit(pool) as conn:
            return dict(await checkpoints.seal_states(conn, ENGINE_ROLE, shards))

    return ShardRounds(read, None)


class ShardCheckpointer:
    def __init__(self, pool: Pool, js: JetStreamContext, ownership: ShardOwnership, ids: SnowflakeGenerator,
                 shard: int, epoch: int, *, interval_sec: float, nc: NATS | None = None,
                 poll_sec: float | None = None, states: ShardRounds[int, dict[str, Any] | None] | None = None,
                 ) -> None:
        self.pool = pool
        self.states = states or seal_rounds(pool)
        self.js = js
        self.nc = nc
        self.ownership = ownership
        self.ids = ids
        self.shard = shard
        self.epoch = epoch
        self.interval = interval_sec
        # while a barrier is outstanding: the backstop probe for a lost projector hint, after
        # poll_sec, then doubling until the next tick
        self.poll = poll_sec if poll_sec is not None else min(interval_sec, max(0.05, interval_sec / 10))
        self._backoff = self.poll
        self._stopped = False
        self._wake = asyncio.Event()
        self._requested: tuple[int, float] | None = None  # (epoch, monotonic time asked), until appended
        self._asked_at: float | None = None  # monotonic time of the last barrier request
        self._pending = False      # a barrier was requested or appended and is not sealed yet
        self._verify = False       # the engine hinted new events on a shard believed fully sealed
        # monotonic time the oldest unsealed event was appended (None: everything sealed)
        self._oldest: float | None = None
        AGE.labels(str(shard)).set_function(self.age_seconds)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def age_seconds(self) -> float:
        """The gauge's value, computed when scraped."""
        oldest = self._oldest
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    async def run(self) -> None:
        subs = []
        if self.nc is not None:
            with contextlib.suppress(Exception):  # hints only save latency: the ticks and probes stand alone
                subs.append(await self.nc.subscribe(natsio.projector_subject(self.shard), cb=self._on_appended))
                subs.append(await self.nc.subscribe(natsio.checkpointer_subject(self.shard), cb=self._on_projected))
        next_tick = time.monotonic()
        try:
            while not self._stopped:
                if self.ownership.epoch(self.shard) != self.epoch:
                    raise LeaseLost(f"checkpointer shard {self.shard} epoch {self.epoch} no longer trusted")
                self._wake.clear()
                try:
                    now = time.monotonic()
                    if now >= next_tick:
                        # to the next interval boundary: the shard loops of the process tick
                        # together, and their first reads are one (``seal_rounds``)
                        next_tick = now + to_boundary(self.interval)
                        self._backoff = self.poll
                        await self.tick_unless_idle()
                    elif self._pending or self._verify:
                        sealed = await self.probe() == "sealed"
                        self._backoff = min(2 * self._backoff, self.interval)
                        if sealed and self._asked_at is not None and \
                                time.monotonic() - self._asked_at >= self.interval:
                            # a tick passed while this barrier was outstanding and asked for
                            # nothing: ask now rather than at the next one
                            next_tick = time.monotonic()
                except LeaseLost:
                    raise
                except NoetlError as exc:
                    logger.warning("checkpointer shard %s: %s", self.shard, exc)
                wait = next_tick - time.monotonic()
                if self._pending:
                    wait = min(wait, self._backoff)
                if wait > 0 and not self._stopped:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=wait)
        except LeaseLost as exc:
            logger.warning("%s; stopping", exc)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            # this member no longer follows the shard: its gauge keeps the last value until
            # the shard's series is removed (forget_on_loss) or a new owner takes it
            last = self.age_seconds()
            AGE.labels(str(self.shard)).set_function(lambda: last)

    # ------------------------------------------------------------ hints

    async def _on_appended(self, _msg: Any) -> None:
        """The engine appended events to the shard."""
        if self._oldest is None:
            self._oldest = time.monotonic()
            self._verify = True
            self._wake.set()

    async def _on_projected(self, _msg: Any) -> None:
        """The projector passed a barrier of the shard."""
        if self._pending:
            self._wake.set()

    # ------------------------------------------------------------ rounds

    async def tick(self) -> str:
        """One round; returns what it did: sealed | requested | waiting | idle. A tick that
        seals also asks for the next barrier when newer events wait (still "sealed")."""
        state, outcome, sealed_seq = await self._round(request=True)
        ask = outcome in ("sealed", "requested") and state["event_seq"] > sealed_seq
        self._pending = state["barrier_epoch"] > state["sealed_epoch"] or ask
        if ask:
            await self._request_barrier()
        return outcome

    async def _round(self, request: bool) -> tuple[dict[str, Any], str, int]:
        """The round's statement (``checkpoints.seal_round``: it fences and seals only when
        the projection passed an unsealed barrier, so a round with nothing to seal writes
        nothing): (the state after it, what it did, the sealed ``shard_seq``). ``request``:
        a round that finds new events past the seal says "requested" (a tick asks for a
        barrier then), else "idle" (a probe asks for nothing)."""
        async with autocommit(self.pool) as conn:
            at = time.monotonic()
            row = await checkpoints.seal_round(conn, ENGINE_ROLE, ROLE, self.shard, self.ownership.runtime_id,
                                               self.epoch)
        if not row["ours"] or (row["sealable"] and not row["sealed_now"]):
            raise LeaseLost(f"checkpointer shard {self.shard}: the lease at epoch {self.epoch} is no longer ours")
        state = self._adopt(row if row["event_seq"] is not None else None)
        sealed_seq = state["sealed_seq"]
        if row["sealed_now"]:
            state["sealed_epoch"], state["sealed_seq"] = state["barrier_epoch"], state["barrier_seq"]
            outcome = "sealed"
            SEALED.labels(str(self.shard)).inc()
        elif state["barrier_epoch"] > state["sealed_epoch"]:
            outcome = "waiting"
        elif state["event_seq"] > sealed_seq:
            outcome = "requested" if request else "idle"
        else:
            outcome = "idle"
        self._track(state, row["oldest_at"], at)
        return state, outcome, state["sealed_seq"]

    async def tick_unless_idle(self) -> str:
        """A tick, unless the shard's state read with the other shards' (``seal_rounds``)
        shows it idle: everything sealed and no barrier outstanding. An idle tick writes
        nothing and asks for nothing, so skipping its round changes nothing."""
        state = self._adopt(await self.states.get(self.shard))
        if state["barrier_epoch"] > state["sealed_epoch"] or state["event_seq"] > state["sealed_seq"]:
            return await self.tick()
        self._pending = False
        self._oldest = None
        return "idle"

    async def probe(self) -> str:
        """A look between ticks: seal now if the engine appended the outstanding barrier and
        the projection passed it (the same one statement as a tick, which writes nothing
        when there is nothing to seal); refresh the age after an append hint."""
        state, outcome, _ = await self._round(request=False)
        self._verify = False
        if outcome == "sealed":
            self._pending = False
            return outcome
        self._pending = self._pending and (state["barrier_epoch"] > state["sealed_epoch"] or
                                           self._requested is not None)
        return "waiting" if self._pending else "idle"

    def _track(self, state: dict[str, Any], oldest_at: Any, at: float) -> None:
        """Keep the oldest unsealed event's time (``oldest_at``: its ``created_at`` as the
        round read it; ``at``: the monotonic time of ``state['now']``)."""
        if state["event_seq"] <= state["sealed_seq"]:
            self._oldest = None
            return
        if oldest_at is None or state["now"] is None:  # compacted already: keep what is known
            self._oldest = self._oldest if self._oldest is not None else at
        else:
            age = max(0.0, (state["now"] - oldest_at).total_seconds())
            self._oldest = at - age

    async def _request_barrier(self) -> None:
        # Ask again only if the engine has not answered a previous request for a while
        # (a lost nudge or a takeover in between).
        if self._requested is not None and time.monotonic() - self._requested[1] < 5 * self.interval:
            return
        epoch = self.ids.next_id()
        msg = messages_pb2.EngineInput(barrier=messages_pb2.CheckpointBarrier(shard_id=self.shard,
                                                                              checkpoint_epoch=epoch))
        await natsio.publish(self.js, natsio.events_subject(self.shard, natsio.KIND_BARRIER), msg.SerializeToString(),
                             msg_id=barrier_msg_id(self.shard, epoch))
        self._requested = (epoch, time.monotonic())
        self._asked_at = self._requested[1]
        BARRIERS.labels(str(self.shard)).inc()

    def _adopt(self, row: dict[str, Any] | None) -> dict[str, Any]:
        """A seal-state row (``checkpoints.seal_states``) as the state the rounds use (an engine that never held the
        shard: all zero); a barrier the engine appended answers the request for it."""
        if row is None:
            return {"event_seq": 0, "barrier_epoch": 0, "barrier_seq": 0, "projected_seq": 0, "sealed_epoch": 0,
                    "sealed_seq": 0, "sealed_at": None, "now": None}
        if self._requested is not None and row["barrier_epoch"] >= self._requested[0]:
            self._requested = None
        return dict(row)
