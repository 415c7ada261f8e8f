"""The compactor process: keeps event partitions ahead of need.

It holds compactor shard leases (retention work will be split by shard); partition
maintenance is global and serialised in Postgres by an advisory lock, so any number
of replicas may run it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from noetl_common.config import CompactorSettings, CoreSettings, ShardSettings
from noetl_common.db import ensure_event_partitions
from noetl_common.errors import NoetlError
from noetl_common.service import Service

logger = logging.getLogger(__name__)


class CompactorService(Service):
    role = "compactor"
    sharded = True

    def __init__(self, core: CoreSettings, shard: ShardSettings, settings: CompactorSettings) -> None:
        core.require("postgres_dsn", "shard_manager_target")
        super().__init__(core, shard)
        self.settings = settings

    async def on_serving(self) -> None:
        self.spawn(self._partitions_loop(), "partitions")

    async def _partitions_loop(self) -> None:
        assert self.pool is not None
        while not self.stopping:
            try:
                today = datetime.now(UTC).date()
                await ensure_event_partitions(self.pool, today - timedelta(days=1),
                                              self.settings.partitions_ahead_days + 2)
            except NoetlError as exc:
                logger.warning("partition maintenance failed: %s", exc)
            if await self.sleep(600):
                return
