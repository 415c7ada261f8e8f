"""Entry point of the reaper role: ``python -m noetl_reaper``."""

from __future__ import annotations

from noetl_common.config import CommandSettings, CoreSettings, ScheduleSettings, ShardSettings, load
from noetl_common.service import run_service

from .service import ReaperService


def main() -> int:
    return run_service(lambda: ReaperService(load(CoreSettings), load(ShardSettings), load(CommandSettings),
                                             load(ScheduleSettings)))
