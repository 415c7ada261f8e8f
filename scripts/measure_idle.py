"""What a local stack costs doing nothing: CPU per process (share of one core), each
role's Postgres backends counted beside it (``<role>_login``).

    .venv/bin/python scripts/measure_idle.py [--settle 40] [--seconds 20] [--scale ROLE=N,...]

Starts ``noetl-rt dev up`` in a throwaway home, waits ``--settle`` seconds (members
heartbeat fast for one lease period after joining), reads every process's utime + stime
from ``/proc/<pid>/stat`` before and after ``--seconds``, and tears the stack down. Linux
only. The measure behind docs/PERFORMANCE.md "An idle stack"; compare two builds by
running it from each, interleaved.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLE = re.compile(r"noetl_(\w+)")


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat(pid: str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _environ_has(pid: str, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _processes(home: str) -> dict[str, tuple[str, int]]:
    """pid -> (name, utime + stime ticks) of the stack's processes under ``home``."""
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    postmasters = {p for p in pids if home in _cmdline(p) and "postgres" in _cmdline(p)}
    out: dict[str, tuple[str, int]] = {}
    for pid in pids:
        stat = _stat(pid)
        if stat is None:
            continue
        cmd = _cmdline(pid)
        backend = stat[1] in postmasters  # a Postgres backend: its title names the role's login
        if not (backend or home in cmd or _environ_has(pid, home.encode())):
            continue
        found = ROLE.search(cmd)
        if found:
            name = found.group(1)
        elif backend or "postgres" in cmd:
            name = "postgres"
        elif "nats" in cmd:
            name = "nats"
        else:
            continue
        out[pid] = (name, int(stat[11]) + int(stat[12]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settle", type=float, default=40.0, help="seconds between up and the sample")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the sample")
    ap.add_argument("--scale", default="", help="replicas per role, as for noetl-rt dev up")
    args = ap.parse_args()
    cli = str(Path(sys.executable).with_name("noetl-rt"))
    with tempfile.TemporaryDirectory(prefix="noetl-idle-") as home:
        up = [cli, "dev", "up", "--home", home, "--detach", *(["--scale", args.scale] if args.scale else [])]
        started = subprocess.run(up, check=False, capture_output=True, text=True)
        if started.returncode != 0:
            print(started.stderr, file=sys.stderr)
            return 1
        try:
            time.sleep(args.settle)
            before, t0 = _processes(home), time.monotonic()
            time.sleep(args.seconds)
            after, elapsed = _processes(home), time.monotonic() - t0
        finally:
            subprocess.run([cli, "dev", "down", "--home", home], check=False, capture_output=True)
    hz = os.sysconf("SC_CLK_TCK")
    share: dict[str, float] = {}
    for pid, (name, ticks) in after.items():
        if pid in before:
            share[name] = share.get(name, 0.0) + (ticks - before[pid][1]) / hz / elapsed
    print(f"whole stack: {100 * sum(share.values()):.1f}% of one core over {elapsed:.0f} s")
    for name, value in sorted(share.items(), key=lambda kv: -kv[1]):
        if value >= 0.0005:
            print(f"  {name:<22} {100 * value:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
