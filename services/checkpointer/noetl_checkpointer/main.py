"""Entry point of the checkpointer role: ``python -m noetl_checkpointer``."""

from __future__ import annotations

from noetl_common.config import CheckpointSettings, CoreSettings, ShardSettings, load
from noetl_common.service import run_service

from .service import CheckpointerService


def main() -> int:
    return run_service(lambda: CheckpointerService(load(CoreSettings), load(ShardSettings), load(CheckpointSettings)))
