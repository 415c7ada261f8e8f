"""Entry point of the api role: ``python -m noetl_api`` / ``noetl-api``."""

from __future__ import annotations

from noetl_common.config import CommandSettings, CoreSettings, ExecutionSettings, ShardSettings, load
from noetl_common.service import run_service

from .service import ApiService


def main() -> int:
    return run_service(lambda: ApiService(load(CoreSettings), load(ShardSettings), load(CommandSettings),
                                          load(ExecutionSettings)))
