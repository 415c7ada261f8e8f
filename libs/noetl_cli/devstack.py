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

``StackState`` (stackstate.py) is the recorded stack and its controls. Postgres and NATS
are controlled in place by ``stop_postgres``/``kill_postgres``/
``start_postgres`` and ``stop_nats``/``kill_nats``/``start_nats`` (stackinfra.py): the same
data directory, store and port, so the roles' DSN and URL stay valid. ``up(...,
role_postgres_dsn=...)`` gives the role processes another way to Postgres (a fault
proxy in tests) while ``state.postgres_dsn`` stays the direct one.

Layout under ``<home>/dev``: ``state.json``, ``pg/`` (Postgres), ``nats/`` (JetStream
store), ``run/<role>-<i>.json`` (ready files), ``logs/<role>-<i>.log``,
``secrets/credentials.keys`` (the credentials master key, mode 0600, given to the api
processes only). ``down`` deletes all of it except the logs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noetl_common import db
from noetl_common.errors import Conflict, InvalidInput, NotFound

from . import localstack, stackcerts, stackinfra, stacknats, stackpg, stacksecrets
from .home import dev_dir
from .stackstate import Progress, StackState, clean_home, quiet, teardown
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
    target_of,
    wait_ready,
    wait_serving,
)

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------- up


RolePostgresDsn = str | Callable[[str], str]


def up(home: str | os.PathLike[str], scale: Mapping[str, int] | None = None, *, timeout: float = 90.0,
       roles: Sequence[str] = ROLES, role_command: RoleCommand | None = None,
       env: Mapping[str, str] | None = None, progress: Progress | None = None,
       role_postgres_dsn: RolePostgresDsn | None = None, synchronous_commit: bool = True,
       replica_env: Mapping[str, Mapping[str, str]] | None = None) -> StackState:
    """Start Postgres, NATS and every role in ``roles`` (``scale[role]`` replicas each,
    default 1) as separate processes; return once every process answers SERVING.

    ``role_command(role)`` gives the argv of a role process (default ``python -m
    noetl_<role>``); ``env`` adds environment variables for the role processes, and
    ``replica_env`` for one replica over them, by instance (``{"worker-1": {...}}``).
    ``role_postgres_dsn`` is the roles' NOETL_POSTGRES_DSN when it is not the direct one:
    a DSN, or a function of the direct DSN called once Postgres is up (a test's fault
    proxy: ``role_postgres_dsn=proxy.dsn_via``); ``state.postgres_dsn`` (migrations,
    clients, tests) stays direct. ``synchronous_commit`` (default on) makes a commit
    Postgres acknowledged survive a crash of Postgres (its WAL is written before the
    answer; fsync stays off, so only an OS crash can lose it): nothing the runtime
    acknowledged is lost when the local Postgres is killed. Off saves ~25 us per commit
    and loses the last fraction of a second of commits on such a crash. On any failure everything started so far is torn down
    and the error (a ``StackError`` naming the failing replica, with its log tail) is
    raised.

    When a stack recorded under ``home`` is partly alive (Postgres, NATS or some replicas
    died), it is healed in place instead (``StackState.heal``: data, ports and live
    processes kept; the arguments above do not apply) and returned with ``healed``
    naming what was restarted. Raises ``StackRunning`` when it runs whole."""
    say = progress or quiet
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
        clean_home(home, say=quiet)
        state = StackState(home=home, env_overrides=dict(env or {}),
                           replica_env={k: dict(v) for k, v in (replica_env or {}).items()})
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
    state.ensure_credentials_key()
    deadline = time.monotonic() + timeout
    try:
        pg = localstack.start_postgres(state.dev_dir / "pg", synchronous_commit=synchronous_commit,
                                       tls_dir=state.dev_dir)
        state.postgres = stackinfra.record(pg)
        state.postgres_dsn = pg.dsn
        if role_postgres_dsn is not None:
            dsn = role_postgres_dsn(pg.dsn) if callable(role_postgres_dsn) else role_postgres_dsn
            state.role_postgres_dsn = "" if dsn == pg.dsn else dsn
        state.save()
        say(f"postgres ready (port {pg.port})")
        nats = stacknats.start(state.dev_dir, {**os.environ, **state.env_overrides})  # TLS, a user per role
        state.nats = stackinfra.record(nats)
        state.nats_url = nats.url
        state.save()
        say(f"nats ready (port {nats.port})")
        applied = db.migrate(state.postgres_dsn)
        say(f"database migrated ({'applied ' + ', '.join(map(str, applied)) if applied else 'up to date'})")
        stackpg.ensure_logins(state.postgres_dsn, stackpg.passwords(state.dev_dir))
        say("database users ready (one per role)")
        stacksecrets.issue_tokens(state.dev_dir, state.postgres_dsn)
        say(f"tokens issued (admin token for the CLI in {stacksecrets.path(state.dev_dir)})")
        tls = stackcerts.ensure(state.dev_dir)
        say(f"TLS certificates made (CA {tls['ca']})")
        stackinfra.ensure_streams(state.nats_user_url(), state.ca_file)
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
                state.worker_api = target_of([p.worker_grpc for p in state.processes("api")])
            state.save()

        wait_serving(state.processes(), deadline, on_serving=lambda p: say(f"{p.instance} SERVING at {p.grpc}"))
        state.phase = "up"
        state.save()
        return state
    except BaseException as exc:
        say("start failed; tearing the stack down")
        teardown(state, say=quiet)
        if isinstance(exc, StackError):
            exc.torn_down = True
        raise


# ---------------------------------------------------------------- down


def down(home: str | os.PathLike[str], *, timeout: float = 10.0, progress: Progress | None = None) -> bool:
    """Stop the stack recorded under ``home`` and delete its data. Idempotent: returns
    False when nothing was recorded."""
    say = progress or quiet
    home = Path(home).resolve()
    state = StackState.load(home)
    if state is None:
        clean_home(home, say=quiet)
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

