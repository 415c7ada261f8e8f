"""Helpers of the deployment checks (``make check-deploy``): the tools in ``.tools/``
(scripts/deploy_tools.sh installs them), rendering the chart, reading rendered objects,
PromQL expressions of the dashboards and alerts, and a real Prometheus server."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from waiting import until_sync

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / ".tools"
CHART = REPO / "deploy" / "helm" / "noetl"
DASHBOARDS = CHART / "dashboards"
EXAMPLES = REPO / "deploy" / "helm" / "examples"
HERE = Path(__file__).resolve().parent
ROLES = ("api", "shard-manager", "projector", "checkpointer", "compactor", "reaper", "worker")
ROLE_KEYS = {r: ("shardManager" if r == "shard-manager" else r) for r in ROLES}
NAMESPACE = "noetl"
RELEASE = "noetl"
# Values files rendered by the checks: the chart's defaults (TLS, tokens, NetworkPolicies
# on), every role at 3 replicas with every optional object on and every Secret named,
# mutual TLS with cert-manager Certificates, every security default off, every extension
# point on (extra env/volumes/objects, digests, KEDA, Ingress, GRPCRoute), the local
# stack's settings (live metrics check), lite mode (one evaluation pod), and the values of
# the NATS-chart + CloudNativePG recipes (deploy/helm/examples/).
VALUES = {"default": None, "scale-3": CHART / "ci" / "scale-3-values.yaml",
          "mtls": CHART / "ci" / "mtls-values.yaml", "plaintext": CHART / "ci" / "plaintext-values.yaml",
          "features": CHART / "ci" / "features-values.yaml", "live": HERE / "live-values.yaml",
          "lite": EXAMPLES / "lite-values.yaml", "example": EXAMPLES / "noetl-values.yaml"}
# NOETL_* settings the chart sets that the runtime does not read yet (docs/DEPLOY.md
# "Security" marks them planned); remove each name as the runtime lands it.
PLANNED_SETTINGS: frozenset[str] = frozenset()
# Kubernetes versions the rendered objects are validated against (oldest supported, newest packaged).
K8S_VERSIONS = ("1.30.0", "1.37.0")


class ToolMissing(AssertionError):
    pass


def tool(name: str) -> str:
    """Path of a deployment tool: ``.tools/bin/<name>``, else the PATH (promtool, prometheus)."""
    local = TOOLS / "bin" / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    raise ToolMissing(f"{name} is not installed: run `make deploy-tools` (scripts/deploy_tools.sh)")


def run(argv: Sequence[str], *, timeout: float = 300, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def helm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run([tool("helm"), *args], timeout=timeout)


def render(values: str, *extra: str) -> str:
    """``helm template`` of the chart with one of VALUES, as YAML text."""
    argv = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if VALUES[values] is not None:
        argv += ["--values", str(VALUES[values])]
    return helm(*argv, *extra).stdout


def json_schema_errors(schema: Mapping[str, Any], instance: Any) -> list[str]:
    """Errors of ``instance`` against a JSON schema (draft 2020-12), by the `jsonschema`
    package that kubernetes-validate brings into .tools/venv: one line per error, with
    the path of the offending field."""
    python = TOOLS / "venv" / "bin" / "python"
    if not python.exists():
        raise ToolMissing("the .tools/venv python is not installed: run `make deploy-tools`")
    code = ("import json, sys, jsonschema\n"
            "d = json.load(sys.stdin)\n"
            "v = jsonschema.Draft202012Validator(d['schema'])\n"
            "for e in sorted(v.iter_errors(d['instance']), key=lambda e: list(e.absolute_path)):\n"
            "    print('/'.join(map(str, e.absolute_path)) + ': ' + e.message)\n")
    proc = run([str(python), "-c", code], input=json.dumps({"schema": schema, "instance": instance}), timeout=60)
    return [line for line in proc.stdout.splitlines() if line]


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def find(docs: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind}/{name} among {[(d['kind'], d['metadata']['name']) for d in docs]}")


def values_of(name: str) -> dict[str, Any]:
    """The chart's default values merged with a values file (dicts merged, the rest replaced)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    if VALUES[name] is not None:
        _merge(merged, yaml.safe_load(Path(VALUES[name]).read_text()) or {})  # type: ignore[arg-type]
    return merged


def _merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


# ---------------------------------------------------------------- PromQL


def dashboard_expressions() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every dashboard."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, f"{panel['title']} [{target['refId']}]", target["expr"]))
    return out


GRAFANA_VARS = {"$namespace": ".*", "$__rate_interval": "1m", "${namespace}": ".*"}


def grafana_to_promql(expr: str) -> str:
    """Replace the dashboards' variables as Grafana would with every namespace selected and
    a 15 s scrape interval (the chart's ServiceMonitor default): ``$__rate_interval`` is 1m."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    left = re.findall(r"\$\{?\w+", expr)
    assert not left, f"unknown dashboard variable(s) {left} in {expr}"
    return expr


_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*(bool\s+)?-?\d+(\.\d+)?(e[+-]?\d+)?(?![\w.])")


def without_thresholds(expr: str) -> list[str]:
    """An alert expression with its numeric comparisons removed, split at a top-level
    ``unless`` (whose sides must each have data; together they are empty when healthy)."""
    bare = _COMPARISON.sub("", expr)
    parts, depth, start = [], 0, 0
    i = 0
    while i < len(bare):
        c = bare[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and bare.startswith("unless", i) and (i == 0 or not bare[i - 1].isalnum()):
            parts.append(bare[start:i])
            # skip `unless on (...)` / `unless ignoring (...)`
            rest = bare[i + len("unless"):]
            m = re.match(r"\s*(on|ignoring)\s*\([^)]*\)", rest)
            i += len("unless") + (m.end() if m else 0)
            start = i
            continue
        i += 1
    parts.append(bare[start:])
    return [p.strip() for p in parts if p.strip()]


def alert_rules(rendered: str) -> list[dict[str, Any]]:
    rule = by_kind(documents(rendered), "PrometheusRule")
    assert len(rule) == 1, "expected one PrometheusRule"
    return [r for g in rule[0]["spec"]["groups"] for r in g["rules"] if "alert" in r]


def rules_file(rendered: str) -> str:
    """The PrometheusRule's spec as a plain Prometheus rules file."""
    rule = by_kind(documents(rendered), "PrometheusRule")
    assert len(rule) == 1, "expected one PrometheusRule"
    return yaml.safe_dump({"groups": rule[0]["spec"]["groups"]}, sort_keys=False)


# ---------------------------------------------------------------- Prometheus server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises on a PromQL error (parse error, bad function...)."""
        try:
            data = self.get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"query failed ({exc.code}): {exc.read().decode()[:500]}\n{expr}") from None
        assert data["resultType"] == "vector", data["resultType"]
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/targets")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.get("/api/v1/rules")["groups"] for r in g["rules"]]


@contextmanager
def prometheus_server(workdir: Path, scrape_targets: Sequence[tuple[str, Mapping[str, str]]],
                      rules_yaml: str = "", *, scrape_interval: str = "2s") -> Iterator[Prometheus]:
    """Run Debian's prometheus on a free loopback port, scraping ``scrape_targets``
    ([(host:port, target labels)]) and evaluating ``rules_yaml``; stop it on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                   "scrape_timeout": scrape_interval},
        "scrape_configs": [{"job_name": "noetl", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [addr], "labels": dict(labels)}
                                               for addr, labels in scrape_targets]}],
    }
    if rules_yaml:
        (workdir / "rules.yaml").write_text(rules_yaml)
        config["rule_files"] = [str(workdir / "rules.yaml")]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    run([tool("promtool"), "check", "config", str(workdir / "prometheus.yml")], timeout=60)
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen(
        [tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--storage.tsdb.retention.time=2h", "--web.console.templates=/nonexistent",
         "--web.console.libraries=/nonexistent"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        def ready() -> bool:
            if proc.poll() is not None:  # not a "not yet": fails at once
                raise AssertionError(f"prometheus exited {proc.returncode}:\n{(workdir / 'prometheus.log').read_text()[-3000:]}")
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as resp:
                return bool(resp.status == 200)

        until_sync(ready, timeout=120, what="prometheus ready", interval=0.5, ignoring=OSError)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "no")
