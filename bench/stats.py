"""Percentiles and small helpers shared by the scenarios and the peers' reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p95_ms": round(percentile(ms, 95), 2),
            "p99_ms": round(percentile(ms, 99), 2), "min_ms": round(min(ms), 2) if ms else math.nan,
            "max_ms": round(max(ms), 2) if ms else math.nan}


def histogram_sum(histograms: Sequence[dict[str, float]]) -> dict[str, float]:
    """Add Prometheus histograms ({le: cumulative count, "count", "sum"}) together."""
    out: dict[str, float] = {}
    for h in histograms:
        for k, v in h.items():
            out[k] = out.get(k, 0.0) + v
    return out


def histogram_bound(hist: dict[str, float], q: float) -> float | None:
    """The upper bound of the bucket holding the q-quantile (0..1) of a Prometheus
    histogram ({le: cumulative count}): the quantile is at most this (math.inf when it
    falls in the +Inf bucket); None without observations."""
    buckets = sorted((math.inf if le == "+Inf" else float(le), n) for le, n in hist.items()
                     if le not in ("count", "sum"))
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    for bound, n in buckets:
        if n >= rank:
            return bound
    return math.inf
