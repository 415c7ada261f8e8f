"""One shard's projection loop: batches past the watermark, one transaction each,
woken by the engine's hint on ``noetl.projector.{shard}`` (a slow poll is the backstop; the
polls of all the shards of a process are one query, ``projection_polls``).
After a batch that held a checkpoint barrier it hints ``noetl.checkpointer.{shard}``: the
checkpointer seals the barrier at once instead of at its next tick."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, defaultdict
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NATS
from prometheus_client import Counter, Gauge

from noetl_common import faults, natsio
from noetl_common.coalesce import ShardRounds, to_boundary
from noetl_common.db import Pool, autocommit, pipelined_transaction
from noetl_common.errors import LeaseLost, NoetlError
from noetl_common.shards import ShardOwnership
from noetl_common.shardtasks import forget_on_loss
from noetl_common.vocab import PUBLIC_TERMINAL, EventType
from noetl_db import gated, leases, read_models
from noetl_flow.projection import ExecutionView, fold

logger = logging.getLogger(__name__)

SYSTEM_EVENTS = frozenset({EventType.CHECKPOINT_COMMITTED})
LAG = Gauge("noetl_projection_lag_seconds", "Age of the newest projected event when it was projected",
            ["shard"])
forget_on_loss("projector", LAG)
MAX_LAG_MS = 2**31 - 1  # projection_checkpoint.lag_ms is an int (~24.8 days)
PROJECTED = Counter("noetl_projected_events_total", "Events folded into the read models", ["shard"])
# Read models of running executions kept per shard projector (the committed rows it wrote)
VIEWS_KEPT = 1000


def projection_polls(pool: Pool) -> ShardRounds[int, bool]:
    """The slow polls of every shard projector of a process, made as one read
    (``read_models.shards_behind``): the loops poll on the same boundaries, and only a
    shard with events past its watermark then takes its fenced round, so an idle
    projector makes one query a poll, not one transaction per shard."""

    async def read(shards: list[int]) -> dict[int, bool]:
        async with autocommit(pool) as conn:
            return dict.fromkeys(await read_models.shards_behind(conn, shards), True)

    return ShardRounds(read, False)


class ShardProjector:
    """A hint (or a full batch) runs the fenced round at once; a slow poll asks
    ``polls`` (``projection_polls``) first whether the shard has anything to project."""

    def __init__(self, pool: Pool, nc: NATS, ownership: ShardOwnership, shard: int, epoch: int,
                 *, batch_size: int, poll_sec: float, polls: ShardRounds[int, bool] | None = None,
                 window_sec: float = 0.0) -> None:
        self.pool = pool
        self.nc = nc
        self.ownership = ownership
        self.shard = shard
        self.epoch = epoch
        self.batch_size = batch_size
        self.poll_sec = poll_sec
        self.polls = polls or projection_polls(pool)
        self.window_sec = window_sec
        self._wake = asyncio.Event()
        self._deferred: asyncio.TimerHandle | None = None  # the wake a deferred hint scheduled
        self._stopped = False
        # The read models of the shard's running executions as this projector last committed
        # them (it is their only writer while it holds the shard at this epoch): a batch loads
        # only those it has not seen, so a running execution's batches skip that round trip.
        # Dropped on any failed batch; a terminal execution's is dropped when projected.
        self._views: OrderedDict[int, ExecutionView] = OrderedDict()
        # a batch has fenced in a transaction at this epoch (LeaseLost is raised there): the
        # next batches may take one statement (``_project_one_statement``)
        self._fenced_once = False

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def hinted(self, payload: bytes) -> None:
        """The engine appended events: project them now when the hint says so
        (``natsio.PROJECT_NOW``: an execution ended, a barrier was appended), else within
        the batch window, together with whatever else arrives meanwhile."""
        if payload == natsio.PROJECT_NOW or self.window_sec <= 0:
            self._wake.set()
        elif self._deferred is None:
            self._deferred = asyncio.get_running_loop().call_later(self.window_sec, self._wake.set)

    async def run(self) -> None:
        async def hint(msg: Any) -> None:
            self.hinted(msg.data)

        sub = await self.nc.subscribe(natsio.projector_subject(self.shard), cb=hint)
        polled = False  # woken by the slow poll, not by a hint or a full batch
        try:
            while not self._stopped:
                faults.check("projector.loop", self.shard)
                if self.ownership.epoch(self.shard) != self.epoch:
                    raise LeaseLost(f"projector shard {self.shard} epoch {self.epoch} no longer trusted")
                self._wake.clear()
                try:
                    n = await self._project() if not polled or await self.polls.get(self.shard) else 0
                except LeaseLost:
                    raise
                except NoetlError as exc:
                    logger.warning("projection of shard %s failed: %s", self.shard, exc)
                    n = 0
                    await asyncio.sleep(0.5)
                polled = False
                if n >= self.batch_size:
                    continue
                try:  # to the next poll boundary: the shard loops of the process poll together
                    await asyncio.wait_for(self._wake.wait(), timeout=to_boundary(self.poll_sec))
                except TimeoutError:
                    polled = True
        except LeaseLost as exc:
            logger.warning("%s; stopping", exc)
        finally:
            if self._deferred is not None:
                self._deferred.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _project(self) -> int:
        if self._deferred is not None:  # this batch reads what the deferred hints announced
            self._deferred.cancel()
            self._deferred = None
        return await self.project_once()

    async def project_once(self) -> int:
        """Fold one batch past the watermark in one fenced transaction; returns events read.

        Raises LeaseLost when the lease is not ours any more, and a NoetlError (psycopg
        errors translated) on failures the loop retries."""
        try:
            return await self._project_once()
        except BaseException:
            self._views.clear()  # it may hold folds that did not commit
            raise

    async def _project_once(self) -> int:
        if self._fenced_once:
            done = await self._project_one_statement()
            if done is not None:
                return done
        return await self._project_in_transaction()

    async def _project_in_transaction(self) -> int:
        # pipeline mode: fence + read, load (only views not kept), then the writes with the
        # COMMIT (three round trips, two when every view is kept)
        async with pipelined_transaction(self.pool) as conn:
            events = await read_models.fence_and_read(conn, self.shard, self.ownership.runtime_id, self.epoch,
                                                self.batch_size)
            self._fenced_once = True
            if not events:
                return 0
            by_exec = _by_execution(events)
            views = {e: self._views[e] for e in by_exec if e in self._views}
            if missing := [e for e in by_exec if e not in views]:
                views.update(await read_models.load_views(conn, self.shard, missing))
            touched = [eid for eid, evs in by_exec.items() if fold(views[eid], evs)]
            await read_models.save_views(conn, [views[e] for e in touched])
            lag = _lag_ms(events[-1])
            await read_models.advance(conn, self.shard, int(events[-1]["shard_seq"]), lag)
        await self._committed(events, views, touched, lag)
        return len(events)

    async def _project_one_statement(self) -> int | None:
        """The batch without a transaction: the events past the watermark read on their own
        (and the rows of executions neither kept nor starting in the batch), then ONE
        statement (``gated``) whose gates are the fence and the watermark still being the
        one read past, and whose writes are the read models' upserts. None when a gate
        matched nothing (nothing written): the transaction then fences and says why. The
        fence runs once in a transaction first, so a projector that does not hold its
        lease learns it from LeaseLost, as before."""
        async with autocommit(self.pool) as conn:
            watermark, events = await read_models.read_past(conn, self.shard, self.batch_size)
            if not events:
                return 0
            by_exec = _by_execution(events)
            views = {e: self._views[e] for e in by_exec if e in self._views}
            # an execution whose first event is in this batch has no rows yet
            new = {e for e, evs in by_exec.items() if e not in views and evs[0]["event_type"] == EventType.PLAYBOOK_STARTED}
            views.update({e: ExecutionView(execution_id=e, shard_id=self.shard) for e in new})
            if missing := [e for e in by_exec if e not in views]:
                views.update(await read_models.load_views(conn, self.shard, missing))
            touched = [eid for eid, evs in by_exec.items() if fold(views[eid], evs)]
            lag = _lag_ms(events[-1])
            gates = [leases.fence_write(read_models.ROLE, self.shard, self.ownership.runtime_id, self.epoch),
                     read_models.advance_write(self.shard, watermark, int(events[-1]["shard_seq"]), lag)]
            if not await gated(conn, gates, read_models.save_views_writes(views[e] for e in touched)):
                self._views.clear()  # folded from rows that may not be what Postgres holds
                self._fenced_once = False
                return None
        await self._committed(events, views, touched, lag)
        return len(events)

    async def _committed(self, events: list[dict[str, Any]], views: dict[int, ExecutionView], touched: list[int],
                         lag: int) -> None:
        barrier = any(ev["event_type"] in SYSTEM_EVENTS for ev in events)
        for eid, view in views.items():  # committed: keep what the rows now say
            if view.status in PUBLIC_TERMINAL:
                self._views.pop(eid, None)
                continue
            for step in view.steps.values():
                step.dirty = False
            self._views[eid] = view
            self._views.move_to_end(eid)
        while len(self._views) > VIEWS_KEPT:
            self._views.popitem(last=False)
        LAG.labels(str(self.shard)).set(lag / 1000)
        PROJECTED.labels(str(self.shard)).inc(len(events))
        if barrier:
            await natsio.hint(self.nc, natsio.checkpointer_subject(self.shard))
        for eid in touched:
            await natsio.hint(self.nc, natsio.progress_subject(eid),
                              natsio.PROGRESS_TERMINAL if views[eid].status in PUBLIC_TERMINAL else b"")


def _by_execution(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """The batch's events by execution, in order (shard-level barriers have no read model)."""
    by_exec: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for ev in events:
        if ev["event_type"] not in SYSTEM_EVENTS:
            by_exec[ev["execution_id"]].append(ev)
    return by_exec


def _lag_ms(last: dict[str, Any]) -> int:
    lag = int((datetime.now(UTC) - last["created_at"]).total_seconds() * 1000)
    return min(max(lag, 0), MAX_LAG_MS)
