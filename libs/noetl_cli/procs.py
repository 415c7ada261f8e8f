"""Is a recorded process still the one we started? (pid and start time; no imports beyond
the standard library: the CLI's client commands check the local stack with these)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as dead.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            return False
    return True


def start_ticks(pid: int) -> int:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); 0 if unknown.
    Recorded with a pid so a pid reused after the process died is not mistaken for it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])


def same_process(pid: int, started: int = 0) -> bool:
    """``pid`` is alive and, when its start time was recorded, is still that process."""
    if not pid_alive(pid):
        return False
    return not started or start_ticks(pid) in (0, started)
