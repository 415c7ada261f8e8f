"""Fault injection for tests: off unless ``NOETL_FAULTS_FILE`` names a file.

A test writes lines ``<point> <shard>`` (e.g. ``engine.loop 3``) to that file; the next
time a process passes the named point for that shard (``faults.check("engine.loop",
3)``), the line is consumed and ``InjectedFault`` is raised there, as a bug in that
loop would raise. Each line fires once, in one process. With no file configured a
check is one attribute test; with one, the file is read at most every
``READ_EVERY_SEC``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

logger = logging.getLogger(__name__)

READ_EVERY_SEC = 0.1


class InjectedFault(RuntimeError):
    """Raised at an armed fault point (a test asked for it)."""


class _Faults:
    def __init__(self) -> None:
        self.path = ""
        self._next_read = 0.0
        self._mtime = 0.0

    def configure(self, path: str) -> None:
        self.path = path
        if path:
            logger.warning("fault injection is on (NOETL_FAULTS_FILE=%s): for tests only", path)

    def check(self, point: str, shard: int | None = None) -> None:
        if not self.path:
            return
        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + READ_EVERY_SEC
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        if self._consume(f"{point} {shard}" if shard is not None else point):
            raise InjectedFault(f"injected fault at {point}" + (f" (shard {shard})" if shard is not None else ""))
        self._mtime = mtime

    def _consume(self, wanted: str) -> bool:
        """Remove one line equal to ``wanted`` from the file (under a lock); True if found."""
        try:
            with open(self.path, "r+") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                lines = fh.read().splitlines()
                if wanted not in lines:
                    return False
                lines.remove(wanted)
                fh.seek(0)
                fh.truncate()
                fh.write("".join(f"{line}\n" for line in lines))
                return True
        except OSError:
            return False


_FAULTS = _Faults()
configure = _FAULTS.configure
check = _FAULTS.check
