"""The reaper process: per held reaper shard, the reaper loop (``worker.ShardReaper``; all
the loops' reads are made in one transaction a round, ``worker.ReapRounds``) and the
scheduler loop (``scheduler.ShardScheduler``: the shard's schedules), each supervised by
its own ``ShardTasks``."""

from __future__ import annotations

from typing import Any

from noetl_common.config import CommandSettings, CoreSettings, ScheduleSettings, ShardSettings
from noetl_common.shardtasks import ShardedService, ShardTasks, shard_health
from noetl_db.schedules import ScheduleStore
from noetl_proto.v1 import execution_pb2_grpc

from .scheduler import ScheduleRounds, ShardScheduler
from .worker import ReapRounds, ShardReaper, renewal_grace


class ReaperService(ShardedService):
    role = "reaper"

    def __init__(self, core: CoreSettings, shard: ShardSettings, commands: CommandSettings,
                 schedules: ScheduleSettings | None = None) -> None:
        # the api: scheduled ticks are submitted through its SubmitExecution
        core.require("postgres_dsn", "nats_url", "shard_manager_target", "api_target")
        self.commands = commands
        self.schedules_cfg = schedules or ScheduleSettings.model_construct()
        super().__init__(core, shard)
        self.schedulers = ShardTasks("scheduler", self.make_scheduler, still_held=self._trusted)
        self._api_channel: Any = None
        # one transaction (reaper) and one query each (schedules) a round for all held shards
        self._rounds: ReapRounds | None = None
        self._schedule_rounds: ScheduleRounds | None = None

    def make_shard_worker(self, shard: int, epoch: int) -> ShardReaper:
        assert self.pool is not None and self.nc is not None
        interval = min(1.0, self.commands.lease_sec / 3)
        if self._rounds is None:
            self._rounds = ReapRounds(self.pool, self.commands)
        return ShardReaper(self.pool, self.nc.jetstream(), shard, epoch, self.commands, interval,
                           hold_expiries=lambda: self.postgres_recently_down(renewal_grace(self.commands.lease_sec)),
                           rounds=self._rounds)

    def make_scheduler(self, shard: int, epoch: int) -> ShardScheduler:
        assert self.pool is not None and self.ownership is not None
        if self._api_channel is None:
            self._api_channel = self.channel(self.core.api_target)
        if self._schedule_rounds is None:
            self._schedule_rounds = ScheduleRounds(ScheduleStore(self.pool, shard_count=self.shard_cfg.count))
        return ShardScheduler(self._schedule_rounds.store, execution_pb2_grpc.ExecutionServiceStub(self._api_channel),
                              shard, epoch, self.ownership.runtime_id, self.schedules_cfg, rounds=self._schedule_rounds)

    async def on_shards(self, gained: dict[int, int], lost: set[int]) -> None:
        await super().on_shards(gained, lost)
        await self.schedulers.apply(gained, lost)

    def on_reconciled(self) -> None:
        super().on_reconciled()
        self.schedulers.ensure()

    async def check_health(self) -> list[str]:
        return [*await super().check_health(), *shard_health(self.schedulers, None)]

    async def on_stop(self) -> None:
        await self.schedulers.stop_all()
        await super().on_stop()
        if self._api_channel is not None:
            await self._api_channel.close()
