"""``python -m bench`` end to end at the tiniest sizes: it starts its own stack, runs the
raw limits, 3 turnarounds, a 50-item fan-out, the CLI and the PFT flow (2 facilities x 10
patients), exits 0 and writes a report whose rows
hold figures and whose checks passed. (The figures themselves are not judged here.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_bench_quick_tiny_run_reports_verified_rows(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", "--quick", "--only", "limits,turnaround,fanout,cli,pft", "--no-peers",
           "--no-plots", "--set", "limits_seconds=0.2", "--set", "turnaround_runs=3", "--set", "fanout_items=50",
           "--set", "cli_runs=2", "--set", "pft_facilities=2", "--set", "pft_patients=10",
           "--set", "fanout_widths=16", "--out", str(out), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = out.read_text()
    raw = json.loads((results / "bench-quick.json").read_text())
    assert raw["failures"] == [] and raw["duration_s"] > 0
    for name in ("limits", "turnaround", "fanout", "cli", "pft"):
        assert raw["scenarios"][name]["ok"], raw["scenarios"][name]
    assert "**The run took " in doc
    rows = {line.split(" | ")[0].lstrip("| ") + " | " + line.split(" | ")[1]: line.split(" | ")[2]
            for line in doc.splitlines() if line.startswith("| ") and line.count(" | ") >= 3}
    # each row has a figure, not "failed: ..." / "not run"
    for key in ("step turnaround (3 steps, one at a time; WatchExecution) | p50 ms",
                "fan-out 50 items, max_in_flight 16 | iterations/s",
                "raw limit: Postgres single-row commits (psycopg) | per s, 1 / 8 connections",
                "CLI: `noetl-rt status ID`, whole process (2 runs in a row) | p50 / p95 ms (CPU p50 ms)",
                "PFT flow 2 facilities x 10 patients x 6 data types (batches of 10, 8 slots) | "
                "patients/s (rows/s, http requests/s)"):
        assert key in rows, sorted(rows)
        assert rows[key][:1].isdigit(), (key, rows[key])
    # the checks each scenario made before reporting
    assert "- **turnaround**: all 3 COMPLETED; every run's c == 2 * (seed + 1)" in doc
    assert "- **fanout**: width 16: COMPLETED; 50 loop_result rows, distinct indexes, all ok; sum of results = " \
           "2,450; one accepted call.done per command" in doc
    assert "- **limits**: " in doc and "rows == commits" in doc
    assert "- **cli**: all 2 runs exited 0 and printed `execution " in doc
    assert "- **pft**: COMPLETED; 172 page rows (4 paged types: every page of every patient, " in doc
    assert "**PFT flow** (2 facilities x 10 patients = 20 patients x 6 data types" in doc
    # the envelope size over the loop run: one envelope per published result (a command:
    # one iteration or a batch of them, so at most 50), a Targets line
    assert "event result p99 < 2,048 bytes under the loop benchmarks" in doc
    envelopes = re.search(r"over (\d+) envelopes", doc)
    assert envelopes is not None and 1 <= int(envelopes.group(1)) <= 50, doc
