"""Entry point of the shard-manager role: ``python -m noetl_shard_manager``."""

from __future__ import annotations

from noetl_common.config import CoreSettings, ShardSettings, load
from noetl_common.service import run_service

from .service import ShardManagerService


def main() -> int:
    return run_service(lambda: ShardManagerService(load(CoreSettings), load(ShardSettings)))
