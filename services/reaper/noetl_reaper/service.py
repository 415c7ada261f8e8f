"""The reaper process."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from noetl_common import natsio
from noetl_common.config import CommandSettings, CoreSettings, ShardSettings
from noetl_common.service import Service
from noetl_common.shardtasks import ShardTasks

from .worker import ShardReaper


class ReaperService(Service):
    role = "reaper"
    sharded = True

    def __init__(self, core: CoreSettings, shard: ShardSettings, commands: CommandSettings) -> None:
        core.require("postgres_dsn", "nats_url", "shard_manager_target")
        super().__init__(core, shard)
        self.commands = commands
        self.nc: NATS | None = None
        self.tasks = ShardTasks("reaper", self._make)

    def _make(self, shard: int, epoch: int) -> ShardReaper:
        assert self.pool is not None and self.nc is not None
        interval = min(1.0, self.commands.lease_sec / 3)
        return ShardReaper(self.pool, self.nc.jetstream(), shard, epoch, self.commands, interval)

    async def on_start(self) -> None:
        self.nc = await natsio.connect(self.core.nats_url, name=self.core.instance)

    async def on_shards(self, gained: dict[int, int], lost: set[int]) -> None:
        await self.tasks.apply(gained, lost)

    async def on_stop(self) -> None:
        await self.tasks.stop_all()
        if self.nc is not None:
            await self.nc.drain()
