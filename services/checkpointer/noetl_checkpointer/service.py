"""The checkpointer process: epoch barriers per held shard (the ticks' first read made once
for all of them, ``worker.seal_rounds``)."""

from __future__ import annotations

from typing import Any

from noetl_common.coalesce import ShardRounds
from noetl_common.config import CheckpointSettings, CoreSettings, ShardSettings
from noetl_common.ids import SnowflakeGenerator
from noetl_common.shardtasks import ShardedService

from .worker import ShardCheckpointer, seal_rounds


class CheckpointerService(ShardedService):
    role = "checkpointer"

    def __init__(self, core: CoreSettings, shard: ShardSettings, settings: CheckpointSettings) -> None:
        core.require("postgres_dsn", "nats_url", "shard_manager_target")
        self.settings = settings
        self.ids: SnowflakeGenerator | None = None
        self._states: ShardRounds[int, dict[str, Any] | None] | None = None  # one read a tick for all held shards
        super().__init__(core, shard)

    def make_shard_worker(self, shard: int, epoch: int) -> ShardCheckpointer:
        assert self.pool is not None and self.nc is not None and self.ownership is not None
        if self.ids is None or self.ids.node_id != self.node_id:
            self.ids = SnowflakeGenerator(self.node_id)  # one per process: epochs are unique per node
        if self._states is None:
            self._states = seal_rounds(self.pool)
        return ShardCheckpointer(self.pool, self.nc.jetstream(), self.ownership, self.ids,
                                 shard, epoch, interval_sec=self.settings.interval_ms / 1000, nc=self.nc,
                                 states=self._states)
