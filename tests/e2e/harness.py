"""End-to-end helpers: the seven roles as separate OS processes (the same launcher as
`noetl-rt dev up`), a real Postgres and a real NATS JetStream on free loopback ports,
and a small gRPC client that runs playbooks and returns resolved results."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import conformance_data
import grpc
import psycopg
from waiting import until_sync

from noetl_cli import devstack
from noetl_cli.client import Api
from noetl_client import step_result, values
from noetl_common import grpcretry
from noetl_proto.v1 import common_pb2, execution_pb2

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {common_pb2.EXECUTION_STATUS_COMPLETED, common_pb2.EXECUTION_STATUS_FAILED,
            common_pb2.EXECUTION_STATUS_CANCELLED}

# Settings that make failover and sweeps quick in tests (all overridable by the env).
FAST_ENV = {
    "NOETL_SHARD_HEARTBEAT_SEC": "1",
    "NOETL_SHARD_LEASE_SEC": "3",
    "NOETL_EXECUTION_SWEEP_INTERVAL_SEC": "0.5",
    "NOETL_COMMAND_LEASE_SEC": "5",
    "NOETL_COMMAND_REPUBLISH_AFTER_SEC": "3",
    "NOETL_LOG_LEVEL": "INFO",
}

# Credentials the conformance playbooks name; the harness points them at the test Postgres.
CREDENTIALS = ("pg_local", "pg_noetl_k8s", "pg_k8s")
# the postgres tool's value for one INSERT of one row: upstream's Rust shape at the top,
# its Python reference's per statement (services/worker/noetl_worker/tools/postgres.py)
INSERTED_ONE = {"status": "ok", "row_count": 1,
                "command_0": {"status": "success", "row_count": 1, "message": "INSERT 0 1"}}


@dataclass
class Outcome:
    execution_id: int
    status: str
    error: str
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)

    def result(self, step: str) -> Any:
        return self.steps[step]["result"]


class Runner:
    def __init__(self, state: devstack.StackState) -> None:
        self.state = state
        self.api = Api(state.api, token=state.tokens.get("admin", ""), ca_file=state.ca_file)

    def submit(self, text: str, payload: dict[str, Any] | None = None, *, key: str = "",
               timeout: float = 0.0) -> execution_pb2.SubmitExecutionResponse:
        """Submit with ``key`` (or a fresh one), repeated on a transient failure as the
        project's clients do (``grpcretry.call_keyed``): one execution however many calls."""
        request = execution_pb2.SubmitExecutionRequest(
            playbook_yaml=text, payload=values.to_struct(payload or {}), idempotency_key=key or f"e2e-{uuid.uuid4()}",
            timeout_seconds=timeout)
        return grpcretry.call_keyed(lambda left: self.api.executions.SubmitExecution(request, timeout=left), request,
                                    timeout=30)

    def wait(self, execution_id: int, timeout: float = 60.0) -> Outcome:
        def ended() -> Outcome:
            ex = self.api.executions.GetExecution(
                execution_pb2.GetExecutionRequest(execution_id=execution_id, include_results=True), timeout=10
            ).execution
            assert ex.status in TERMINAL, f"{common_pb2.ExecutionStatus.Name(ex.status)} {[s.name for s in ex.steps]}"
            steps = {s.name: {"status": common_pb2.StepStatus.Name(s.status).removeprefix("STEP_STATUS_"),
                              "result": step_result(s),
                              "error": s.error, "visits": s.visits, "attempts": s.attempts}
                     for s in ex.steps}
            return Outcome(execution_id, common_pb2.ExecutionStatus.Name(ex.status).removeprefix(
                "EXECUTION_STATUS_"), ex.error, steps)

        return until_sync(ended, timeout=timeout, what=f"execution {execution_id} to end", ignoring=AssertionError)

    def run(self, playbook: str | Path, payload: dict[str, Any] | None = None, timeout: float = 60.0) -> Outcome:
        text = Path(playbook).read_text() if isinstance(playbook, Path) else playbook
        return self.wait(self.submit(text, payload).execution_id, timeout)

    def events(self, execution_id: int) -> list[execution_pb2.EventRecord]:  # type: ignore[name-defined]
        return list(self.api.executions.GetEvents(
            execution_pb2.GetEventsRequest(execution_id=execution_id, page_size=10_000), timeout=10).events)

    def sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.state.postgres_dsn, autocommit=True) as conn:
            return list(conn.execute(query, params).fetchall())

    def cli(self, *args: str, timeout: float = 120.0) -> Any:
        import subprocess

        env = {**os.environ, "NOETL_API": self.state.api, "NOETL_TOKEN": self.state.tokens.get("admin", ""),
               "NOETL_TLS_CA_FILE": self.state.ca_file}
        return subprocess.run([sys.executable, "-m", "noetl_cli", *args], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=str(REPO))


def start_stack(home: Path, scale: dict[str, int] | None = None,
                env: dict[str, str] | None = None, **up: Any) -> devstack.StackState:
    """``devstack.up`` with FAST_ENV under ``env``; ``up`` passes on (e.g. role_postgres_dsn)."""
    merged = {**FAST_ENV, **(env or {})}
    return devstack.up(home, scale, env=merged, timeout=120, **up)


def conformance(rel: str) -> Path:
    """An upstream playbook, read in place (skips the test when the data is not there)."""
    return conformance_data.playbook(rel)


def rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None  # type: ignore[attr-defined]


# ---------------------------------------------------------------- loops, pagination, composition
# (helpers for test_loops.py, test_pagination.py, test_composition.py)


def execute(runner: Runner, statement: str, params: tuple[Any, ...] = ()) -> None:
    """Run a statement that returns no rows (DDL, DML) on the stack's Postgres."""
    with psycopg.connect(runner.state.postgres_dsn, autocommit=True) as conn:
        conn.execute(statement, params)  # type: ignore[arg-type]


def put_credential(runner: Runner, name: str) -> None:
    """Register a postgres credential `name` pointing at the stack's Postgres."""
    from noetl_proto.v1 import catalog_pb2

    runner.api.credentials.PutCredential(catalog_pb2.PutCredentialRequest(
        name=name, kind="postgres", data=values.to_struct({"dsn": runner.state.postgres_dsn})), timeout=10)


def register_playbook(runner: Runner, playbook: Path) -> Any:
    """Register a playbook file in the catalog (CatalogService.RegisterPlaybook); returns the entry."""
    from noetl_proto.v1 import catalog_pb2

    return runner.api.catalog.RegisterPlaybook(
        catalog_pb2.RegisterPlaybookRequest(content=playbook.read_text()), timeout=30).entry


def cancel(runner: Runner, execution_id: int, reason: str = "cancelled by test") -> bool:
    return bool(runner.api.executions.CancelExecution(execution_pb2.CancelExecutionRequest(
        execution_id=execution_id, reason=reason), timeout=10).accepted)


def event_counts(runner: Runner, execution_id: int, step: str | None = None) -> dict[str, int]:
    """{event_type: count} in noetl.event for one execution (optionally one step)."""
    rows = runner.sql("SELECT event_type, count(*) FROM noetl.event WHERE execution_id = %s"
                      " AND (%s::text IS NULL OR step = %s) GROUP BY event_type",
                      (execution_id, step, step))
    return {str(t): int(n) for t, n in rows}


def accepted_iterations(runner: Runner, execution_id: int, step: str) -> list[int]:
    """The loop iteration indexes the accepted results of ``step`` cover, sorted, one entry
    per acceptance: a ``call.done``/``call.error`` event answers for ``meta.index`` (and the
    ``meta.count`` - 1 after it, for a batch of iterations). Exactly once each: ``range(n)``."""
    rows = runner.sql("SELECT (meta->>'index')::int, COALESCE((meta->>'count')::int, 1) FROM noetl.event"
                      " WHERE execution_id = %s AND step = %s AND event_type IN ('call.done', 'call.error')"
                      " AND meta ? 'index'", (execution_id, step))
    return sorted(i for index, count in rows for i in range(index, index + count))


def command_counts(runner: Runner, execution_id: int) -> dict[str, int]:
    """{status: count} of noetl.command rows for one execution."""
    rows = runner.sql("SELECT status, count(*) FROM noetl.command WHERE execution_id = %s GROUP BY status",
                      (execution_id,))
    return {str(s): int(n) for s, n in rows}


def meta(event: Any) -> dict[str, Any]:
    return values.from_struct(event.meta)


def worker_busy(state: devstack.StackState) -> float:
    """Commands the stack's workers are running now (sum of their `noetl_worker_busy` gauges)."""
    return metric_sum(state, "worker", "noetl_worker_busy")


def metric_sum(state: devstack.StackState, role: str, name: str) -> float:
    """The sum of every sample of metric `name` (any labels) over the role's live processes."""
    import urllib.request

    total = 0.0
    for proc in state.processes(role):
        if not proc.metrics or not proc.alive():
            continue
        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith((f"{name} ", f"{name}{{")):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def worker_log(state: devstack.StackState) -> str:
    return "".join(Path(p.log).read_text(errors="replace") for p in state.processes("worker") if p.log)
