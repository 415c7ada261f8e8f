"""The checkpointer process (work loop still minimal: it holds its shard leases)."""

from __future__ import annotations

from noetl_common.config import CheckpointSettings, CoreSettings, ShardSettings
from noetl_common.service import Service


class CheckpointerService(Service):
    role = "checkpointer"
    sharded = True

    def __init__(self, core: CoreSettings, shard: ShardSettings, settings: CheckpointSettings) -> None:
        core.require("postgres_dsn", "shard_manager_target")
        super().__init__(core, shard)
        self.settings = settings
