"""``StackState``: a running (or recorded) local stack, its role processes and its
Postgres and NATS, serialised as ``<home>/dev/state.json``; and tearing it down.

It is what ``devstack.up`` returns and what tests drive: kill, stop and restart a
replica; stop, kill and start Postgres or NATS in place (stackinfra.py); ``heal()`` what
died; ``shutdown()``.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from noetl_common import dbroles, natsio
from noetl_common.errors import InvalidInput

from . import localstack, stackcerts, stackinfra, stacknats, stackpg, stacksecrets
from .home import dev_dir, read_state, state_path, write_state
from .supervise import (
    ROLES,
    STAGES,
    ServiceProcess,
    default_role_command,
    spawn,
    stop_groups,
    wait_ready,
    wait_serving,
)

Progress = Callable[[str], None]
CREDENTIALS_KEYS = "NOETL_CREDENTIALS_KEYS"

__all__ = ["Progress", "StackState", "clean_home", "quiet", "teardown"]


def quiet(_: str) -> None:
    pass


@dataclass
class StackState:
    """A running (or recorded) local stack. Serialised as ``<home>/dev/state.json``."""

    home: Path
    api: str = ""
    # the api replicas' worker API (their own port)
    worker_api: str = ""
    shard_manager: str = ""
    postgres_dsn: str = ""
    nats_url: str = ""
    postgres: dict[str, Any] = field(default_factory=dict)
    nats: dict[str, Any] = field(default_factory=dict)
    services: dict[str, list[ServiceProcess]] = field(default_factory=dict)
    phase: str = "starting"
    env_overrides: dict[str, str] = field(default_factory=dict)
    # Environment of one replica over ``env_overrides``, by instance (``worker-1``: e.g. its
    # NOETL_WORKER_POOL); kept across restarts and heals.
    replica_env: dict[str, dict[str, str]] = field(default_factory=dict)
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

    @property
    def credentials_key_file(self) -> Path:
        """The stack's credentials master key (``NOETL_CREDENTIALS_KEYS`` of its api
        processes): made at ``dev up``, mode 0600, deleted with the data by ``dev down``."""
        return self.dev_dir / "secrets" / "credentials.keys"

    def ensure_credentials_key(self) -> None:
        """Make the stack's credentials key unless it exists (kept across heals: the data
        it encrypts is)."""
        path = self.credentials_key_file
        if path.exists():
            return
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"local:{base64.b64encode(os.urandom(32)).decode()}\n")

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

    @property
    def tls(self) -> dict[str, Path]:
        """The stack's CA and the roles' certificate and key (``stackcerts``)."""
        return stackcerts.paths(self.dev_dir)

    @property
    def ca_file(self) -> str:
        """The CA a client of this stack trusts ('' when the stack has no TLS)."""
        ca = self.tls["ca"]
        return str(ca) if ca.exists() else ""

    @property
    def tokens(self) -> dict[str, str]:
        """The stack's tokens by role (admin, service, worker): ``stacksecrets``."""
        return stacksecrets.tokens(self.dev_dir)

    def nats_user_url(self, user: str = "admin") -> str:
        """The NATS URL with ``user``'s credentials (``admin``: everything; a role's own:
        its permissions, ``natsperms``); the plain URL for a stack without NATS users.
        Connect with ``natsio.connect(url, name=..., ca_file=state.ca_file)``."""
        return stacknats.user_url(self.nats_url, self.dev_dir, user) or self.nats_url

    async def nats_connect(self, name: str, user: str = "admin") -> NATS:
        """A NATS client of this stack as ``user`` (TLS trusting the stack's CA); the caller
        closes it."""
        return await natsio.connect(self.nats_user_url(user), name=name, ca_file=self.ca_file)

    def role_env(self, proc: ServiceProcess, grpc_listen: str = "127.0.0.1:0",
                 worker_listen: str = "127.0.0.1:0") -> dict[str, str]:
        """os.environ (so user NOETL_* settings pass through) plus what the stack decides:
        endpoints, and the role's own token (workers a worker token, every other role the
        service token)."""
        env = dict(os.environ)
        env.update(self.env_overrides)
        env.update(self.replica_env.get(proc.instance, {}))
        tokens = self.tokens
        env.update({
            "NOETL_POSTGRES_DSN": self.role_dsn(proc.role),
            "NOETL_NATS_URL": self.nats_url,
            "NOETL_SHARD_MANAGER_TARGET": self.shard_manager,
            "NOETL_API_TARGET": self.api,
            "NOETL_WORKER_API_TARGET": self.worker_api,
            "NOETL_READY_FILE": proc.ready_file,
            "NOETL_INSTANCE": proc.instance,
            "NOETL_GRPC_LISTEN": grpc_listen,
            "NOETL_WORKER_API_LISTEN": worker_listen,
            "NOETL_METRICS_LISTEN": "127.0.0.1:0",
            "NOETL_AUTH_TOKEN": tokens.get("worker" if proc.role == "worker" else "service", ""),
            "NOETL_TLS_CA_FILE": str(self.tls["ca"]),
            "NOETL_TLS_CERT_FILE": str(self.tls["cert"]),
            "NOETL_TLS_KEY_FILE": str(self.tls["key"]),
            "PYTHONUNBUFFERED": "1",
        })
        env.update(stacknats.role_env(self.nats_url, self.dev_dir, proc.role))  # its own NATS user, TLS
        # The credentials' master key is the api's alone (the stack's own unless the caller
        # gave one); no other role gets it.
        keys = env.pop(CREDENTIALS_KEYS, None)
        if proc.role == "api":
            if not keys and self.credentials_key_file.exists():
                keys = self.credentials_key_file.read_text().strip()
            if keys:
                env[CREDENTIALS_KEYS] = keys
        return env

    def role_dsn(self, role: str) -> str:
        """``role``'s NOETL_POSTGRES_DSN: its own login user (``stackpg``; its password from
        secrets.json) on the direct DSN or, when set, ``role_postgres_dsn`` (a fault proxy).
        A role with no login user of its own (not a runtime role) gets the owner's."""
        base = self.role_postgres_dsn or self.postgres_dsn
        password = stackpg.passwords(self.dev_dir).get(role) if role in dbroles.ROLES else None
        return stackpg.role_dsn(base, role, password) if password else base

    def _new_process(self, role: str, index: int, command: Sequence[str]) -> ServiceProcess:
        instance = f"{role}-{index}"
        return ServiceProcess(role=role, index=index, instance=instance, command=list(command),
                              log=str(self.log_dir / f"{instance}.log"),
                              ready_file=str(self.run_dir / f"{instance}.json"), ca_file=self.ca_file)

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
        worker_listen = proc.worker_grpc if same_port and proc.worker_grpc else "127.0.0.1:0"
        spawn(proc, self.role_env(proc, listen, worker_listen), append_log=True)

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
        say = progress or quiet
        deadline = time.monotonic() + timeout
        restarted: list[str] = []
        if not self.postgres_alive():
            pid = self.start_postgres()
            say(f"postgres restarted in place (port {self.postgres.get('port')}, pid {pid}; data kept)")
            restarted.append("postgres")
        if not self.nats_alive():
            pid = self.start_nats()
            stackinfra.ensure_streams(self.nats_user_url(), self.ca_file)
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
        return {"NOETL_API": self.api, "NOETL_POSTGRES_DSN": self.postgres_dsn,
                "NOETL_NATS_URL": self.nats_user_url(), "NOETL_NATS_TLS_CA_FILE": self.ca_file,
                "NOETL_HOME": str(self.home), "NOETL_TOKEN": self.tokens.get("admin", ""),
                "NOETL_TLS_CA_FILE": self.ca_file}

    def shutdown(self, *, timeout: float = 10.0, progress: Progress | None = None) -> None:
        """Stop every process of this stack (what another process restarted too) and delete
        its data (same as ``down(home)``)."""
        self.refresh()
        teardown(self, say=progress or quiet, timeout=timeout)

    def forget_children(self) -> None:
        """Let the role processes outlive this Python process (``dev up --detach``)."""
        for p in self.processes():
            p.forget()

    # ------------------------------------------------------------ persistence

    def to_json(self) -> dict[str, Any]:
        return {
            "home": str(self.home), "phase": self.phase, "api": self.api, "worker_api": self.worker_api,
            "shard_manager": self.shard_manager,
            "postgres_dsn": self.postgres_dsn, "nats_url": self.nats_url,
            "postgres": dict(self.postgres), "nats": dict(self.nats),
            "services": {role: [p.to_json() for p in procs] for role, procs in self.services.items()},
            "env": dict(self.env_overrides), "role_postgres_dsn": self.role_postgres_dsn,
            "replica_env": {k: dict(v) for k, v in self.replica_env.items()},
        }

    def save(self) -> None:
        write_state(self.home, self.to_json())

    @classmethod
    def from_json(cls, data: Mapping[str, Any], home: str | os.PathLike[str] | None = None) -> StackState:
        return cls(
            home=Path(home or data.get("home") or "."), phase=str(data.get("phase", "up")),
            api=str(data.get("api", "")), worker_api=str(data.get("worker_api", "")),
            shard_manager=str(data.get("shard_manager", "")),
            postgres_dsn=str(data.get("postgres_dsn", "")), nats_url=str(data.get("nats_url", "")),
            postgres=dict(data.get("postgres") or {}), nats=dict(data.get("nats") or {}),
            services={role: [ServiceProcess.from_json(role, i, p) for i, p in enumerate(procs)]
                      for role, procs in (data.get("services") or {}).items()},
            env_overrides={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            role_postgres_dsn=str(data.get("role_postgres_dsn") or ""),
            replica_env={str(k): {str(a): str(b) for a, b in dict(v).items()}
                         for k, v in (data.get("replica_env") or {}).items()},
        )

    @classmethod
    def load(cls, home: str | os.PathLike[str]) -> StackState | None:
        data = read_state(home)
        return cls.from_json(data, Path(home).resolve()) if data is not None else None



# ---------------------------------------------------------------- teardown


def teardown(state: StackState, *, say: Progress, timeout: float = 10.0) -> None:
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
    clean_home(state.home, say=say)


def clean_home(home: Path, *, say: Progress) -> None:
    """Delete the throwaway data (stopping a Postgres left running in it) and the state file."""
    dev = dev_dir(home)
    pgdata = dev / "pg" / "pgdata"
    if (pgdata / "postmaster.pid").exists():
        try:
            bindir = str(localstack._pg_bindir())
        except Exception:
            bindir = ""
        stackinfra.stop_postgres({"datadir": str(pgdata), "bindir": bindir}, "fast")
    for sub in ("pg", "nats", "run", "secrets"):
        shutil.rmtree(dev / sub, ignore_errors=True)
    state_path(home).unlink(missing_ok=True)
    stacksecrets.path(dev).unlink(missing_ok=True)  # its tokens named a database that is gone
    shutil.rmtree(dev / stackcerts.DIR, ignore_errors=True)
