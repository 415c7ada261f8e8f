"""The reaper process."""

from __future__ import annotations

from noetl_common.config import CommandSettings, CoreSettings, ShardSettings
from noetl_common.shardtasks import ShardedService

from .worker import ShardReaper, renewal_grace


class ReaperService(ShardedService):
    role = "reaper"

    def __init__(self, core: CoreSettings, shard: ShardSettings, commands: CommandSettings) -> None:
        core.require("postgres_dsn", "nats_url", "shard_manager_target")
        self.commands = commands
        super().__init__(core, shard)

    def make_shard_worker(self, shard: int, epoch: int) -> ShardReaper:
        assert self.pool is not None and self.nc is not None
        interval = min(1.0, self.commands.lease_sec / 3)
        return ShardReaper(self.pool, self.nc.jetstream(), shard, epoch, self.commands, interval,
                           hold_expiries=lambda: self.postgres_recently_down(renewal_grace(self.commands.lease_sec)))
