"""Our side of the benchmark: the embedded local stack (``noetl_cli.devstack``) under a
throwaway home, a gRPC client, a Postgres connection, and the counters the scenarios
read (write transactions, JetStream sequences, Prometheus samples).

``BenchStack`` is a context manager: every process it starts (Postgres, NATS, the seven
roles) is stopped on exit, whatever happened; the role logs are copied to
``bench/results/logs/<name>/`` (or the run's ``--results`` directory) first so a failed
scenario can be looked into.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import glob
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg

from noetl_cli import devstack, localstack
from noetl_cli.client import Api
from noetl_cli.supervise import ServiceProcess, target_of
from noetl_client import step_result, values
from noetl_common import grpcretry, natsio
from noetl_proto.v1 import common_pb2, execution_pb2

from .progress import Progress

RESULTS = Path(__file__).resolve().parent / "results"

# The bench stack runs the defaults (what `noetl-rt dev up` and the chart start), so the
# figures are the ones a user gets; only logging is quieter (WARNING: INFO logging of every
# command is a cost the figures should not carry). TUNED_ENV, when not empty, is a tuned
# configuration whose fan-out the full run measures beside the defaults' (report: "tuned").
BASE_ENV = {
    "NOETL_LOG_LEVEL": "WARNING",
}
TUNED_ENV: dict[str, str] = {}
# Fast failover (the recovery scenario): heartbeat 1 s, lease 3 s.
FAST_FAILOVER_ENV = {
    "NOETL_SHARD_HEARTBEAT_SEC": "1",
    "NOETL_SHARD_LEASE_SEC": "3",
    "NOETL_COMMAND_LEASE_SEC": "5",
    "NOETL_COMMAND_REPUBLISH_AFTER_SEC": "3",
    "NOETL_EXECUTION_SWEEP_INTERVAL_SEC": "0.5",
}

TERMINAL = {common_pb2.EXECUTION_STATUS_COMPLETED, common_pb2.EXECUTION_STATUS_FAILED,
            common_pb2.EXECUTION_STATUS_CANCELLED}


def status_name(status: int) -> str:
    return common_pb2.ExecutionStatus.Name(status).removeprefix("EXECUTION_STATUS_")


HOME_PREFIX = "noetl-bench-"
LOCK_NAME = "bench.lock"


def reap_stale(progress: Progress) -> list[str]:
    """Stop the stacks of earlier bench runs that died without stopping them (SIGKILL,
    a lost terminal): a home whose lock no live process holds. Returns the homes reaped."""
    reaped = []
    for home in glob.glob(os.path.join(tempfile.gettempdir(), f"{HOME_PREFIX}*")):
        lock = Path(home) / LOCK_NAME
        if not lock.exists():
            continue
        with open(lock, "w") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live bench run owns it
            with contextlib.suppress(Exception):
                devstack.down(home, timeout=10)
        shutil.rmtree(home, ignore_errors=True)
        reaped.append(home)
        progress.say(f"stopped a stack left behind by an earlier bench run: {home}")
    return reaped


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP until the block is done (a teardown must not stop
    halfway), then raise KeyboardInterrupt if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, lambda n, _f: got.append(n))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            raise KeyboardInterrupt(f"signal {got[0]} (deferred until the teardown was done)")


class BenchError(Exception):
    """A scenario could not produce a verified figure (the message says why)."""


@dataclass
class Terminal:
    execution_id: int
    status: str
    error: str
    at: float  # time.monotonic() when the client saw the terminal state


class BenchStack:
    def __init__(self, name: str, progress: Progress, *, scale: Mapping[str, int] | None = None,
                 env: Mapping[str, str] | None = None, fsync: bool = False, results: Path = RESULTS) -> None:
        self.name = name
        self.results_dir = results
        self.progress = progress
        self.scale = dict(scale or {})
        self.env = {**BASE_ENV, **(env or {})}
        self.fsync = fsync
        self.home: Path | None = None
        self.state: devstack.StackState | None = None
        self.api: Api | None = None
        self.conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._lockfile: Any = None

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> BenchStack:
        self.home = Path(tempfile.mkdtemp(prefix=f"{HOME_PREFIX}{self.name}-"))
        os.chmod(self.home, 0o755)
        # Held while this stack lives: a later run reaps the stack only if this process died.
        self._lockfile = open(self.home / LOCK_NAME, "w")
        fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.progress.say(f"starting our stack '{self.name}' (scale {self.scale or 'one of each'}, "
                          f"postgres fsync {'on' if self.fsync else 'as the local stack sets it (off)'})")
        start = localstack.start_postgres
        try:
            if self.fsync:  # the local stack starts Postgres with fsync off; this run asks for it on
                localstack.start_postgres = functools.partial(start, fsync=True)  # type: ignore[assignment]
            self.state = devstack.up(self.home, self.scale, env=self.env, timeout=180)
        except BaseException:
            self._cleanup_home()
            raise
        finally:
            localstack.start_postgres = start  # type: ignore[assignment]
        try:
            self.api = Api(self.state.api, token=self.state.tokens.get("admin", ""), ca_file=self.state.ca_file)
            self.conn = psycopg.connect(self.state.postgres_dsn, autocommit=True)
            self.progress.say(f"stack '{self.name}' up: api {self.state.api}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with shielded():
            self._teardown()

    def _teardown(self) -> None:
        with contextlib.suppress(Exception):
            if self.api is not None:
                self.api.close()
        with contextlib.suppress(Exception):
            if self.conn is not None:
                self.conn.close()
        if self.state is not None:
            with contextlib.suppress(Exception):
                keep = self.results_dir / "logs" / self.name
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(self.state.log_dir, keep)
            try:
                self.state.shutdown(timeout=10)
            finally:
                self.state = None
                self.progress.say(f"stack '{self.name}' stopped")
        self._cleanup_home()

    def _cleanup_home(self) -> None:
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None
        if self._lockfile is not None:
            self._lockfile.close()
            self._lockfile = None

    @property
    def st(self) -> devstack.StackState:
        assert self.state is not None
        return self.state

    @property
    def client(self) -> Api:
        assert self.api is not None
        return self.api

    # ------------------------------------------------------------ processes

    def roots(self) -> dict[str, list[int]]:
        """Sampled process trees: each role (its replicas), postgres, nats."""
        out: dict[str, list[int]] = {}
        for p in self.st.processes():
            if p.alive():
                out.setdefault(p.role, []).append(p.pid)
        pg = int(self.st.postgres.get("pid") or 0)
        if pg:
            out["postgres"] = [pg]
        nats = int(self.st.nats.get("pid") or 0)
        if nats:
            out["nats"] = [nats]
        out["bench-client"] = [os.getpid()]
        return out

    def process_of(self, instance: str) -> ServiceProcess:
        for p in self.st.processes():
            if p.instance == instance:
                return p
        raise BenchError(f"no process {instance} in the stack")

    def api_without(self, *skip: ServiceProcess) -> Api:
        return Api(target_of([p.grpc for p in self.st.processes("api") if p not in skip and p.alive()]),
                   token=self.st.tokens.get("admin", ""), ca_file=self.st.ca_file)

    # ------------------------------------------------------------ SQL

    def sql(self, query: str, params: tuple[Any, ...] | list[Any] = ()) -> list[tuple[Any, ...]]:
        assert self.conn is not None
        with self._lock:
            return list(self.conn.execute(query, params or None).fetchall())  # type: ignore[arg-type]

    def scalar(self, query: str, params: tuple[Any, ...] | list[Any] = ()) -> Any:
        rows = self.sql(query, params)
        return rows[0][0] if rows else None

    def execute(self, statement: str, params: tuple[Any, ...] = ()) -> None:
        assert self.conn is not None
        with self._lock:
            self.conn.execute(statement, params or None)  # type: ignore[arg-type]

    def xid(self) -> int:
        """The next transaction id: the number of write transactions so far (read-only ones
        take none), read without taking one."""
        return int(self.scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"))

    def write_rate(self, seconds: float = 3.0) -> float:
        """Write transactions per second of the idle stack (heartbeats, lease renewals,
        checkpointer ticks): the background subtracted from a scenario's count."""
        x0, t0 = self.xid(), time.monotonic()
        time.sleep(seconds)
        return (self.xid() - x0) / (time.monotonic() - t0)

    def stream_seqs(self) -> dict[str, int]:
        """Last sequence of the runtime's JetStream streams (messages ever stored)."""
        import nats

        async def read() -> dict[str, int]:
            nc = await nats.connect(self.st.nats_user_url(), name="noetl-bench", allow_reconnect=False,
                                    connect_timeout=5, tls=natsio.tls_context(self.st.ca_file))
            try:
                js = nc.jetstream()
                out = {}
                for name in ("NOETL_EVENTS", "NOETL_COMMANDS"):
                    info = await js.stream_info(name)
                    out[name] = int(info.state.last_seq)
                return out
            finally:
                await nc.close()

        return asyncio.run(read())

    # ------------------------------------------------------------ metrics

    def scrape(self, proc: ServiceProcess, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=timeout) as resp:
            return str(resp.read().decode())

    @staticmethod
    def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
        out = []
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
                out.append((labels, float(m.group(2))))
        return out

    # ------------------------------------------------------------ executions

    def submit(self, playbook: str, payload: Mapping[str, Any] | None = None, *, api: Api | None = None,
               timeout: float = 0.0) -> int:
        """Submit with a fresh idempotency key, repeated on a transient failure (one
        execution however many calls it takes: ``grpcretry.call_keyed``)."""
        api = api or self.client
        request = execution_pb2.SubmitExecutionRequest(
            playbook_yaml=playbook, payload=values.to_struct(dict(payload or {})), timeout_seconds=timeout,
            idempotency_key=f"bench-{uuid.uuid4()}")
        resp = grpcretry.call_keyed(lambda left: api.executions.SubmitExecution(request, timeout=left), request,
                                    timeout=60)
        return int(resp.execution_id)

    def watch(self, execution_id: int, deadline: float, *, api: Api | None = None) -> Terminal | None:
        """Follow with WatchExecution until terminal (polling GetExecution if the stream
        breaks); None when the monotonic ``deadline`` passes first."""
        api = api or self.client
        while time.monotonic() < deadline:
            try:
                stream = api.executions.WatchExecution(
                    execution_pb2.WatchExecutionRequest(execution_id=execution_id),
                    timeout=max(0.1, deadline - time.monotonic()))
                try:
                    for resp in stream:
                        ex = resp.execution
                        if ex.status in TERMINAL:
                            return Terminal(execution_id, status_name(ex.status), ex.error, time.monotonic())
                finally:
                    stream.cancel()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                    return None
            got = self.poll_once(execution_id, api=api)
            if got is not None:
                return got
            time.sleep(0.05)
        return None

    def poll_once(self, execution_id: int, *, api: Api | None = None) -> Terminal | None:
        api = api or self.client
        try:
            ex = api.executions.GetExecution(execution_pb2.GetExecutionRequest(execution_id=execution_id),
                                             timeout=10).execution
        except grpc.RpcError:
            return None
        if ex.status in TERMINAL:
            return Terminal(execution_id, status_name(ex.status), ex.error, time.monotonic())
        return None

    def results(self, execution_id: int, *, api: Api | None = None) -> dict[str, Any]:
        """{step: resolved result} of a finished execution (GetExecution include_results)."""
        api = api or self.client
        ex = api.executions.GetExecution(execution_pb2.GetExecutionRequest(
            execution_id=execution_id, include_results=True), timeout=120).execution
        return {s.name: step_result(s) for s in ex.steps}

    def cancel(self, execution_id: int, reason: str = "bench timeout") -> None:
        with contextlib.suppress(Exception):
            self.client.executions.CancelExecution(execution_pb2.CancelExecutionRequest(
                execution_id=execution_id, reason=reason), timeout=10)


@contextlib.contextmanager
def watching(stack: BenchStack, execution_id: int, deadline: float, api: Api | None = None) -> Iterator[list[Any]]:
    """Watch an execution on a thread; the yielded list gets its Terminal (or None) when known."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append(stack.watch(execution_id, deadline, api=api))
        except Exception as exc:  # reported by the scenario
            box.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=run, name=f"watch-{execution_id}", daemon=True)
    t.start()
    try:
        yield box
    finally:
        done.wait(timeout=max(0.0, deadline - time.monotonic()) + 5)
