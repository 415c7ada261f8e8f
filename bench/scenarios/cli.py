"""A one-RPC CLI command, whole process: ``noetl-rt status ID`` run N times in a row against
the bench stack (its api, admin token and CA, as a user's shell would give them), after
one completed 3-step execution. The time is the process's wall time from start to exit
(interpreter start, imports, the TLS channel, one GetExecution, printing); CPU is the
child's user + system time. Checked: every run exited 0 and printed the execution's
COMPLETED status line. Target (issue 16): <= 150 ms.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..playbooks import THREE_STEPS
from ..stack import BenchError
from ..stats import summary_ms
from .common import Ctx

WARMUP = 2


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "noetl-rt"
    return [str(script)] if script.exists() else [sys.executable, "-m", "noetl_cli"]


def run(ctx: Ctx) -> dict[str, Any]:
    stack, n = ctx.stack, ctx.plan.cli_runs
    ctx.progress.start(f"cli: `noetl-rt status ID` {n} times (whole process)", n, "runs")
    eid = stack.submit(THREE_STEPS, {"seed": 3})
    done = stack.watch(eid, time.monotonic() + 60)
    if done is None or done.status != "COMPLETED":
        raise BenchError(f"the execution for the cli runs did not complete: {done}")
    st = stack.st
    # a user's shell: bytecode is written on the warm-up runs and read after (this machine's
    # PYTHONDONTWRITEBYTECODE would make every run compile what changed since the install)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
           "NOETL_API": st.api, "NOETL_TOKEN": st.tokens.get("admin", ""), "NOETL_TLS_CA_FILE": st.ca_file}
    cmd = [*_cli(), "status", str(eid)]
    walls: list[float] = []
    cpus: list[float] = []
    for i in range(WARMUP + n):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode != 0 or f"execution {eid} COMPLETED" not in out.stdout:
            raise BenchError(f"`noetl-rt status` run {i} exited {out.returncode}: {(out.stderr or out.stdout)[-300:]}")
        if i >= WARMUP:
            walls.append(wall)
            cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
            ctx.progress.update(i + 1 - WARMUP)
    ctx.progress.finish()
    return {"ok": True, "runs": n, "wall_ms": summary_ms(walls), "cpu_ms_median": statistics.median(cpus) * 1000,
            "command": "noetl-rt status ID",
            "check": f"all {n} runs exited 0 and printed `execution {eid} COMPLETED`"}
