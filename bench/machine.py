"""What the machine is, and what its processes use, read from /proc.

``machine_facts()`` names the CPU, cores and memory for the report. ``ProcSampler``
samples, every ``interval`` seconds on a thread, the resident memory (VmRSS) and CPU
time of named process trees (a role process and all its descendants: the worker's
python children count as the worker's) and the whole machine's CPU use, so a figure
can be read beside who was using the CPU at the time (other users of the machine too).
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_facts() -> dict[str, Any]:
    cpuinfo = _read("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    mhz = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("cpu MHz")), "")
    mem_kb = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                   if line.startswith("MemTotal:")), 0)
    facts: dict[str, Any] = {
        "cpu_model": model, "cpu_mhz": mhz, "cores": os.cpu_count() or 0,
        "ram_gib": round(mem_kb / 1024 / 1024, 1), "kernel": platform.release(),
        "python": platform.python_version(), "loadavg_at_start": _read("/proc/loadavg").split()[:3],
    }
    try:
        facts["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                      timeout=5, check=False).stdout.strip()
    except OSError:
        facts["git"] = ""
    for tool, args in (("postgres", ["pg_ctl", "--version"]),):
        try:
            facts[tool] = subprocess.run(args, capture_output=True, text=True, timeout=5,
                                         check=False).stdout.strip()
        except OSError:
            facts[tool] = ""
    return facts


def short_machine(facts: Mapping[str, Any]) -> str:
    model = str(facts.get("cpu_model", "")).replace("(R)", "").replace("(TM)", "").replace("Processor", "").strip()
    return f"{model}, {facts.get('cores')} cores, {facts.get('ram_gib')} GiB"


# ---------------------------------------------------------------- /proc readers


def _stat_fields(pid: int) -> list[str] | None:
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    return text.rsplit(")", 1)[1].split()


def cpu_ticks(pid: int) -> int:
    """utime + stime of one process (clock ticks); 0 when it is gone."""
    f = _stat_fields(pid)
    return int(f[11]) + int(f[12]) if f else 0


def rss_kb(pid: int) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pss_kb(pid: int) -> int:
    """Proportional set size: shared pages divided among the processes sharing them (for
    Postgres, whose backends all map the shared buffers)."""
    for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return rss_kb(pid)


def children_map() -> dict[int, list[int]]:
    """ppid -> [pid] for every live process."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        f = _stat_fields(int(entry.name))
        if f and f[0] != "Z":
            out.setdefault(int(f[1]), []).append(int(entry.name))
    return out


def tree(pid: int, kids: Mapping[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    parts = _read("/proc/stat").splitlines()[0].split()[1:]
    vals = [int(v) for v in parts[:8]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


# ---------------------------------------------------------------- sampler


@dataclass
class TreeUsage:
    peak_rss_kb: int = 0          # max over samples of the tree's summed VmRSS
    peak_main_rss_kb: int = 0     # max over samples of the root process's own VmRSS
    cpu_s: float = 0.0            # CPU seconds used by the tree during the window
    samples: int = 0


@dataclass
class ProcSampler:
    """Samples the process trees ``roots()`` names (label -> root pids) until stopped."""

    roots: Callable[[], Mapping[str, list[int]]]
    interval: float = 0.5
    flat: frozenset[str] = frozenset()  # labels whose pids count alone (not their descendants)
    proportional: frozenset[str] = frozenset({"postgres"})  # labels measured by PSS, not VmRSS
    usage: dict[str, TreeUsage] = field(default_factory=dict)
    rss_series: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _last_ticks: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    started: float = 0.0
    elapsed: float = 0.0
    machine_busy_s: float = 0.0
    machine_total_s: float = 0.0

    def __enter__(self) -> ProcSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.started = time.monotonic()
        self._m0 = machine_cpu_ticks()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="proc-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._thread = None
        self._sample()
        self.elapsed = time.monotonic() - self.started
        busy1, total1 = machine_cpu_ticks()
        ncpu = os.cpu_count() or 1
        # jiffies summed over CPUs: per-CPU seconds
        self.machine_busy_s = (busy1 - self._m0[0]) / CLK_TCK
        self.machine_total_s = (total1 - self._m0[1]) / CLK_TCK or self.elapsed * ncpu

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._sample()
            except Exception:  # a process vanishing mid-read must not stop the sampler
                continue

    def _sample(self) -> None:
        kids = children_map()
        point: dict[str, int] = {}
        for label, pids in self.roots().items():
            u = self.usage.setdefault(label, TreeUsage())
            total = 0
            main = 0
            for root in pids:
                for p in ([root] if label in self.flat else tree(root, kids)):
                    r = pss_kb(p) if label in self.proportional else rss_kb(p)
                    total += r
                    if p == root:
                        main = max(main, r)
                    t = cpu_ticks(p)
                    if t:
                        prev = self._last_ticks.get(p)
                        if prev is not None and t >= prev:
                            u.cpu_s += (t - prev) / CLK_TCK
                        self._last_ticks[p] = t
            u.peak_rss_kb = max(u.peak_rss_kb, total)
            u.peak_main_rss_kb = max(u.peak_main_rss_kb, main)
            u.samples += 1
            point[label] = total
        self.rss_series.append((time.monotonic() - self.started if self.started else 0.0, point))

    def summary(self) -> dict[str, Any]:
        """Per tree: peak RSS (MiB) and CPU use (cores = CPU seconds / wall); the machine's
        CPU use, and the part of it used by processes outside the sampled trees."""
        wall = self.elapsed or (time.monotonic() - self.started)
        ours = sum(u.cpu_s for u in self.usage.values())
        ncpu = os.cpu_count() or 1
        return {
            "wall_s": round(wall, 3),
            "trees": {k: {"peak_rss_mib": round(u.peak_rss_kb / 1024, 1),
                          "peak_main_rss_mib": round(u.peak_main_rss_kb / 1024, 1),
                          "cpu_s": round(u.cpu_s, 2),
                          "cores": round(u.cpu_s / wall, 2) if wall else 0.0}
                      for k, u in self.usage.items()},
            "machine_cores_busy": round(self.machine_busy_s / wall, 2) if wall else 0.0,
            "machine_cores": ncpu,
            "others_cores_busy": round(max(0.0, self.machine_busy_s - ours) / wall, 2) if wall else 0.0,
        }
