"""Entry point of the compactor role: ``python -m noetl_compactor``."""

from __future__ import annotations

from noetl_common.config import CompactorSettings, CoreSettings, ShardSettings, load
from noetl_common.service import run_service

from .service import CompactorService


def main() -> int:
    return run_service(lambda: CompactorService(load(CoreSettings), load(ShardSettings), load(CompactorSettings)))
