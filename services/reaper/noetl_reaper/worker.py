"""One shard's reaper loop. It only reads Postgres and publishes to NATS: the engine
decides (re-issue with attempt+1, or dead-letter), so a stale reaper is harmless."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge

from noetl_common import natsio, pools, tracing, vocab
from noetl_common.coalesce import ShardRounds, to_boundary
from noetl_common.config import CommandSettings
from noetl_common.db import Pool, transaction
from noetl_common.errors import NoetlError
from noetl_db import commands
from noetl_proto.v1 import messages_pb2

logger = logging.getLogger(__name__)

REAPED = Counter("noetl_reaped_commands_total", "Commands reported or republished by the reaper", ["reason"])
for _reason in ("lease_expired", "republished"):  # exported as 0 before the first one
    REAPED.labels(_reason)
UNSCHEDULABLE = Gauge("noetl_commands_unschedulable",
                      "Queued commands no live worker qualifies for (their pool has no live worker, or none with"
                      " their labels / tool kind), per pool and shard", ["pool", "shard"])


def renewal_grace(lease_sec: float) -> float:
    """How long after an outage claims are not judged: one renewal interval and a margin."""
    return lease_sec / 3 + 2.0


class ShardReads(NamedTuple):
    """What one round found for one shard."""

    expired: list[dict[str, Any]]
    stale: list[dict[str, Any]]
    waiting: dict[str, int]  # unschedulable queued commands per pool


class ReapRounds:
    """Reads the rounds of every shard reaper of a process in one transaction.

    The shard loops wake on the same interval boundaries (``ShardReaper.run``), and the
    reads asked for within ``gather_sec`` of the first are made together, for all their
    shards (``shard_id = ANY``; ``noetl_common.coalesce``). So a reaper holding 16 shards
    makes one transaction of three queries a second, not 16: its idle cost no longer grows
    with its shard count. Each shard keeps its own loop, epoch, outage tracking and
    publishes; a failed transaction fails the round of every shard in it (each logs and
    retries, as before)."""

    def __init__(self, pool: Pool, cfg: CommandSettings, *, gather_sec: float = 0.005) -> None:
        self.pool = pool
        self.cfg = cfg
        self._rounds: ShardRounds[tuple[int, bool], ShardReads] = ShardRounds(
            self._read, ShardReads([], [], {}), gather_sec=gather_sec)

    @property
    def transactions(self) -> int:
        """Rounds read (for tests and the measurement)."""
        return self._rounds.reads

    async def read(self, shard: int, *, judge_expiries: bool) -> ShardReads:
        return await self._rounds.get((shard, judge_expiries))

    async def _read(self, asked: list[tuple[int, bool]]) -> dict[tuple[int, bool], ShardReads]:
        shards = sorted({shard for shard, _ in asked})
        judged = sorted({shard for shard, judge in asked if judge})
        async with transaction(self.pool) as conn:
            # as many rows a round as one query per shard returned before
            expired = await commands.expired_claims(conn, judged, self.cfg.lease_sec, limit=500 * max(1, len(judged)))
            stale = await commands.stale_queued(conn, shards, self.cfg.republish_after_sec, limit=500 * len(shards))
            waiting = await commands.unschedulable(conn, shards)
        return {(shard, judge): ShardReads([r for r in expired if judge and r["shard_id"] == shard],
                                           [r for r in stale if r["shard_id"] == shard], waiting.get(shard, {}))
                for shard, judge in asked}


class ShardReaper:
    """``hold_expiries()`` true: expired claims are not reported (Postgres was just
    unreachable from here: the workers could not renew either, and get a command lease to
    do so before their claims are judged). Claims are never judged within a command lease
    of the database's own start either (a restart loses everyone's renewals). ``rounds``
    is the process's shared reader (``ReapRounds``); without one the reaper reads alone."""

    def __init__(self, pool: Pool, js: JetStreamContext, shard: int, epoch: int,
                 cfg: CommandSettings, interval: float, hold_expiries: Callable[[], bool] | None = None,
                 rounds: ReapRounds | None = None) -> None:
        self.pool = pool
        self.js = js
        self.shard = shard
        self.epoch = epoch
        self.cfg = cfg
        self.interval = interval
        self.rounds = rounds or ReapRounds(pool, cfg)
        self._hold = hold_expiries or (lambda: False)
        self._failing_since: float | None = None  # monotonic: the first failed round of a run of them
        self._outage_ended: float | None = None  # monotonic: when rounds succeeded again after an outage
        self._stop = asyncio.Event()
        self._unschedulable: set[str] = set()  # pools this shard reports in the gauge

    def stop(self) -> None:
        self._stop.set()
        for pool in self._unschedulable:  # another reaper reports this shard now
            with contextlib.suppress(KeyError):
                UNSCHEDULABLE.remove(pool, str(self.shard))
        self._unschedulable.clear()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.reap_once()
                if self._failing_since is not None:
                    if time.monotonic() - self._failing_since >= self.interval:  # more than one round
                        self._outage_ended = time.monotonic()
                    self._failing_since = None
            except NoetlError as exc:
                self._failing_since = self._failing_since or time.monotonic()
                logger.warning("reaper shard %s: %s", self.shard, exc)
            # to the next interval boundary: every shard loop of the process wakes together,
            # and ``ReapRounds`` reads their rounds in one transaction
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=to_boundary(self.interval))

    def _holding(self) -> bool:
        """Workers renew every third of a lease: after an outage that kept them from it,
        they get that long (and a little) before their claims are judged."""
        recent = (self._outage_ended is not None
                  and time.monotonic() - self._outage_ended < renewal_grace(self.cfg.lease_sec))
        return recent or self._hold()

    async def reap_once(self) -> tuple[int, int]:
        """Report expired claims, republish stale queued commands (on their pool's and
        priority's subject) and count the queued ones no live worker qualifies for
        (``noetl_commands_unschedulable``); returns the first two counts.
        Failures come out as NoetlError (psycopg and nats errors translated)."""
        expired, stale, found = await self.rounds.read(self.shard, judge_expiries=not self._holding())
        # the default pool is always exported (0 when nothing waits): the alert has a series
        waiting = {pools.DEFAULT_POOL: 0, **found}
        for pool in self._unschedulable - set(waiting):
            UNSCHEDULABLE.labels(pool, str(self.shard)).set(0)
        for pool, n in waiting.items():
            UNSCHEDULABLE.labels(pool, str(self.shard)).set(n)
        self._unschedulable |= set(waiting)
        for row in expired:
            msg = messages_pb2.EngineInput(expired=messages_pb2.CommandExpired(
                command_id=row["command_id"], execution_id=row["execution_id"], attempt=row["attempt"],
                reason=f"claim lease expired (worker {row['worker_id'] or '-'} lost)"))
            await natsio.publish(self.js, natsio.events_subject(self.shard, natsio.KIND_EXPIRED),
                                 msg.SerializeToString(), msg_id=vocab.expired_msg_id(row["command_id"], row["attempt"]))
            REAPED.labels("lease_expired").inc()
        window = int(time.time() // max(self.cfg.republish_after_sec, 1))
        for row in stale:
            notice = messages_pb2.CommandNotice(command_id=row["command_id"], execution_id=row["execution_id"],
                                                shard_id=self.shard, attempt=row["attempt"], kind=row["kind"])
            # the execution's trace goes on with the republished notice (docs/DEPLOY.md "Tracing")
            await natsio.publish(self.js, natsio.commands_subject(row["pool"], row["priority"], self.shard),
                                 notice.SerializeToString(),
                                 msg_id=vocab.republish_msg_id(row["command_id"], row["attempt"], window),
                                 trace_parent=tracing.context_from(row["traceparent"]))
            REAPED.labels("republished").inc()
        if expired or stale:
            logger.info("reaper shard %s: %s expired lease(s) reported, %s queued command(s) republished",
                        self.shard, len(expired), len(stale))
        return len(expired), len(stale)
