"""One shard's retention loop.

Every ``NOETL_COMPACTOR_INTERVAL_SEC`` (at once again after a full batch) it compacts
batches (``compaction.Compaction``) until nothing is due, each in its own transaction
fenced on the lease (shard, owner, epoch). A lease that is no longer trusted, or a fence
that matches no row, stops the loop: the new owner carries on, and a batch that did not
commit left nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from noetl_common.db import Pool
from noetl_common.errors import LeaseLost, NoetlError
from noetl_common.shards import ShardOwnership

from .compaction import BatchResult, Compaction
from .metrics import BARRIERS, BATCH_SECONDS, EVENTS, EXECUTIONS

logger = logging.getLogger(__name__)


class ShardCompactor:
    def __init__(self, pool: Pool, ownership: ShardOwnership, shard: int, epoch: int, *, enabled: bool,
                 retention_sec: float, interval_sec: float, batch_executions: int, batch_events: int) -> None:
        self.pool = pool
        self.ownership = ownership
        self.shard = shard
        self.epoch = epoch
        self.enabled = enabled
        self.retention_sec = retention_sec
        self.interval = interval_sec
        self.batch_executions = batch_executions
        self.batch_events = batch_events
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    def _compaction(self) -> Compaction:
        return Compaction(self.pool, self.shard, self.ownership.runtime_id, self.epoch,
                          retention_sec=self.retention_sec, batch_executions=self.batch_executions,
                          batch_events=self.batch_events)

    async def run(self) -> None:
        for counter in (EXECUTIONS, EVENTS, BARRIERS, BATCH_SECONDS):  # exported from the start (0)
            counter.labels(str(self.shard))
        if not self.enabled:
            await self._stop.wait()
            return
        try:
            while not self._stop.is_set():
                if self.ownership.epoch(self.shard) != self.epoch:
                    raise LeaseLost(f"compactor shard {self.shard} epoch {self.epoch} no longer trusted")
                full = False
                try:
                    full = await self.round()
                except LeaseLost:
                    raise
                except NoetlError as exc:
                    logger.warning("compactor shard %s: %s", self.shard, exc)
                if full:
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=self.interval)
        except LeaseLost as exc:
            logger.warning("%s; stopping", exc)

    async def round(self) -> bool:
        """One batch; True when it was full (more is probably due right away)."""
        result = await self._compaction().batch()
        self.record(result)
        return result.executions + result.revisited >= self.batch_executions or (result.skipped > 0 and not result.empty)

    def record(self, result: BatchResult) -> None:
        shard = str(self.shard)
        if result.empty:
            return
        EXECUTIONS.labels(shard).inc(result.executions)
        EVENTS.labels(shard).inc(result.events)
        BARRIERS.labels(shard).inc(result.barriers)
        BATCH_SECONDS.labels(shard).inc(max(result.seconds, 0.0))
        logger.info("compactor shard %s: %d execution(s) compacted, %d event(s) deleted (+%d barrier) "
                    "in %.3fs", self.shard, result.executions, result.events, result.barriers, result.seconds)
