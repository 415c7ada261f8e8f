"""Shared by the peer scripts (which run in the peers' virtualenvs, not the project's)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="results JSON (rewritten after every scenario)")
    ap.add_argument("--progress", required=True, help="progress file: 'stage|done|total'")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--widths", default="16,64")
    ap.add_argument("--warmup", type=int, default=3)
    return ap.parse_args()


def percentile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def summary_ms(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p95_ms": round(percentile(ms, 95), 2),
            "p99_ms": round(percentile(ms, 99), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2),
            "latencies_ms": [round(x, 2) for x in ms]}


class Out:
    """The results document, written atomically after each change."""

    def __init__(self, path: str, progress: str) -> None:
        self.path = path
        self.progress_path = progress
        self.doc: dict[str, Any] = {"ok": False, "fanout": {}}

    def set(self, key: str, value: Any) -> None:
        self.doc[key] = value
        self.flush()

    def fanout(self, width: int, value: Any) -> None:
        self.doc["fanout"][str(width)] = value
        self.flush()

    def flush(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.doc, fh, indent=2)
        os.replace(tmp, self.path)

    def progress(self, stage: str, done: int = 0, total: int = 0) -> None:
        tmp = self.progress_path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(f"{stage}|{done}|{total}")
        os.replace(tmp, self.progress_path)
