"""The projector process."""

from __future__ import annotations

from noetl_common.coalesce import ShardRounds
from noetl_common.config import CoreSettings, ProjectionSettings, ShardSettings
from noetl_common.shardtasks import ShardedService

from .worker import ShardProjector, projection_polls


class ProjectorService(ShardedService):
    role = "projector"

    def __init__(self, core: CoreSettings, shard: ShardSettings, projection: ProjectionSettings) -> None:
        core.require("postgres_dsn", "nats_url", "shard_manager_target")
        self.projection = projection
        self._polls: ShardRounds[int, bool] | None = None  # one read a poll for all held shards
        super().__init__(core, shard)

    def make_shard_worker(self, shard: int, epoch: int) -> ShardProjector:
        assert self.pool is not None and self.nc is not None and self.ownership is not None
        if self._polls is None:
            self._polls = projection_polls(self.pool)
        return ShardProjector(self.pool, self.nc, self.ownership, shard, epoch,
                              batch_size=self.projection.batch_size,
                              poll_sec=max(self.projection.poll_ms / 1000, 1.0), polls=self._polls,
                              window_sec=self.projection.batch_window_ms / 1000)
