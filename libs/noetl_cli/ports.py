"""Loopback ports of the local stack's servers: whether one is free, waiting for it to be,
and which process holds it (from /proc) when a server cannot get its port back."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

from noetl_common.errors import Conflict

__all__ = ["PortTaken", "check_port_free", "port_free", "port_holder", "wait_port_free"]


class PortTaken(Conflict):
    """A server cannot get back its recorded port: another process listens on it."""

    def __init__(self, what: str, port: int, holder: str) -> None:
        self.what = what
        self.port = port
        self.holder = holder
        super().__init__(f"cannot start {what} on its port {port}: the port is taken by {holder}")


def port_free(port: int) -> bool:
    """127.0.0.1:``port`` can be bound (with SO_REUSEADDR, as the servers bind: TIME_WAIT
    leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_port_free(port: int, timeout: float) -> bool:
    """Poll until ``port_free(port)`` or ``timeout`` seconds passed. A killed process
    can hold its sockets a moment after it looks dead: a multi-threaded one shows as a
    zombie while its other threads are still exiting."""
    deadline = time.monotonic() + timeout
    while not port_free(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def check_port_free(port: int, what: str, grace: float = 2.0) -> None:
    """Raise ``PortTaken`` (naming the process that holds it) when 127.0.0.1:``port``
    is still taken after ``grace`` seconds."""
    if not wait_port_free(port, grace):
        raise PortTaken(what, port, port_holder(port))


def port_holder(port: int) -> str:
    """``pid N (command line)`` of the process with a TCP socket on local ``port``
    (a listener first), from /proc; ``another process`` when it cannot be seen."""
    listening: set[str] = set()
    other: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or int(fields[1].rsplit(":", 1)[1], 16) != port:
                continue
            (listening if fields[3] == "0A" else other).add(fields[9])
    for inodes in (listening, other):
        wanted = {f"socket:[{i}]" for i in inodes if i != "0"}
        if not wanted:
            continue
        with os.scandir("/proc") as entries:
            pids = [e.name for e in entries if e.name.isdigit()]
        for pid in pids:
            if _has_socket(pid, wanted):
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                        "utf-8", "replace").strip()
                    return f"pid {pid} ({cmd[:120] or '?'})"
                return f"pid {pid}"
    return "another process"


def _has_socket(pid: str, wanted: set[str]) -> bool:
    try:
        with os.scandir(f"/proc/{pid}/fd") as fds:
            for fd in fds:
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in wanted:
                        return True
    except OSError:
        pass
    return False
