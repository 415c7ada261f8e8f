"""The local stack's Postgres and NATS, in place: stopped, killed and started again on
the same data directory / JetStream store and the same port, so the DSN and URL the
role processes were given stay valid and the data is kept.

Each server is recorded in ``state.json`` as its ``to_json()`` plus ``started`` (its
start ticks, so a pid reused after the server died is not mistaken for it). Every
function here takes such a record and returns the new one when it starts a server;
``StackState`` (devstack.py) keeps the records and saves them.

Postgres after a crash (its postmaster SIGKILLed): the children linger for a moment
and a zombie postmaster may keep its pid, so ``localstack.start_postgres`` first waits
for the children and clears the stale lock files (``localstack.clear_after_crash``).
A postmaster found running in the data directory on the recorded port (started by
hand with ``pg_ctl``) is adopted rather than started twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from noetl_common import natsio
from noetl_common.errors import Conflict

from . import localstack, ports
from .supervise import same_process, start_ticks

KILL_WAIT = 10.0


def record(server: localstack.PostgresServer | localstack.NatsServer) -> dict[str, Any]:
    """The state.json record of a server just started."""
    return {**server.to_json(), "started": start_ticks(server.pid)}


def alive(info: Mapping[str, Any]) -> bool:
    """The recorded server process still runs (a zombie or a reused pid does not count)."""
    return same_process(int(info.get("pid") or 0), int(info.get("started") or 0))


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while localstack.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _kill(info: Mapping[str, Any], what: str) -> int:
    """SIGKILL the recorded process; return once it is gone and its port is free."""
    if not alive(info):
        raise Conflict(f"{what} is not running (pid {info.get('pid') or '?'})")
    pid = int(info["pid"])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT
    _wait_gone(pid, KILL_WAIT)
    if info.get("port"):
        ports.wait_port_free(int(info["port"]), max(0.0, deadline - time.monotonic()))
    return pid


# ---------------------------------------------------------------- Postgres


def postgres_server(info: Mapping[str, Any]) -> localstack.PostgresServer:
    fsync = bool(info.get("fsync"))
    return localstack.PostgresServer(datadir=str(info.get("datadir") or ""), port=int(info.get("port") or 0),
                                     bindir=str(info.get("bindir") or ""), pid=int(info.get("pid") or 0),
                                     fsync=fsync, synchronous_commit=bool(info.get("synchronous_commit", fsync)),
                                     ca_file=str(info.get("ca_file") or ""), passfile=str(info.get("passfile") or ""))


def start_postgres(info: Mapping[str, Any]) -> dict[str, Any]:
    """Start the recorded Postgres again: same data directory, port and settings (fsync,
    synchronous_commit).
    Returns its new record once it accepts connections. Raises ``PortTaken`` when
    another process holds the port."""
    old = postgres_server(info)
    if not old.datadir or not old.port:
        raise Conflict("no postgres recorded for this stack (its data directory or port is unknown)")
    running = localstack.postmaster_pid(old.datadir)
    if localstack.is_postgres(running):
        return _adopt(old, running)
    server = localstack.start_postgres(Path(old.datadir).parent, fsync=old.fsync, port=old.port,
                                       synchronous_commit=old.synchronous_commit,
                                       tls_dir=Path(old.ca_file).parent.parent if old.ca_file else None)
    return record(server)


def _adopt(old: localstack.PostgresServer, pid: int) -> dict[str, Any]:
    try:
        port = int(Path(old.datadir, "postmaster.pid").read_text().splitlines()[3])
    except (OSError, ValueError, IndexError):
        port = 0
    if port != old.port:
        raise Conflict(f"a postgres (pid {pid}) runs in {old.datadir} on port {port or '?'}, not on the "
                       f"stack's port {old.port}; stop it (pg_ctl -D {old.datadir} stop)")
    old.pid = pid
    return record(old)


def stop_postgres(info: Mapping[str, Any], mode: str = "fast") -> None:
    """``pg_ctl stop -m MODE`` and wait: ``fast`` (sessions ended, clean shutdown),
    ``immediate`` (no shutdown checkpoint: recovery at the next start) or ``smart``."""
    if mode not in ("smart", "fast", "immediate"):
        raise ValueError(f"pg_ctl stop mode must be smart, fast or immediate, not {mode!r}")
    server = postgres_server(info)
    if server.datadir and server.bindir and localstack.is_postgres(localstack.postmaster_pid(server.datadir)):
        server.stop(mode)
    if alive(info):  # pg_ctl could not stop it (no postmaster.pid?): the process itself
        localstack.stop_pid(server.pid, KILL_WAIT, group=False)


def kill_postgres(info: Mapping[str, Any]) -> int:
    """SIGKILL the postmaster only (its children notice and exit on their own), as a
    crash or the OOM killer would; returns its pid once it is gone."""
    return _kill(info, "postgres")


# ---------------------------------------------------------------- NATS


def start_nats(info: Mapping[str, Any]) -> dict[str, Any]:
    """Start the recorded NATS again (JetStream on): same store directory and port.
    Returns its new record once it accepts clients. A server recorded with a
    configuration file (TLS, users: stacknats.py) is started with it again."""
    store, port = str(info.get("store_dir") or ""), int(info.get("port") or 0)
    if not store or not port:
        raise Conflict("no nats recorded for this stack (its store directory or port is unknown)")
    return record(localstack.start_nats(Path(store).parent, port=port, config=str(info.get("config") or "")))


def stop_nats(info: Mapping[str, Any], timeout: float = 10.0) -> None:
    """SIGTERM (NATS flushes its store and exits), SIGKILL after ``timeout``."""
    if alive(info):
        localstack.stop_pid(int(info["pid"]), timeout)


def kill_nats(info: Mapping[str, Any]) -> int:
    """SIGKILL the NATS server; returns its pid once it is gone."""
    return _kill(info, "nats")


def ensure_streams(url: str, ca_file: str = "") -> None:
    """Create or update the runtime's JetStream streams on the NATS at ``url`` (a user
    allowed to: the stack's admin; TLS trusting ``ca_file``), on a private event loop, so
    it works under a running loop too."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(_ensure_streams(url, ca_file))).result()


async def _ensure_streams(url: str, ca_file: str) -> None:
    # natsio logs a warning when the connection closes; this one closes on purpose.
    # asyncio warns about closing a TLS transport ("returning true from eof_received()").
    nats_log, asyncio_log = logging.getLogger(natsio.__name__), logging.getLogger("asyncio")
    level, asyncio_level = nats_log.level, asyncio_log.level
    nats_log.setLevel(logging.ERROR)
    asyncio_log.setLevel(logging.ERROR)
    try:
        nc = await natsio.connect(url, name="noetl-rt-dev", ca_file=ca_file)
        try:
            await natsio.ensure_streams(nc.jetstream())
        finally:
            await nc.drain()
    finally:
        nats_log.setLevel(level)
        asyncio_log.setLevel(asyncio_level)
