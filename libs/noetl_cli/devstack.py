"""The embedded local stack: throwaway Postgres + NATS and every role as its own OS process.

Python API (used by ``noetl-rt dev`` and by the end-to-end tests)::

    state = devstack.up(home, {"api": 2, "worker": 3})   # returns once all are SERVING
    state.api                        # gRPC target of the api replicas
    state.processes("worker")        # [ServiceProcess, ...]
    state.kill("worker", 1)          # crash one replica (SIGKILL to its process group)
    state.restart("worker", 1)       # start it again (same instance name and gRPC port)
    state.kill_postgres()            # crash Postgres (SIGKILL the postmaster); kill_nats() likewise
    state.heal()                     # restart whatever is dead, in place (data, ports kept)
    devstack.up(home)                # on a partly dead stack: the same heal (``noetl-rt dev up``)
    devstack.status(home).to_json()  # health of every recorded process, now
    devstack.down(home)              # stop everything, delete the throwaway data

Postgres and NATS are controlled in place by ``stop_postgres``/``kill_postgres``/
``start_postgres`` and ``stop_nats``/``kill_nats``/``start_nats`` (stackinfra.py): the same
data directory, store and port, so the roles' DSN and URL stay valid. ``up(...,
role_postgres_dsn=...)`` gives the role processes another way to Postgres (a fault
proxy in tests) while ``state.postgres_dsn`` stays the direct one.

Layout under ``<home>/dev``: ``state.json``, ``pg/`` (Postgres), ``nats/`` (JetStream
store), ``run/<role>-<i>.json`` (ready files), ``logs/<role>-<i>.log``. ``down`` deletes
all of it except the logs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noetl_common import db, natsio
from noetl_common.errors import Conflict, InvalidInput, NotFound

from . import localstack, stackinfra
from .home import dev_dir, read_state, state_path, write_state
from .supervise import (
    DEAD,
    ROLES,
    SERVING,
    STAGES,
    RoleCommand,
    ServiceProcess,
    StackError,
    default_role_command,
    spawn,
    stop_groups,
    target_of,
    wait_ready,
    wait_serving,
)

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

__all__ = ["DEAD", "ROLES", "SERVING", "ServiceProcess", "StackError", "StackRunning", "StackState",
           "StackStatus", "down", "heal", "parse_scale", "status", "up"]


class StackRunning(Conflict):
    """A stack recorded under this home is still running."""


def parse_scale(spec: str | None) -> dict[str, int]:
    """``"api=3,projector=2"`` -> replicas per role, every role defaulting to 1."""
    scale = dict.fromkeys(ROLES, 1)
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        role, sep, count = part.partition("=")
        role, count = role.strip(), count.strip()
        if not sep:
            raise InvalidInput(f"--scale: {part!r} is not ROLE=N (e.g. api=3,worker=2)")
        if role not in scale:
            raise InvalidInput(f"--scale: unknown role {role!r} (roles: {', '.join(ROLES)})")
        try:
            n = int(count)
        except ValueError:
            raise InvalidInput(f"--scale: {role}={count!r}: the replica count must be a whole number") from None
        if n < 1:
            raise InvalidInput(f"--scale: {role}={n}: the replica count must be at least 1")
        scale[role] = n
    return scale


def _quiet(_: str) -> None:
    pass


@dataclass
class StackState:
    """A running (or recorded) local stack. Serialised as ``<home>/dev/state.json``."""

    home: Path
    api: str = ""
    shard_manager: str = ""
    postgres_dsn: str = ""
    nats_url: str = ""
    postgres: dict[str, Any] = field(default_factory=dict)
    nats: dict[str, Any] = field(default_factory=dict)
    services: dict[str, list[ServiceProcess]] = field(default_factory=dict)
    phase: str = "starting"
    env_overrides: dict[str, str] = field(default_factory=dict)
    # The roles' NOETL_POSTGRES_DSN when it is not ``postgres_dsn`` (e.g. through a fault proxy).
    role_postgres_dsn: str = ""
    # What the call that returned this object restarted in place (``heal``); not recorded.
    healed: list[str] = field(default_factory=list, compare=False)

    # ------------------------------------------------------------ paths

    @property
    def dev_dir(self) -> Path:
        return dev_dir(self.home)

    @property
    def log_dir(self) -> Path:
        return self.dev_dir / "logs"

    @property
    def run_dir(self) -> Path:
        return self.dev_dir / "run"

    # ------------------------------------------------------------ processes

    def processes(self, role: str | None = None) -> list[ServiceProcess]:
        """Replicas of ``role`` (every role's, in start order, when None)."""
        if role is not None:
            return list(self.services.get(role, []))
        return [p for r in ROLES for p in self.services.get(r, [])] + [
            p for r, ps in self.services.items() if r not in ROLES for p in ps]

    def process(self, role: str, index: int = 0) -> ServiceProcess:
        for proc in self.services.get(role, []):
            if proc.index == index:
                return proc
        raise InvalidInput(f"no replica {role}-{index} in this stack")

    def kill(self, role: str, index: int = 0, sig: int = signal.SIGKILL) -> ServiceProcess:
        """Crash one replica (SIGKILL to its process group by default)."""
        proc = self.process(role, index)
        proc.kill(sig)
        return proc

    def stop(self, role: str, index: int = 0, timeout: float = 10.0) -> ServiceProcess:
        """Stop one replica the orderly way (SIGTERM, then SIGKILL after ``timeout``)."""
        proc = self.process(role, index)
        proc.stop(timeout)
        return proc

    def role_env(self, proc: ServiceProcess, grpc_listen: str = "127.0.0.1:0") -> dict[str, str]:
        """os.environ (so user NOETL_* settings pass through) plus what the stack decides."""
        env = dict(os.environ)
        env.update(self.env_overrides)
        env.update({
            "NOETL_POSTGRES_DSN": self.role_postgres_dsn or self.postgres_dsn,
            "NOETL_NATS_URL": self.nats_url,
            "NOETL_SHARD_MANAGER_TARGET": self.shard_manager,
            "NOETL_API_TARGET": self.api,
            "NOETL_READY_FILE": proc.ready_file,
            "NOETL_INSTANCE": proc.instance,
            "NOETL_GRPC_LISTEN": grpc_listen,
            "NOETL_METRICS_LISTEN": "127.0.0.1:0",
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def _new_process(self, role: str, index: int, command: Sequence[str]) -> ServiceProcess:
        instance = f"{role}-{index}"
        return ServiceProcess(role=role, index=index, instance=instance, command=list(command),
                              log=str(self.log_dir / f"{instance}.log"),
                              ready_file=str(self.run_dir / f"{instance}.json"))

    def restart(self, role: str, index: int = 0, *, timeout: float = 60.0, stop_timeout: float = 10.0,
                same_port: bool = True) -> ServiceProcess:
        """Stop the replica if it still runs, start it again and wait until it is SERVING.

        The replica keeps its instance name and, with ``same_port``, its gRPC port, so the
        multi-replica targets handed to other roles stay valid. Its log is appended to."""
        proc = self.process(role, index)
        if proc.alive():
            proc.stop(stop_timeout)
        self._respawn(proc, same_port=same_port)
        self.save()
        deadline = time.monotonic() + timeout
        wait_ready([proc], deadline)
        wait_serving([proc], deadline)
        self.save()
        return proc

    def _respawn(self, proc: ServiceProcess, *, same_port: bool = True) -> None:
        proc.reap()
        listen = proc.grpc if same_port and proc.grpc else "127.0.0.1:0"
        spawn(proc, self.role_env(proc, listen), append_log=True)

    def add_replica(self, role: str, *, timeout: float = 60.0,
                    command: Sequence[str] | None = None) -> ServiceProcess:
        """Start one more replica of ``role`` (not added to the api/shard-manager targets)."""
        replicas = self.services.setdefault(role, [])
        base = command or (replicas[0].command if replicas else default_role_command(role))
        proc = self._new_process(role, max((p.index for p in replicas), default=-1) + 1, base)
        replicas.append(proc)
        spawn(proc, self.role_env(proc))
        self.save()
        deadline = time.monotonic() + timeout
        wait_ready([proc], deadline)
        wait_serving([proc], deadline)
        self.save()
        return proc

    def alive(self) -> bool:
        """True when any recorded process (role, NATS or Postgres) still runs."""
        return any(p.alive() for p in self.processes()) or self.nats_alive() or self.postgres_alive()

    def dead_parts(self) -> list[str]:
        """What no longer runs: ``postgres``, ``nats``, role instances (``worker-1``)."""
        dead = [name for name, up in (("postgres", self.postgres_alive()), ("nats", self.nats_alive())) if not up]
        return dead + [p.instance for p in self.processes() if not p.alive()]

    # ------------------------------------------------------------ Postgres and NATS, in place

    def postgres_alive(self) -> bool:
        return stackinfra.alive(self.postgres)

    def nats_alive(self) -> bool:
        return stackinfra.alive(self.nats)

    def stop_postgres(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE`` (fast, immediate or smart); returns once it is down."""
        stackinfra.stop_postgres(self.postgres, mode)

    def kill_postgres(self) -> int:
        """SIGKILL the postmaster (a crash: its children exit on their own); returns its pid
        once it is gone. ``start_postgres`` copes with the children still exiting."""
        return stackinfra.kill_postgres(self.postgres)

    def start_postgres(self) -> int:
        """Start Postgres again on its data directory and port with its settings (no-op
        when it runs); returns its pid once it accepts connections."""
        if not self.postgres_alive():
            self.postgres = stackinfra.start_postgres(self.postgres)
            self.save()
        return int(self.postgres["pid"])

    def stop_nats(self, timeout: float = 10.0) -> None:
        """SIGTERM NATS (SIGKILL after ``timeout``); returns once it is gone."""
        stackinfra.stop_nats(self.nats, timeout)

    def kill_nats(self) -> int:
        """SIGKILL NATS; returns its pid once it is gone."""
        return stackinfra.kill_nats(self.nats)

    def start_nats(self) -> int:
        """Start NATS again (JetStream on) on its store directory and port (no-op when it
        runs); returns its pid once it accepts clients."""
        if not self.nats_alive():
            self.nats = stackinfra.start_nats(self.nats)
            self.save()
        return int(self.nats["pid"])

    # ------------------------------------------------------------ healing

    def heal(self, *, timeout: float = 90.0, progress: Progress | None = None) -> list[str]:
        """Restart in place whatever part of this stack is dead and keep what runs; return
        once every role answers SERVING (roles that lost Postgres or NATS report
        NOT_SERVING until they have it back).

        Postgres restarts on its data directory and port (the roles' DSN stays valid),
        NATS on its JetStream store and port (streams and messages kept), a role replica
        under its instance name and gRPC port (the targets handed to other roles stay
        valid). Returns what was restarted, in order (``[]`` when nothing was dead).
        Nothing is torn down on failure: ``PortTaken`` when a recorded port is held by
        another process, ``StackError`` naming a replica that does not come back."""
        say = progress or _quiet
        deadline = time.monotonic() + timeout
        restarted: list[str] = []
        if not self.postgres_alive():
            pid = self.start_postgres()
            say(f"postgres restarted in place (port {self.postgres.get('port')}, pid {pid}; data kept)")
            restarted.append("postgres")
        if not self.nats_alive():
            pid = self.start_nats()
            _run_async(lambda: _ensure_streams(self.nats_url))
            say(f"nats restarted in place (port {self.nats.get('port')}, pid {pid}; streams kept)")
            restarted.append("nats")
        extra = tuple(r for r in self.services if r not in ROLES)
        for stage in (*STAGES, extra):
            dead = [p for r in stage for p in self.processes(r) if not p.alive()]
            for proc in dead:
                self._respawn(proc)
            if not dead:
                continue
            self.save()
            wait_ready(dead, deadline, on_ready=lambda p: say(f"{p.instance} restarted (pid {p.pid}, grpc {p.grpc})"))
            restarted += [p.instance for p in dead]
            self.save()
        wait_serving(self.processes(), deadline)
        say("every role SERVING")
        self.healed = restarted
        return restarted

    def refresh(self) -> None:
        """Take in what another process recorded for this stack (a ``noetl-rt dev up``
        that healed it): the servers' records and each replica restarted elsewhere (its
        pid, ports). Replicas that did not change keep their process handles here."""
        disk = StackState.load(self.home)
        if disk is None:
            return
        self.postgres, self.nats = disk.postgres, disk.nats
        for role, procs in disk.services.items():
            mine = {p.index: p for p in self.services.get(role, [])}
            for recorded in procs:
                current = mine.get(recorded.index)
                if current is None:
                    self.services.setdefault(role, []).append(recorded)
                elif (current.pid, current.started) != (recorded.pid, recorded.started):
                    current.reap()
                    current.forget()
                    current.pid, current.started = recorded.pid, recorded.started
                    current.grpc, current.metrics = recorded.grpc, recorded.metrics
                    current.runtime_id = recorded.runtime_id

    def client_env(self) -> dict[str, str]:
        """Environment for a client of this stack (``noetl-rt`` commands, tests)."""
        return {"NOETL_API": self.api, "NOETL_POSTGRES_DSN": self.postgres_dsn, "NOETL_NATS_URL": self.nats_url,
                "NOETL_HOME": str(self.home)}

    def shutdown(self, *, timeout: float = 10.0, progress: Progress | None = None) -> None:
        """Stop every process of this stack (what another process restarted too) and delete
        its data (same as ``down(home)``)."""
        self.refresh()
        _teardown(self, say=progress or _quiet, timeout=timeout)

    def forget_children(self) -> None:
        """Let the role processes outlive this Python process (``dev up --detach``)."""
        for p in self.processes():
            p.forget()

    # ------------------------------------------------------------ persistence

    def to_json(self) -> dict[str, Any]:
        return {
            "home": str(self.home), "phase": self.phase, "api": self.api, "shard_manager": self.shard_manager,
            "postgres_dsn": self.postgres_dsn, "nats_url": self.nats_url,
            "postgres": dict(self.postgres), "nats": dict(self.nats),
            "services": {role: [p.to_json() for p in procs] for role, procs in self.services.items()},
            "env": dict(self.env_overrides), "role_postgres_dsn": self.role_postgres_dsn,
        }

    def save(self) -> None:
        write_state(self.home, self.to_json())

    @classmethod
    def from_json(cls, data: Mapping[str, Any], home: str | os.PathLike[str] | None = None) -> StackState:
        return cls(
            home=Path(home or data.get("home") or "."), phase=str(data.get("phase", "up")),
            api=str(data.get("api", "")), shard_manager=str(data.get("shard_manager", "")),
            postgres_dsn=str(data.get("postgres_dsn", "")), nats_url=str(data.get("nats_url", "")),
            postgres=dict(data.get("postgres") or {}), nats=dict(data.get("nats") or {}),
            services={role: [ServiceProcess.from_json(role, i, p) for i, p in enumerate(procs)]
                      for role, procs in (data.get("services") or {}).items()},
            env_overrides={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            role_postgres_dsn=str(data.get("role_postgres_dsn") or ""),
        )

    @classmethod
    def load(cls, home: str | os.PathLike[str]) -> StackState | None:
        data = read_state(home)
        return cls.from_json(data, Path(home).resolve()) if data is not None else None


# ---------------------------------------------------------------- up


def _run_async(fn: Callable[[], Any]) -> Any:
    """Run a coroutine function to completion on a private loop (works under a running loop too)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(fn())).result()


async def _ensure_streams(url: str) -> None:
    # natsio logs a warning when the connection closes; this one closes on purpose.
    nats_log = logging.getLogger(natsio.__name__)
    level = nats_log.level
    nats_log.setLevel(logging.ERROR)
    try:
        nc = await natsio.connect(url, name="noetl-rt-dev")
        try:
            await natsio.ensure_streams(nc.jetstream())
        finally:
            await nc.drain()
    finally:
        nats_log.setLevel(level)


RolePostgresDsn = str | Callable[[str], str]


def up(home: str | os.PathLike[str], scale: Mapping[str, int] | None = None, *, timeout: float = 90.0,
       roles: Sequence[str] = ROLES, role_command: RoleCommand | None = None,
       env: Mapping[str, str] | None = None, progress: Progress | None = None,
       role_postgres_dsn: RolePostgresDsn | None = None, synchronous_commit: bool | None = None) -> StackState:
    """Start Postgres, NATS and every role in ``roles`` (``scale[role]`` replicas each,
    default 1) as separate processes; return once every process answers SERVING.

    ``role_command(role)`` gives the argv of a role process (default ``python -m
    noetl_<role>``); ``env`` adds environment variables for the role processes.
    ``role_postgres_dsn`` is the roles' NOETL_POSTGRES_DSN when it is not the direct one:
    a DSN, or a function of the direct DSN called once Postgres is up (a test's fault
    proxy: ``role_postgres_dsn=proxy.dsn_via``); ``state.postgres_dsn`` (migrations,
    clients, tests) stays direct. ``synchronous_commit=True`` starts Postgres so that a
    commit it acknowledged survives a crash of Postgres (tests that SIGKILL it need that;
    the default, off like fsync, loses the last fraction of a second of commits then:
    ``localstack.start_postgres``). On any failure everything started so far is torn down
    and the error (a ``StackError`` naming the failing replica, with its log tail) is
    raised.

    When a stack recorded under ``home`` is partly alive (Postgres, NATS or some replicas
    died), it is healed in place instead (``StackState.heal``: data, ports and live
    processes kept; the arguments above do not apply) and returned with ``healed``
    naming what was restarted. Raises ``StackRunning`` when it runs whole."""
    say = progress or _quiet
    home = Path(home).resolve()
    unknown = [r for r in [*roles, *(scale or {})] if r not in ROLES]
    if unknown:
        raise InvalidInput(f"unknown role(s): {', '.join(unknown)}")
    command = role_command or default_role_command
    replicas = {r: int((scale or {}).get(r, 1)) for r in roles}
    if any(n < 1 for n in replicas.values()):
        raise InvalidInput("every role needs at least 1 replica")

    with _start_lock(home):
        existing = StackState.load(home)
        if existing is not None and existing.alive():
            dead = existing.dead_parts()
            if not dead or existing.phase != "up":
                raise StackRunning(f"a local stack is already running under {home} (api {existing.api or '?'}); "
                                   "stop it with `noetl-rt dev down`")
            say(f"not running: {', '.join(dead)}; restarting in place")
            existing.heal(timeout=timeout, progress=say)
            return existing
        _clean(home, say=_quiet)
        state = StackState(home=home, env_overrides=dict(env or {}))
        return _start(state, replicas, command, timeout, say, role_postgres_dsn, synchronous_commit)


def heal(home: str | os.PathLike[str], *, timeout: float = 90.0, progress: Progress | None = None) -> StackState:
    """Restart in place whatever part of the stack recorded under ``home`` is dead
    (``StackState.heal``); returns the stack once every role is SERVING, with
    ``healed`` naming what was restarted. Raises ``NotFound`` when no stack is recorded."""
    home = Path(home).resolve()
    with _start_lock(home):
        state = StackState.load(home)
        if state is None:
            raise NotFound(f"no local stack recorded under {home} (start one with `noetl-rt dev up`)")
        state.heal(timeout=timeout, progress=progress)
        return state


@contextlib.contextmanager
def _start_lock(home: Path) -> Iterator[None]:
    """One ``up`` at a time per home (an advisory lock on ``<home>/dev/.lock``)."""
    path = dev_dir(home) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackRunning(f"another `noetl-rt dev up` is starting a stack under {home}") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _start(state: StackState, replicas: Mapping[str, int], command: RoleCommand, timeout: float,
           say: Progress, role_postgres_dsn: RolePostgresDsn | None = None,
           synchronous_commit: bool | None = None) -> StackState:
    state.log_dir.mkdir(parents=True, exist_ok=True)
    state.run_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    try:
        pg = localstack.start_postgres(state.dev_dir / "pg", synchronous_commit=synchronous_commit)
        state.postgres = stackinfra.record(pg)
        state.postgres_dsn = pg.dsn
        if role_postgres_dsn is not None:
            dsn = role_postgres_dsn(pg.dsn) if callable(role_postgres_dsn) else role_postgres_dsn
            state.role_postgres_dsn = "" if dsn == pg.dsn else dsn
        state.save()
        say(f"postgres ready (port {pg.port})")
        nats = localstack.start_nats(state.dev_dir / "nats")
        state.nats = stackinfra.record(nats)
        state.nats_url = nats.url
        state.save()
        say(f"nats ready (port {nats.port})")
        applied = db.migrate(state.postgres_dsn)
        say(f"database migrated ({'applied ' + ', '.join(map(str, applied)) if applied else 'up to date'})")
        _run_async(lambda: _ensure_streams(state.nats_url))
        say("nats streams ready")

        for stage in STAGES:
            started: list[ServiceProcess] = []
            for role in (r for r in stage if r in replicas):
                procs = state.services.setdefault(role, [])
                for i in range(replicas[role]):
                    proc = state._new_process(role, i, command(role))
                    procs.append(proc)
                    spawn(proc, state.role_env(proc))
                    started.append(proc)
            if not started:
                continue
            state.save()
            earlier = [p for p in state.processes() if p not in started]
            wait_ready(started, deadline, watch=earlier,
                       on_ready=lambda p: say(f"{p.instance} ready (pid {p.pid}, grpc {p.grpc})"))
            if "shard-manager" in stage:
                state.shard_manager = target_of([p.grpc for p in state.processes("shard-manager")])
            if "api" in stage:
                state.api = target_of([p.grpc for p in state.processes("api")])
            state.save()

        wait_serving(state.processes(), deadline, on_serving=lambda p: say(f"{p.instance} SERVING at {p.grpc}"))
        state.phase = "up"
        state.save()
        return state
    except BaseException as exc:
        say("start failed; tearing the stack down")
        _teardown(state, say=_quiet)
        if isinstance(exc, StackError):
            exc.torn_down = True
        raise


# ---------------------------------------------------------------- down


def _teardown(state: StackState, *, say: Progress, timeout: float = 10.0) -> None:
    """Stop role processes (last stage first), then NATS, then Postgres; delete the data."""
    staged = [[p for r in stage for p in state.processes(r)] for stage in reversed(STAGES)]
    staged.insert(0, [p for r, ps in state.services.items() if r not in ROLES for p in ps])
    for procs in staged:
        if not procs:
            continue

        def reap(procs: list[ServiceProcess] = procs) -> None:
            for p in procs:
                p.reap()

        stop_groups([p.group_id() for p in procs], timeout, reap=reap)
        for p in procs:
            say(f"{p.instance} stopped")
    if stackinfra.alive(state.nats):
        localstack.stop_pid(int(state.nats["pid"]), timeout)
        say("nats stopped")
    if state.postgres.get("datadir"):
        stackinfra.stop_postgres(state.postgres, "fast")
        say("postgres stopped")
    _clean(state.home, say=say)


def _clean(home: Path, *, say: Progress) -> None:
    """Delete the throwaway data (stopping a Postgres left running in it) and the state file."""
    dev = dev_dir(home)
    pgdata = dev / "pg" / "pgdata"
    if (pgdata / "postmaster.pid").exists():
        try:
            bindir = str(localstack._pg_bindir())
        except Exception:
            bindir = ""
        stackinfra.stop_postgres({"datadir": str(pgdata), "bindir": bindir}, "fast")
    for sub in ("pg", "nats", "run"):
        shutil.rmtree(dev / sub, ignore_errors=True)
    state_path(home).unlink(missing_ok=True)


def down(home: str | os.PathLike[str], *, timeout: float = 10.0, progress: Progress | None = None) -> bool:
    """Stop the stack recorded under ``home`` and delete its data. Idempotent: returns
    False when nothing was recorded."""
    say = progress or _quiet
    home = Path(home).resolve()
    state = StackState.load(home)
    if state is None:
        _clean(home, say=_quiet)
        return False
    state.shutdown(timeout=timeout, progress=say)
    return True


# ---------------------------------------------------------------- status


@dataclass
class StackStatus:
    """Health of a recorded stack, checked now."""

    api: str
    postgres_dsn: str
    nats_url: str
    services: dict[str, list[dict[str, Any]]]
    postgres_alive: bool
    nats_alive: bool
    home: str = ""
    postgres_pid: int = 0
    postgres_port: int = 0
    nats_pid: int = 0
    nats_port: int = 0

    @property
    def healthy(self) -> bool:
        every = [s["health"] for procs in self.services.values() for s in procs]
        return self.postgres_alive and self.nats_alive and all(h == SERVING for h in every)

    def dead(self) -> list[str]:
        """``postgres``, ``nats`` and the role instances whose process is gone."""
        infra = [n for n, up in (("postgres", self.postgres_alive), ("nats", self.nats_alive)) if not up]
        return infra + [s["instance"] for procs in self.services.values() for s in procs if s["health"] == DEAD]

    def to_json(self) -> dict[str, Any]:
        """The ``dev status --json`` document. ``postgres``/``nats``: ``status`` is
        ``running`` or ``DEAD``; each service's ``health`` is what its grpc.health.v1
        answered (SERVING, NOT_SERVING, ...), UNREACHABLE when it did not answer, DEAD
        when its process is gone."""
        return {"api": self.api, "postgres_dsn": self.postgres_dsn, "nats_url": self.nats_url,
                "services": self.services,
                "postgres": {"status": _running(self.postgres_alive), "pid": self.postgres_pid,
                             "port": self.postgres_port},
                "nats": {"status": _running(self.nats_alive), "pid": self.nats_pid, "port": self.nats_port},
                "healthy": self.healthy}


def _running(alive: bool) -> str:
    return "running" if alive else DEAD


def status(home: str | os.PathLike[str], *, timeout: float = 1.0) -> StackStatus | None:
    """Check every recorded process (pid alive, gRPC health); None when no stack is recorded."""
    state = StackState.load(Path(home).resolve())
    if state is None:
        return None
    procs = state.processes()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(procs)))) as pool:
        healths = list(pool.map(lambda p: p.health(timeout), procs))
    services: dict[str, list[dict[str, Any]]] = {}
    for p, health in zip(procs, healths, strict=True):
        services.setdefault(p.role, []).append({"pid": p.pid, "health": health, "metrics": p.metrics,
                                                "grpc": p.grpc, "instance": p.instance})
    return StackStatus(
        api=state.api, postgres_dsn=state.postgres_dsn, nats_url=state.nats_url, services=services,
        postgres_alive=state.postgres_alive(), nats_alive=state.nats_alive(), home=str(state.home),
        postgres_pid=int(state.postgres.get("pid") or 0), postgres_port=int(state.postgres.get("port") or 0),
        nats_pid=int(state.nats.get("pid") or 0), nats_port=int(state.nats.get("port") or 0),
    )

