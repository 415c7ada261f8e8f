"""The worker's Prometheus metrics (registered once per process)."""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

M = TypeVar("M")


def _metric(cls: type[M], name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> M:
    """Create a metric, or return the one already registered under ``name`` (another
    package in the same process, e.g. the engine in tests, may declare it too)."""
    existing = getattr(REGISTRY, "_names_to_collectors", {}).get(name)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    return cls(name, doc, labels, **kw)  # type: ignore[call-arg]


BUSY = _metric(Gauge, "noetl_worker_busy", "Commands this worker is running now")
CONCURRENCY = _metric(Gauge, "noetl_worker_concurrency", "Command slots of this worker (NOETL_WORKER_CONCURRENCY)")
COMMANDS = _metric(Counter, "noetl_worker_commands_total", "Commands finished by this worker",
                   ("kind", "status"))
TASK_SECONDS = _metric(Histogram, "noetl_worker_task_seconds", "Task (tool call) duration", ("kind",),
                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
RESULT_BYTES = _metric(Histogram, "noetl_event_result_bytes", "Size of result envelopes published (bytes)",
                       buckets=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536))
CLAIMS = _metric(Counter, "noetl_worker_claims_total", "ClaimCommand outcomes", ("outcome",))
CURSOR_ROWS = _metric(Counter, "noetl_worker_cursor_rows_total", "Rows run by cursor loop slots", ("status",))
CANCEL_HINTS = _metric(Counter, "noetl_worker_cancel_hints_total", "Commands stopped by a cancel hint")
RESULTS_REPUBLISHED = _metric(Counter, "noetl_worker_results_republished_total",
                              "Results published again because the events stream lost them (NATS restart)")
