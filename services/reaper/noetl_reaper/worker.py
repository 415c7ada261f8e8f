"""One shard's reaper loop. It only reads Postgres and publishes to NATS: the engine
decides (re-issue with attempt+1, or dead-letter), so a stale reaper is harmless."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge

from noetl_common import natsio, pools, tracing, vocab
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


class ShardReaper:
    """``hold_expiries()`` true: expired claims are not reported (Postgres was just
    unreachable from here: the workers could not renew either, and get a command lease to
    do so before their claims are judged). Claims are never judged within a command lease
    of the database's own start either (a restart loses everyone's renewals)."""

    def __init__(self, pool: Pool, js: JetStreamContext, shard: int, epoch: int,
                 cfg: CommandSettings, interval: float, hold_expiries: Callable[[], bool] | None = None) -> None:
        self.pool = pool
        self.js = js
        self.shard = shard
        self.epoch = epoch
        self.cfg = cfg
        self.interval = interval
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self.interval)

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
        async with transaction(self.pool) as conn:
            expired: list[Any] = []
            if not self._holding():
                expired = await commands.expired_claims(conn, self.shard, self.cfg.lease_sec)
            stale = await commands.stale_queued(conn, self.shard, self.cfg.republish_after_sec)
            # the default pool is always exported (0 when nothing waits): the alert has a series
            waiting = {pools.DEFAULT_POOL: 0, **await commands.unschedulable(conn, self.shard)}
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
