"""The result store's Prometheus metrics (seed 004 section 12), registered once per process.

    noetl_reference_resolve_seconds{tier}         time to read values of one tier (db, s3,
                                                   loop, kv, process: the in-process cache),
                                                   observed once per read call
    noetl_result_store_writes_total{tier,outcome}  puts (ok / error / too_large: refused by
                                                   the result size limit, nothing written)
    noetl_result_cache_requests_total{cache,outcome}  read-through cache hits / misses / skips
                                                   (cache: kv, process)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Histogram

M = TypeVar("M")


def _metric(cls: type[M], name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> M:
    """Create a metric, or return the one already registered under ``name``."""
    existing = getattr(REGISTRY, "_names_to_collectors", {}).get(name)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    return cls(name, doc, labels, **kw)  # type: ignore[call-arg]


RESOLVE_SECONDS = _metric(Histogram, "noetl_reference_resolve_seconds",
                          "Time to resolve result references, per tier", ("tier",),
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
WRITES = _metric(Counter, "noetl_result_store_writes_total", "Result store puts", ("tier", "outcome"))
CACHE = _metric(Counter, "noetl_result_cache_requests_total", "Read-through cache lookups", ("cache", "outcome"))


@contextmanager
def resolving(tier: str) -> Iterator[None]:
    """Observe the block's duration under ``noetl_reference_resolve_seconds{tier}``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        RESOLVE_SECONDS.labels(tier).observe(time.perf_counter() - start)
