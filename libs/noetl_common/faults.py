"""Fault injection for tests: off unless ``NOETL_FAULTS_FILE`` names a file.

A test writes lines ``<point> <key>`` (e.g. ``engine.loop 3``: the engine loop of shard
3; ``engine.input 123``: any input of execution 123) to that file. The next time a
process passes the named point with that key (``faults.check("engine.loop", 3)``), the
line is consumed and ``InjectedFault`` is raised there, as a bug would raise. A line
ending in `` *`` is never consumed: the point fails every time (a poison). The file is
re-read when it changes, at most every ``READ_EVERY_SEC``; with no file configured a
check is one attribute test.
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
        self._mtime = -1.0
        self._once: set[str] = set()
        self._always: set[str] = set()

    def configure(self, path: str) -> None:
        self.path = path
        if path:
            logger.warning("fault injection is on (NOETL_FAULTS_FILE=%s): for tests only", path)

    def check(self, point: str, key: object = None) -> None:
        if not self.path:
            return
        self._refresh()
        wanted = point if key is None else f"{point} {key}"
        if wanted in self._always or (wanted in self._once and self._consume(wanted)):
            raise InjectedFault(f"injected fault at {wanted}")

    def _refresh(self) -> None:
        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + READ_EVERY_SEC
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._mtime:
                return
            with open(self.path) as fh:
                lines = [line.strip() for line in fh.read().splitlines() if line.strip()]
        except OSError:
            return
        self._mtime = mtime
        self._always = {line[:-2].strip() for line in lines if line.endswith(" *")}
        self._once = {line for line in lines if not line.endswith(" *")}

    def _consume(self, wanted: str) -> bool:
        """Remove one line equal to ``wanted`` from the file (under a lock); True if this
        process took it (another may have been first)."""
        self._once.discard(wanted)
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
