"""Every dashboard expression, and every alert expression without its threshold, returns
data from a real Prometheus scraping a real local stack that ran conformance playbooks.

The stack: `devstack.up` (Postgres, NATS, the seven roles as processes) with the chart's
ConfigMap and Deployment env rendered from tests/deploy/live-values.yaml, each role
started from the image's venv (deploy/docker/build-venv.sh, the Dockerfile's builder
step) by its image entry point `noetl-<role>`. Prometheus (Debian's package) scrapes the
metrics addresses `noetl-rt dev status --json` reports every 2 seconds, with the target
labels the chart's ServiceMonitor yields in a cluster (`namespace`, `pod`, `component`),
and evaluates the chart's rendered alert rules. While the expressions are queried, a
trickle of executions and gRPC health checks (what kubelet probes do) keeps every rate
and histogram moving.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from conformance_data import PLAYBOOKS  # NOETL_CONFORMANCE_DIR, default ../shared/conformance/noetl-e2e
from deploytools import (
    NAMESPACE,
    REPO,
    ROLE_KEYS,
    ROLES,
    Prometheus,
    alert_rules,
    by_kind,
    dashboard_expressions,
    documents,
    find,
    grafana_to_promql,
    prometheus_server,
    rules_file,
    values_of,
    without_thresholds,
)
from waiting import until_sync

from noetl_cli import devstack
from noetl_cli.client import Api
from noetl_client import values
from noetl_proto.v1 import catalog_pb2, common_pb2, execution_pb2, schedule_pb2

pytestmark = pytest.mark.timeout(1500)

# Upstream conformance playbooks run through the stack (no credentials needed): python
# steps, workbook tasks, exclusive/inclusive arcs, a fan-out/fan-in barrier, sequential and
# parallel loops, and retries of a failing task.
CONFORMANCE = (
    ("hello_world/hello_world.yaml", {}),
    ("control_flow_workbook/control_flow_workbook.yaml", {}),
    ("control_flow_workbook/control_flow_workbook.yaml", {"temperature_c": 10}),
    ("fanout_reduce/fanout_reduce_phase6.yaml", {}),
    ("root_scripts/test_simple_loop.yaml", {}),
    ("loop_test.yaml", {}),
    ("retry_test/python_retry_exception.yaml", {}),
)
TERMINAL = {common_pb2.EXECUTION_STATUS_COMPLETED, common_pb2.EXECUTION_STATUS_FAILED,
            common_pb2.EXECUTION_STATUS_CANCELLED}
# Set by the local stack itself (loopback addresses, its own Postgres/NATS, its own
# certificates and tokens), not the chart: the chart's listen addresses are per pod and its
# TLS files are paths in a pod.
STACK_DECIDES = {"NOETL_GRPC_LISTEN", "NOETL_METRICS_LISTEN", "NOETL_INSTANCE", "NOETL_SHARD_MANAGER_TARGET",
                 "NOETL_API_TARGET", "NOETL_POSTGRES_DSN", "NOETL_NATS_URL", "NOETL_READY_FILE",
                 "NOETL_WORKER_API_LISTEN", "NOETL_WORKER_API_TARGET", "NOETL_HEALTH_LISTEN",
                 "NOETL_AUTH_ENABLED", "NOETL_AUTH_TOKEN", "NOETL_CREDENTIALS_KEYS",
                 "NOETL_TLS_CA_FILE", "NOETL_TLS_CERT_FILE", "NOETL_TLS_KEY_FILE", "NOETL_TLS_CLIENT_AUTH",
                 "NOETL_TLS_SERVER_NAME", "NOETL_NATS_TLS_CA_FILE", "NOETL_NATS_CREDS_FILE"}
QUERY_DEADLINE_SEC = float(os.environ.get("NOETL_CHECK_DEPLOY_QUERY_SEC", "300"))


@dataclass
class Live:
    state: devstack.StackState
    prom: Prometheus
    outcomes: dict[str, str] = field(default_factory=dict)
    rejected: int = 0


def chart_env(rendered: str) -> dict[str, str]:
    """The NOETL_* environment the chart gives the pods: its ConfigMap plus the plain values
    of every Deployment's env, less what the local stack decides itself."""
    docs = documents(rendered)
    env = dict(find(docs, "ConfigMap", f"{NAMESPACE}-config")["data"])
    for dep in by_kind(docs, "Deployment"):
        for entry in dep["spec"]["template"]["spec"]["containers"][0]["env"]:
            if "value" in entry and entry["name"] not in STACK_DECIDES:
                env[entry["name"]] = entry["value"]
    return env


def submit(api: Api, text: str, payload: dict[str, Any] | None = None, *, retry_sec: float = 120) -> int:
    """Submit, waiting out admission control (RESOURCE_EXHAUSTED) up to ``retry_sec``."""
    def admitted() -> int | None:
        try:
            return int(api.executions.SubmitExecution(execution_pb2.SubmitExecutionRequest(
                playbook_yaml=text, payload=values.to_struct(payload or {})), timeout=30).execution_id)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                raise
            return None  # refused by admission control: not yet

    return until_sync(admitted, timeout=retry_sec, what="the submission admitted (RESOURCE_EXHAUSTED until then)",
                      interval=0.5)


def wait_terminal(api: Api, execution_id: int, timeout: float = 180) -> str:
    def done() -> str:
        ex = api.executions.GetExecution(execution_pb2.GetExecutionRequest(
            execution_id=execution_id, include_results=True), timeout=30).execution
        return common_pb2.ExecutionStatus.Name(ex.status) if ex.status in TERMINAL else ""

    return str(until_sync(done, timeout=timeout, what=f"execution {execution_id} to end", interval=0.2))


def provoke_rejections(api: Api, text: str, attempts: int = 6) -> int:
    """Submit bursts past NOETL_EXECUTION_MAX_ACTIVE until admission control refuses some."""
    rejected = 0
    admitted: list[int] = []
    for _ in range(attempts):
        for _ in range(12):
            try:
                admitted.append(int(api.executions.SubmitExecution(execution_pb2.SubmitExecutionRequest(
                    playbook_yaml=text), timeout=30).execution_id))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                    raise
                rejected += 1
        if rejected:
            break
    for eid in admitted:
        wait_terminal(api, eid)
    return rejected


class Trickle(threading.Thread):
    """Keeps executions and health checks flowing while expressions are queried."""

    def __init__(self, home: Path, api_target: str, text: str, token: str, ca_file: str) -> None:
        super().__init__(name="trickle", daemon=True)
        self.home, self.text = home, text
        self.api = Api(api_target, token=token, ca_file=ca_file)
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                eid = submit(self.api, self.text, retry_sec=10)
                deadline = time.monotonic() + 60
                while not self.stop_event.is_set() and time.monotonic() < deadline:
                    ex = self.api.executions.GetExecution(execution_pb2.GetExecutionRequest(
                        execution_id=eid, include_results=True), timeout=30).execution
                    if ex.status in TERMINAL:
                        break
                    self.stop_event.wait(0.3)
                devstack.status(self.home)  # grpc.health.v1 Check on every process, as probes do
            except Exception as exc:  # keep going: the queries judge the result
                self.errors.append(repr(exc))
            self.stop_event.wait(1.0)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(60)
        self.api.close()


def scrape_targets(home: Path) -> list[tuple[str, dict[str, str]]]:
    """Metrics addresses from `noetl-rt dev status --json`, labelled as in a cluster."""
    out = subprocess.run([sys.executable, "-m", "noetl_cli", "dev", "status", "--json", "--home", str(home)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    targets = []
    for role, procs in report["services"].items():
        for p in procs:
            assert p["health"] == "SERVING", p
            targets.append((p["metrics"], {"namespace": NAMESPACE, "component": role, "pod": p["instance"]}))
    return targets


@pytest.fixture(scope="module")
def live(rendered: dict[str, str], image_venv: Path) -> Iterator[Live]:
    vals = values_of("live")
    scale = {r: int(vals[ROLE_KEYS[r]]["replicas"]) for r in ROLES}
    home = Path(tempfile.mkdtemp(prefix="noetl-check-deploy-"))
    os.chmod(home, 0o755)  # Postgres runs as the postgres user when the checks run as root
    entry = {r: [str(image_venv / "bin" / f"noetl-{r}")] for r in ROLES}
    state = devstack.up(home, scale, env=chart_env(rendered["live"]), timeout=300,
                        role_command=lambda role: entry[role])
    trickle: Trickle | None = None
    try:
        with prometheus_server(home / "prometheus", scrape_targets(home), rules_file(rendered["live"])) as prom:
            live = Live(state, prom)
            api = Api(state.api, token=state.tokens.get("admin", ""), ca_file=state.ca_file)
            try:
                hello = (PLAYBOOKS / "hello_world/hello_world.yaml")
                cli = subprocess.run(
                    [sys.executable, "-m", "noetl_cli", "run", str(hello), "--json", "--timeout", "180",
                     "--api", state.api], capture_output=True, text=True, timeout=240, cwd=REPO,
                    env={**os.environ, "NOETL_TOKEN": state.tokens.get("admin", ""),
                         "NOETL_TLS_CA_FILE": state.ca_file})
                live.outcomes["cli: hello_world"] = json.loads(cli.stdout)["status"] if cli.stdout else cli.stderr
                for rel, payload in CONFORMANCE:
                    eid = submit(api, (PLAYBOOKS / rel).read_text(), payload)
                    live.outcomes[f"{rel} {payload or ''}".strip()] = wait_terminal(api, eid)
                live.rejected = provoke_rejections(api, (REPO / "examples" / "hello_world.yaml").read_text())
                # a schedule keeps ticks firing (the reaper's schedule panels)
                api.catalog.RegisterPlaybook(catalog_pb2.RegisterPlaybookRequest(
                    content=(REPO / "examples" / "hello_world.yaml").read_text()), timeout=30)
                api.schedules.AddSchedule(schedule_pb2.AddScheduleRequest(
                    name="live-check", playbook_path="examples/hello_world", interval_ms=2000), timeout=30)
            finally:
                api.close()
            trickle = Trickle(home, state.api, (REPO / "examples" / "hello_world.yaml").read_text(),
                              state.tokens.get("admin", ""), state.ca_file)
            trickle.start()
            yield live
    finally:
        if trickle is not None:
            trickle.stop()
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)


def test_conformance_playbooks_ran_through_the_stack(live: Live) -> None:
    print("\n".join(f"  {name}: {status}" for name, status in live.outcomes.items()))
    retry = "retry_test/python_retry_exception.yaml"
    for name, status in live.outcomes.items():
        if name == retry:  # fails with probability ~0.16 by design (5 attempts at 70% failure)
            assert status in ("EXECUTION_STATUS_COMPLETED", "EXECUTION_STATUS_FAILED"), status
        elif name.startswith("cli:"):
            assert status == "COMPLETED", status
        else:
            assert status == "EXECUTION_STATUS_COMPLETED", (name, status)
    assert live.rejected > 0, "admission control never refused a submission"


def test_every_process_is_scraped(live: Live) -> None:
    expected = {p.instance for p in live.state.processes()}

    def all_up() -> set[str]:
        up = {t["labels"]["pod"] for t in live.prom.targets() if t["health"] == "up"}
        return up if up == expected else set()

    until_sync(all_up, timeout=120, what=f"every target up: {sorted(expected)}", interval=1.0)


def test_every_process_exports_its_build_and_no_created_series(live: Live) -> None:
    """noetl_build_info{role} is 1 on every process, with the target's role; no process
    exports a *_created series (prometheus_client's creation times: off in every role)."""
    expected = {p.instance: p.role for p in live.state.processes()}

    def every_build() -> list[dict[str, Any]]:
        result = live.prom.query("noetl_build_info")
        return result if {r["metric"]["pod"] for r in result} == set(expected) else []

    builds = until_sync(every_build, timeout=120, what=f"noetl_build_info from {sorted(expected)}", interval=1.0)
    for r in builds:
        labels = r["metric"]
        assert labels["role"] == labels["component"] == expected[labels["pod"]], labels
        assert labels["version"] and labels["version"] != "unknown" and labels["python_version"], labels
        assert r["value"][1] == "1", r
    created = live.prom.query('count by (__name__) ({__name__=~".+_created"})')
    assert not created, [r["metric"] for r in created]


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def _query_all(prom: Prometheus, exprs: dict[str, str]) -> dict[str, str]:
    """Poll every expression until it returns a series with a number (not NaN), or the
    deadline passes; returns the failures (name -> why)."""
    pending = dict(exprs)
    why: dict[str, str] = {}
    deadline = time.monotonic() + QUERY_DEADLINE_SEC
    # not waiting.until_sync: this poll reports every expression that failed, not the first
    while pending:
        for name, expr in list(pending.items()):
            try:
                result = prom.query(expr)
            except AssertionError as exc:
                why[name] = str(exc)
                del pending[name]  # a PromQL error does not heal
                continue
            if _has_data(result):
                del pending[name]
                why.pop(name, None)
            else:
                why[name] = "no data" if not result else f"only NaN: {result[:2]}"
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(3)  # the poll's interval: scrapes come every few seconds
    return {name: f"{why[name]}\n      {exprs[name]}" for name in why}


def test_every_dashboard_expression_returns_data(live: Live) -> None:
    exprs = {f"{board} / {panel}": grafana_to_promql(expr) for board, panel, expr in dashboard_expressions()}
    assert len(exprs) > 100
    failures = _query_all(live.prom, exprs)
    assert not failures, f"{len(failures)} of {len(exprs)} dashboard expressions without data:\n" + "\n".join(
        f"  {k}: {v}" for k, v in failures.items())
    print(f"\n  {len(exprs)} dashboard expressions returned data")


def test_every_alert_expression_without_its_threshold_returns_data(live: Live, rendered: dict[str, str]) -> None:
    exprs = {}
    for rule in alert_rules(rendered["live"]):
        parts = without_thresholds(rule["expr"])
        for i, part in enumerate(parts):
            exprs[f"{rule['alert']}" + (f" (part {i + 1} of {len(parts)})" if len(parts) > 1 else "")] = part
    failures = _query_all(live.prom, exprs)
    assert not failures, "alert expressions without data:\n" + "\n".join(f"  {k}: {v}" for k, v in failures.items())
    print(f"\n  {len(exprs)} alert expressions (thresholds removed) returned data")


def test_every_keda_query_returns_data(live: Live, rendered: dict[str, str]) -> None:
    """The ScaledObjects' prometheus queries (workers: queued + running commands; api:
    in-flight executions) return a number on live data."""
    exprs = {f"{so['metadata']['name']} / {t['type']}": t["metadata"]["query"]
             for so in by_kind(documents(rendered["live"]), "ScaledObject") for t in so["spec"]["triggers"]
             if t["type"] == "prometheus"}
    assert len(exprs) == 2, exprs
    failures = _query_all(live.prom, exprs)
    assert not failures, "KEDA queries without data:\n" + "\n".join(f"  {k}: {v}" for k, v in failures.items())
    for name, expr in exprs.items():
        (sample,) = live.prom.query(expr)
        assert float(sample["value"][1]) >= 0, (name, sample)


def test_alert_rules_evaluate_cleanly_on_live_data(live: Live, rendered: dict[str, str]) -> None:
    names = {r["alert"] for r in alert_rules(rendered["live"])}

    def evaluated() -> list[dict[str, Any]]:
        rules = live.prom.rules()
        return rules if {r["name"] for r in rules} == names and all(r.get("lastEvaluation", "").startswith("2")
                                                                    and r["health"] != "unknown" for r in rules) else []

    rules = until_sync(evaluated, timeout=120, what="every rule evaluated", interval=1.0)
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    # A healthy stack under light load fires none of the alerts that wait (`for` > 0); those
    # without a wait (claims expired) may fire on a starved machine and are only reported.
    waits = {r["alert"]: r.get("for", "0m") not in ("0", "0s", "0m") for r in alert_rules(rendered["live"])}
    firing = [(r["name"], [a["labels"] for a in r.get("alerts", [])]) for r in rules if r.get("state") == "firing"]
    print(f"\n  rules: {len(rules)} evaluated, firing: {firing or 'none'}")
    assert not [f for f in firing if waits[f[0]]], firing
