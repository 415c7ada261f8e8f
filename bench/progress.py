"""The progress display: one status line on stderr while a scenario runs.

On a terminal the line is redrawn in place (elapsed time, scenario, done/total, rate,
ETA); elsewhere (CI, a pipe) a line is printed at most every ``every`` seconds. Messages
(``say``) are printed on their own line above the status line.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, stream: TextIO | None = None, every: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.t0 = time.monotonic()
        self.stage = ""
        self.total: int | None = None
        self.done = 0
        self.stage_t0 = self.t0
        self.unit = ""
        self._last_print = 0.0
        self._lock = threading.Lock()
        self._drawn = False

    # ------------------------------------------------------------ messages

    def say(self, text: str) -> None:
        with self._lock:
            self._clear()
            self.stream.write(f"[{_clock(time.monotonic() - self.t0)}] {text}\n")
            self.stream.flush()
            self._draw(force=True)

    def start(self, stage: str, total: int | None = None, unit: str = "") -> None:
        with self._lock:
            self.stage, self.total, self.done, self.unit = stage, total, 0, unit
            self.stage_t0 = time.monotonic()
            self._last_print = 0.0
        self.say(f"{stage} ...")

    def update(self, done: int, total: int | None = None) -> None:
        with self._lock:
            self.done = done
            if total is not None:
                self.total = total
            self._draw()

    def finish(self) -> None:
        with self._lock:
            self._clear()
            self.stage = ""

    # ------------------------------------------------------------ drawing

    def line(self) -> str:
        now = time.monotonic()
        spent = now - self.stage_t0
        text = f"[{_clock(now - self.t0)}] {self.stage}"
        if self.total:
            text += f": {self.done:,}/{self.total:,} {self.unit}".rstrip()
            rate = self.done / spent if spent > 0 else 0.0
            if rate > 0:
                text += f" ({rate:,.0f}/s"
                left = (self.total - self.done) / rate
                text += f", ETA {_clock(left)})" if self.done < self.total else ")"
        elif self.done:
            text += f": {self.done:,} {self.unit}".rstrip()
        return text + f"  [{_clock(spent)}]"

    def _clear(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\r\033[K")
            self._drawn = False

    def _draw(self, force: bool = False) -> None:
        if not self.stage:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + self.line()[: 160])
            self._drawn = True
            self.stream.flush()
        elif force or now - self._last_print >= self.every:
            if not force:
                self.stream.write(self.line() + "\n")
                self.stream.flush()
            self._last_print = now
