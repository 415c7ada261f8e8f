"""Backpressure: SubmitExecution answers RESOURCE_EXHAUSTED with a retry hint when the
system is saturated, instead of queueing without bound.

Saturation is measured from Postgres (so every api replica sees the same picture) and
cached for ``refresh_sec``: executions running or committed-but-not-started, and
commands queued for workers. The gauges (``noetl_active_executions``,
``noetl_queued_commands``) show the last measurement; the api also measures every
``GAUGE_REFRESH_SEC`` without submissions (``measure``), so they never go stale.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter, Gauge

from noetl_common.db import Pool
from noetl_common.errors import Overloaded
from noetl_common.ids import snowflake_at
from noetl_common.vocab import CommandStatus, EngineStatus

logger = logging.getLogger(__name__)

ACTIVE = Gauge("noetl_active_executions", "Executions running or waiting to start (admission view)")
QUEUED = Gauge("noetl_queued_commands", "Commands queued for workers (admission view)")
REJECTED = Counter("noetl_submissions_rejected_total", "Submissions refused by admission control", ["reason"])
GAUGE_REFRESH_SEC = 5.0


class Admission:
    def __init__(self, pool: Pool, *, max_active: int, max_queued: int, refresh_sec: float = 1.0) -> None:
        self._pool = pool
        self.max_active = max_active
        self.max_queued = max_queued
        self._refresh = refresh_sec
        self._at = 0.0
        self._active = 0
        self._queued = 0
        self._lock = asyncio.Lock()

    async def check(self) -> None:
        """Raise Overloaded (RESOURCE_EXHAUSTED) with a retry hint when saturated."""
        await self._update()
        if self._active >= self.max_active:
            REJECTED.labels("active_executions").inc()
            raise Overloaded(f"system saturated: {self._active} executions active (limit {self.max_active}); "
                             f"retry after {self._hint(self._active, self.max_active):.1f}s",
                             retry_after=self._hint(self._active, self.max_active))
        if self._queued >= self.max_queued:
            REJECTED.labels("queued_commands").inc()
            raise Overloaded(f"system saturated: {self._queued} commands queued for workers (limit "
                             f"{self.max_queued}); retry after {self._hint(self._queued, self.max_queued):.1f}s",
                             retry_after=self._hint(self._queued, self.max_queued))

    async def measure(self) -> None:
        """Refresh the measurement (and the gauges) unless it is fresher than ``refresh_sec``."""
        await self._update()

    def admitted(self) -> None:
        """Count a submission until the next refresh sees it."""
        self._active += 1

    @staticmethod
    def _hint(value: int, limit: int) -> float:
        return min(30.0, 1.0 + 4.0 * (value - limit + 1) / max(limit, 1))

    async def _update(self) -> None:
        if time.monotonic() - self._at < self._refresh:
            return
        async with self._lock:
            if time.monotonic() - self._at < self._refresh:
                return
            recent = snowflake_at(int((time.time() - 3600) * 1000))
            async with self._pool.connection() as conn:
                cur = await conn.execute(
                    f"SELECT (SELECT count(*) FROM noetl.engine_state WHERE status = '{EngineStatus.RUNNING}') AS running,"
                    " (SELECT count(*) FROM noetl.execution_request r WHERE r.execution_id > %s AND NOT EXISTS"
                    "   (SELECT 1 FROM noetl.engine_state s WHERE s.execution_id = r.execution_id)) AS waiting,"
                    f" (SELECT count(*) FROM noetl.command WHERE status = '{CommandStatus.QUEUED}') AS queued_commands", (recent,))
                row = await cur.fetchone()
                await conn.commit()
            assert row is not None
            self._active = int(row["running"]) + int(row["waiting"])
            self._queued = int(row["queued_commands"])
            self._at = time.monotonic()
            ACTIVE.set(self._active)
            QUEUED.set(self._queued)
