"""Logging setup: one line per record, structured fields appended as key=value."""

from __future__ import annotations

import logging
import sys


class _Formatter(logging.Formatter):
    FIELDS = ("execution_id", "shard", "command_id", "step", "role")

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = [f"{k}={getattr(record, k)}" for k in self.FIELDS if hasattr(record, k)]
        return f"{base} {' '.join(extras)}" if extras else base


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "httpx", "httpcore", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
