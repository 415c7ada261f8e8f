"""Role processes of the local stack: spawning, ready files, gRPC health, stopping.

Each role replica is one OS process in its own session (so its process group can be
signalled as a whole and a Ctrl-C in the launching terminal does not reach it), with
stdout/stderr in ``<home>/dev/logs/<role>-<i>.log``. A service announces that it
serves by writing its ready file (``noetl_common.service``); the launcher then asks
``grpc.health.v1`` for SERVING.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from noetl_common.errors import NoetlError
from noetl_common.grpcutil import tls_target_name

from .localstack import group_members
from .procs import pid_alive, same_process, start_ticks

logger = logging.getLogger(__name__)

ROLES: tuple[str, ...] = ("shard-manager", "api", "projector", "checkpointer", "compactor", "reaper", "worker")
# Start order: each stage waits for the previous one (its targets go into the next one's env).
STAGES: tuple[tuple[str, ...], ...] = (
    ("shard-manager",),
    ("api",),
    ("projector", "checkpointer", "compactor", "reaper", "worker"),
)

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
UNKNOWN = "UNKNOWN"
UNREACHABLE = "UNREACHABLE"  # the process runs but its health service did not answer
DEAD = "DEAD"

RoleCommand = Callable[[str], Sequence[str]]


def default_role_command(role: str) -> list[str]:
    """``python -m noetl_<role>``, with the interpreter running this launcher."""
    return [sys.executable, "-m", f"noetl_{role.replace('-', '_')}"]


class StackError(NoetlError):
    """A role process failed to come up. ``instance`` names it, ``log_tail`` is the end of its log."""

    def __init__(self, message: str, *, role: str = "", instance: str = "", log: str = "",
                 log_tail: str = "") -> None:
        self.torn_down = False  # set when the stack it was starting was torn down
        self.role = role
        self.instance = instance
        self.log = log
        self.log_tail = log_tail
        super().__init__(message)


def log_tail(path: str | Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def open_channel(address: str, ca_file: str = "") -> grpc.Channel:
    """A blocking channel to ``address``: TLS trusting ``ca_file`` when given, else plaintext."""
    if ca_file:
        name = tls_target_name(address)
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(ca_file).read_bytes()),
                                   options=[("grpc.ssl_target_name_override", name)] if name else None)
    return grpc.insecure_channel(address)


def health_check(address: str, timeout: float = 1.0, ca_file: str = "") -> str:
    """Ask ``grpc.health.v1`` at ``address`` about the server as a whole: the status it
    answers (SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN), UNREACHABLE when it does not."""
    if not address:
        return UNKNOWN
    try:
        with open_channel(address, ca_file) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                         timeout=timeout)
    except grpc.RpcError:
        return UNREACHABLE
    try:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    except ValueError:
        return f"STATUS_{resp.status}"


def target_of(addresses: Sequence[str]) -> str:
    """gRPC target for a role's replicas: one address as is, several as one round-robin target."""
    addrs = [a for a in addresses if a]
    if len(addrs) <= 1:
        return addrs[0] if addrs else ""
    return "ipv4:" + ",".join(addrs)


# ---------------------------------------------------------------- process identity and groups


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(pgids: Iterable[int], timeout: float = 10.0, *, reap: Callable[[], None] | None = None) -> None:
    """SIGTERM each process group, wait up to ``timeout`` for all of them to be gone,
    SIGKILL what is left. Leaves no process of those groups behind."""
    groups = [g for g in set(pgids) if g > 0]

    def remaining() -> list[int]:
        if reap is not None:
            reap()
        return [g for g in groups if group_members(g)]

    live = remaining()
    for g in live:
        _signal_group(g, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = remaining()
    for g in live:
        logger.warning("process group %s did not stop within %.0fs; killing it", g, timeout)
        _signal_group(g, signal.SIGKILL)
    end = time.monotonic() + 5
    while live and time.monotonic() < end:
        time.sleep(0.05)
        live = remaining()


# ---------------------------------------------------------------- one replica


@dataclass
class ServiceProcess:
    """One replica of a role. ``grpc``/``metrics``/``runtime_id`` come from its ready file."""

    role: str
    index: int
    pid: int = 0
    grpc: str = ""
    metrics: str = ""
    # the api's worker API address (its own port)
    worker_grpc: str = ""
    # the CA its gRPC server's certificate is checked against ("" = plaintext)
    ca_file: str = ""
    instance: str = ""
    log: str = ""
    ready_file: str = ""
    runtime_id: int = 0
    command: list[str] = field(default_factory=list)
    started: int = 0
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.instance = self.instance or f"{self.role}-{self.index}"

    # ------------------------------------------------------------ state

    def exit_code(self) -> int | None:
        """The exit code (negative: killed by that signal) when this process was started by
        us and has exited; None while it runs or when it is not our child."""
        if self._popen is not None:
            return self._popen.poll()
        return None

    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return same_process(self.pid, self.started)

    def group_id(self) -> int:
        """The process group to signal, 0 when it cannot be ours any more (the pid was reused
        by another process; a pid is never reused while a group with that id has members)."""
        if self.pid <= 0 or (pid_alive(self.pid) and not same_process(self.pid, self.started)):
            return 0
        return self.pid

    def health(self, timeout: float = 1.0) -> str:
        """What grpc.health.v1 answers (``health_check``), DEAD when the process is gone."""
        if not self.alive():
            return DEAD
        return health_check(self.grpc, timeout, self.ca_file)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log, lines)

    def read_ready_file(self) -> bool:
        """Load grpc/metrics/runtime_id from the ready file; False while it is not there.
        (``spawn`` deletes the file first, so one that exists is this process's.)"""
        try:
            data = json.loads(Path(self.ready_file).read_text())
        except (OSError, ValueError):
            return False
        self.grpc = str(data.get("grpc", ""))
        self.metrics = str(data.get("metrics", ""))
        self.worker_grpc = str(data.get("worker_grpc", ""))
        self.runtime_id = int(data.get("runtime_id") or 0)
        self.instance = str(data.get("instance") or self.instance)
        return True

    # ------------------------------------------------------------ control

    def reap(self) -> None:
        if self._popen is not None:
            self._popen.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the replica's process group (SIGKILL = a crash)."""
        if self.group_id():
            _signal_group(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """Orderly stop: SIGTERM the group, wait up to ``timeout``, SIGKILL."""
        stop_groups([self.group_id()], timeout, reap=self.reap)
        self.reap()

    def forget(self) -> None:
        """Stop tracking the child (it outlives this process by design: ``dev up --detach``)."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.returncode = 0  # keeps Popen.__del__ from warning about a running child
        self._popen = None

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "grpc": self.grpc, "metrics": self.metrics, "worker_grpc": self.worker_grpc,
                "ca_file": self.ca_file,
                "instance": self.instance,
                "log": self.log, "index": self.index, "ready_file": self.ready_file,
                "runtime_id": self.runtime_id, "command": list(self.command), "started": self.started}

    @classmethod
    def from_json(cls, role: str, index: int, data: Mapping[str, Any]) -> ServiceProcess:
        return cls(role=role, index=int(data.get("index", index)), pid=int(data.get("pid") or 0),
                   grpc=str(data.get("grpc", "")), metrics=str(data.get("metrics", "")),
                   worker_grpc=str(data.get("worker_grpc", "")), ca_file=str(data.get("ca_file", "")),
                   instance=str(data.get("instance", "")), log=str(data.get("log", "")),
                   ready_file=str(data.get("ready_file", "")), runtime_id=int(data.get("runtime_id") or 0),
                   command=[str(c) for c in data.get("command") or []], started=int(data.get("started") or 0))


def spawn(proc: ServiceProcess, env: Mapping[str, str], *, append_log: bool = False) -> ServiceProcess:
    """Start ``proc.command`` in a new session with its output in ``proc.log``."""
    Path(proc.ready_file).unlink(missing_ok=True)
    Path(proc.log).parent.mkdir(parents=True, exist_ok=True)
    with open(proc.log, "ab" if append_log else "wb") as out:
        if append_log:
            out.write(f"\n----- restart of {proc.instance} at {time.strftime('%Y-%m-%d %H:%M:%S')} -----\n"
                      .encode())
            out.flush()
        popen = subprocess.Popen(proc.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 env=dict(env), start_new_session=True, close_fds=True)
    proc._popen = popen
    proc.pid = popen.pid
    proc.started = start_ticks(popen.pid)
    proc.grpc = proc.metrics = ""
    proc.runtime_id = 0
    return proc


def describe_exit(code: int | None) -> str:
    """``exited with code 3`` / ``was killed by SIGKILL`` / ``exited`` (code unknown)."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _early_exit(proc: ServiceProcess, waiting_for: str) -> StackError:
    how = describe_exit(proc.exit_code())
    return StackError(f"{proc.instance} {how} before it was {waiting_for} (log: {proc.log})",
                      role=proc.role, instance=proc.instance, log=proc.log, log_tail=proc.log_tail())


def wait_ready(procs: Sequence[ServiceProcess], deadline: float, *, watch: Sequence[ServiceProcess] = (),
               on_ready: Callable[[ServiceProcess], None] | None = None) -> None:
    """Wait (until the monotonic ``deadline``) for each process's ready file. Any of
    ``procs`` or ``watch`` exiting meanwhile is a StackError naming it."""
    pending = list(procs)
    while pending:
        for p in [*pending, *watch]:
            if not p.alive():
                raise _early_exit(p, "ready")
        for p in list(pending):
            if p.read_ready_file():
                pending.remove(p)
                if on_ready is not None:
                    on_ready(p)
        if not pending:
            return
        if time.monotonic() > deadline:
            p = pending[0]
            raise StackError(f"{p.instance} did not become ready in time (log: {p.log})", role=p.role,
                             instance=p.instance, log=p.log, log_tail=p.log_tail())
        time.sleep(0.05)


def wait_serving(procs: Sequence[ServiceProcess], deadline: float,
                 on_serving: Callable[[ServiceProcess], None] | None = None) -> None:
    """Wait until every process answers SERVING on grpc.health.v1."""
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise _early_exit(p, "SERVING")
            if p.health(timeout=max(0.2, min(2.0, deadline - time.monotonic()))) == SERVING:
                pending.remove(p)
                if on_serving is not None:
                    on_serving(p)
        if not pending:
            return
        if time.monotonic() > deadline:
            p = pending[0]
            raise StackError(f"{p.instance} is not SERVING at {p.grpc or '?'} (log: {p.log})", role=p.role,
                             instance=p.instance, log=p.log, log_tail=p.log_tail())
        time.sleep(0.1)
