"""The compactor process: retention per held shard, event partitions for everyone.

* Per compactor shard lease (``ShardedService``): when ``NOETL_COMPACTOR_ENABLED``,
  finished executions older than ``NOETL_RETENTION_DAYS`` become manifests and their
  events are deleted (``worker.ShardCompactor``).
* Partitions (global, serialised in Postgres by an advisory lock, so any number of
  replicas may run it): daily event partitions are created days ahead of need and, when
  retention is enabled, expired empty ones are dropped (``partitions``).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from noetl_common.config import CompactorSettings, CoreSettings, ShardSettings
from noetl_common.db import ensure_event_partitions
from noetl_common.errors import NoetlError
from noetl_common.shardtasks import ShardedService

from .metrics import PARTITIONS
from .partitions import drop_expired_partitions
from .worker import ShardCompactor

logger = logging.getLogger(__name__)

PARTITION_CHECK_SEC = 600.0


class CompactorService(ShardedService):
    role = "compactor"
    uses_nats = False

    def __init__(self, core: CoreSettings, shard: ShardSettings, settings: CompactorSettings) -> None:
        core.require("postgres_dsn", "shard_manager_target")
        self.settings = settings
        super().__init__(core, shard)

    @property
    def retention_sec(self) -> float:
        return self.settings.retention_days * 86_400

    def make_shard_worker(self, shard: int, epoch: int) -> ShardCompactor:
        assert self.pool is not None and self.ownership is not None
        s = self.settings
        return ShardCompactor(self.pool, self.ownership, shard, epoch, enabled=s.compactor_enabled,
                              retention_sec=self.retention_sec, interval_sec=s.compactor_interval_sec,
                              batch_executions=s.compactor_batch_executions, batch_events=s.compactor_batch_events)

    async def on_serving(self) -> None:
        if self.settings.compactor_enabled:
            logger.info("retention enabled: executions older than %g day(s) are compacted",
                        self.settings.retention_days)
        self.spawn(self._partitions_loop(), "partitions")

    async def _partitions_loop(self) -> None:
        assert self.pool is not None
        every = PARTITION_CHECK_SEC
        if self.settings.compactor_enabled:
            every = min(every, self.settings.compactor_interval_sec)
        while not self.stopping:
            today = datetime.now(UTC).date()
            first = today - timedelta(days=1)
            try:
                await ensure_event_partitions(self.pool, first, self.settings.partitions_ahead_days + 2)
                if self.settings.compactor_enabled:
                    horizon = datetime.now(UTC) - timedelta(seconds=self.retention_sec)
                    dropped = await drop_expired_partitions(self.pool, horizon=horizon, keep_from=first)
                    PARTITIONS.inc(len(dropped))
            except NoetlError as exc:
                logger.warning("partition maintenance failed: %s", exc)
            if await self.sleep(every):
                return
