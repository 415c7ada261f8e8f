"""Entry point of the projector role: ``python -m noetl_projector``."""

from __future__ import annotations

from noetl_common.config import CoreSettings, ProjectionSettings, ShardSettings, load
from noetl_common.service import run_service

from .service import ProjectorService


def main() -> int:
    return run_service(lambda: ProjectorService(load(CoreSettings), load(ShardSettings), load(ProjectionSettings)))
