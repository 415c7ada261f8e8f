"""The projector process."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from noetl_common import natsio
from noetl_common.config import CoreSettings, ProjectionSettings, ShardSettings
from noetl_common.service import Service
from noetl_common.shardtasks import ShardTasks

from .worker import ShardProjector


class ProjectorService(Service):
    role = "projector"
    sharded = True

    def __init__(self, core: CoreSettings, shard: ShardSettings, projection: ProjectionSettings) -> None:
        core.require("postgres_dsn", "nats_url", "shard_manager_target")
        super().__init__(core, shard)
        self.projection = projection
        self.nc: NATS | None = None
        self.tasks = ShardTasks("projector", self._make)

    def _make(self, shard: int, epoch: int) -> ShardProjector:
        assert self.pool is not None and self.nc is not None and self.ownership is not None
        return ShardProjector(self.pool, self.nc, self.ownership, shard, epoch,
                              batch_size=self.projection.batch_size,
                              poll_sec=max(self.projection.poll_ms / 1000, 1.0))

    async def on_start(self) -> None:
        self.nc = await natsio.connect(self.core.nats_url, name=self.core.instance)

    async def on_shards(self, gained: dict[int, int], lost: set[int]) -> None:
        await self.tasks.apply(gained, lost)

    async def on_stop(self) -> None:
        await self.tasks.stop_all()
        if self.nc is not None:
            await self.nc.drain()
