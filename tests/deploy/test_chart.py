"""The Helm chart: lint, render, Kubernetes and CRD schemas, and what the objects must wire
together (ports, probes, targets, Secrets, hooks, labels) for each values set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from deploytools import (
    CHART,
    K8S_VERSIONS,
    NAMESPACE,
    PLANNED_SETTINGS,
    REPO,
    ROLE_KEYS,
    ROLES,
    TOOLS,
    VALUES,
    by_kind,
    documents,
    find,
    helm,
    run,
    tool,
    values_of,
)

VALUE_SETS = ("default", "scale-3", "mtls", "plaintext", "features", "example")
CRD_GROUPS = ("monitoring.coreos.com/", "cert-manager.io/", "keda.sh/", "gateway.networking.k8s.io/")


def _values_args(name: str) -> list[str]:
    return ["--values", str(VALUES[name])] if VALUES[name] is not None else []


@pytest.mark.parametrize("values", [*VALUE_SETS, "live", "lite"])
def test_helm_lint_strict(values: str) -> None:
    out = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *_values_args(values)).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", [*VALUE_SETS, "lite"])
def test_rendered_objects_validate_against_kubernetes_schemas(rendered: dict[str, str], values: str, version: str,
                                                              tmp_path: Any) -> None:
    docs = [d for d in documents(rendered[values]) if not d["apiVersion"].startswith(CRD_GROUPS)]
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    proc = run([tool("kubernetes-validate"), "--kubernetes-version", version, "--strict", str(path)],
               check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    passed = [line for line in proc.stdout.splitlines() if line.startswith("INFO") and " passed " in line]
    assert len(passed) == len(docs), proc.stdout  # every object had a schema and passed it


@pytest.mark.parametrize(("values", "kinds"), [
    ("scale-3", ["PrometheusRule", "ServiceMonitor"]),
    ("mtls", ["Certificate"] * len(ROLES) + ["ServiceMonitor"]),
    ("features", ["BackendTLSPolicy", "GRPCRoute", "ScaledObject", "ScaledObject", "TriggerAuthentication",
                  *["Certificate"] * len(ROLES)]),
    ("example", ["PrometheusRule", "ScaledObject", "ServiceMonitor", *["Certificate"] * len(ROLES)])])
def test_custom_resources_validate_against_crd_schemas(rendered: dict[str, str], values: str,
                                                       kinds: list[str]) -> None:
    """ServiceMonitor and PrometheusRule against the prometheus-operator monitoring.coreos.com/v1
    schemas (@kubernetes-models/prometheus-operator), the cert-manager Certificates against
    cert-manager.io/v1 (@kubernetes-models/cert-manager), KEDA's ScaledObject and
    TriggerAuthentication against keda.sh/v1alpha1 (@kubernetes-models/keda), the GRPCRoute
    and BackendTLSPolicy against gateway.networking.k8s.io/v1 (@kubernetes-models/gateway-api):
    types, required fields, enums, patterns (e.g. durations, key usages). Those schemas do not
    reject unknown fields (test_chart_features.py checks the KEDA triggers' metadata, a free
    string map in the CRD, against a schema of its own)."""
    crs = [d for d in documents(rendered[values]) if d["apiVersion"].startswith(CRD_GROUPS)]
    assert sorted(d["kind"] for d in crs) == sorted(kinds)
    for package in ("prometheus-operator", "cert-manager", "keda", "gateway-api"):
        node_modules = TOOLS / "node" / "node_modules" / "@kubernetes-models" / package
        assert node_modules.exists(), f"run `make deploy-tools` (npm @kubernetes-models/{package})"
    proc = subprocess.run(["node", str(REPO / "scripts" / "validate_crds.mjs")], input=json.dumps(crs),
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK ") == len(kinds), proc.stdout


def test_optional_custom_resources_are_off_by_default(rendered: dict[str, str]) -> None:
    kinds = {d["kind"] for d in documents(rendered["default"])}
    assert not {"ServiceMonitor", "PrometheusRule", "Certificate", "ScaledObject", "GRPCRoute", "BackendTLSPolicy",
                "Ingress"} & kinds


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_one_deployment_per_role_wired_for_the_runtime(rendered: dict[str, str], values: str) -> None:
    docs = documents(rendered[values])
    vals = values_of(values)
    grpc_port, metrics_port = vals["ports"]["grpc"], vals["ports"]["metrics"]
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    config = find(docs, "ConfigMap", f"{NAMESPACE}-config")
    deployments = by_kind(docs, "Deployment")
    assert sorted(d["metadata"]["name"] for d in deployments) == sorted(f"noetl-{r}" for r in ROLES)
    for role in ROLES:
        rv = vals[ROLE_KEYS[role]]
        dep = find(docs, "Deployment", f"noetl-{role}")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of"):
            assert key in dep["metadata"]["labels"], (role, key)
        assert labels["app.kubernetes.io/component"] == role
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        if vals["autoscaling"].get(role, {}).get("enabled"):
            assert "replicas" not in dep["spec"], role  # the HPA KEDA creates owns the count
        else:
            assert dep["spec"]["replicas"] == rv["replicas"]
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        (c,) = pod["containers"]
        image = f"{vals['image']['repository']}-{role}:{vals['image']['tag'] or '0.1.0'}"
        if vals["global"]["imageRegistry"]:
            image = f"{vals['global']['imageRegistry']}/{image}"
        if ROLE_KEYS[role] in vals["image"]["digests"]:
            image += "@" + vals["image"]["digests"][ROLE_KEYS[role]]
        assert c["image"] == image, c["image"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["resources"] == rv["resources"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        tls = vals["tls"]["enabled"]
        expected_ports = {"grpc": grpc_port, "metrics": metrics_port}
        if tls:
            expected_ports["health"] = vals["ports"]["health"]
        if role == "api":
            expected_ports["worker-api"] = vals["ports"]["workerApi"]
        assert ports == expected_ports, role
        env = _env(c)
        # listen where the probes and Services look
        assert env["NOETL_GRPC_LISTEN"]["value"] == f"0.0.0.0:{grpc_port}"
        assert env["NOETL_METRICS_LISTEN"]["value"] == f"0.0.0.0:{metrics_port}"
        # the kubelet's gRPC probes cannot speak TLS: with TLS on they ask the plaintext
        # health-only port, else the gRPC port
        probe_port = vals["ports"]["health"] if tls else grpc_port
        if tls:
            assert env["NOETL_HEALTH_LISTEN"]["value"] == f"0.0.0.0:{probe_port}", role
        else:
            assert "NOETL_HEALTH_LISTEN" not in env, role
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": probe_port}, (role, probe)
        # liveness asks the health service that stays SERVING while the process answers: an
        # outage of Postgres makes replicas unready, it does not restart them
        assert c["livenessProbe"]["grpc"] == {"port": probe_port, "service": "noetl.liveness"}, role
        assert env["NOETL_INSTANCE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        # credentials only from Secrets
        dsn = env["NOETL_POSTGRES_DSN"]
        pg = vals["postgres"]
        assert dsn["valueFrom"]["secretKeyRef"] == {
            "name": pg["roleSecrets"].get(ROLE_KEYS[role], pg["existingSecret"]),
            "key": pg["dsnKeys"][ROLE_KEYS[role]]}, role
        if "NOETL_NATS_URL" in env and vals["nats"]["existingSecret"]:
            assert "secretKeyRef" in env["NOETL_NATS_URL"]["valueFrom"]
        for name, entry in env.items():
            if "value" in entry:
                assert "@" not in entry["value"] and "password" not in entry["value"].lower(), (role, name)
        assert c["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
        # gRPC targets: dns:/// over a headless Service exposing the gRPC port
        targets = {"NOETL_SHARD_MANAGER_TARGET": ("shard-manager", "grpc")} if role != "shard-manager" else {}
        if role in ("worker", "reaper"):  # sub-playbooks; the ticks of schedules
            targets["NOETL_API_TARGET"] = ("api", "grpc")
        if role == "worker":
            targets["NOETL_WORKER_API_TARGET"] = ("api", "worker-api")
            assert env["NOETL_WORKER_CONCURRENCY"]["value"] == str(rv["concurrency"])
        for name, (target_role, port_name) in targets.items():
            svc_name = f"noetl-{target_role}-headless"
            port = next(p for p in find(docs, "Deployment", f"noetl-{target_role}")["spec"]["template"]["spec"][
                "containers"][0]["ports"] if p["name"] == port_name)["containerPort"]
            assert env[name]["value"] == f"dns:///{svc_name}.{NAMESPACE}.svc.cluster.local:{port}"
            svc = services[svc_name]
            assert svc["spec"]["clusterIP"] == "None"
            assert svc["spec"]["selector"].items() <= find(docs, "Deployment", f"noetl-{target_role}")[
                "spec"]["template"]["metadata"]["labels"].items()
            assert {"name": port_name, "port": port, "targetPort": port_name}.items() <= next(
                p for p in svc["spec"]["ports"] if p["name"] == port_name).items()
        # every role's metrics port is behind its headless Service
        svc = services[f"noetl-{role}-headless"]
        assert any(p["name"] == "metrics" and p["port"] == metrics_port for p in svc["spec"]["ports"])
        # PodDisruptionBudget
        pdb = find(docs, "PodDisruptionBudget", f"noetl-{role}")
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # the clients' Service: the client port only (the WorkerService is for the workers)
    api = services["noetl-api"]
    assert api["spec"]["type"] == "ClusterIP"
    assert [p["targetPort"] for p in api["spec"]["ports"]] == ["grpc"]


def test_scale_3_values_scale_every_role(rendered: dict[str, str]) -> None:
    docs = documents(rendered["scale-3"])
    assert {d["metadata"]["name"]: d["spec"]["replicas"] for d in by_kind(docs, "Deployment")} == {
        f"noetl-{r}": 3 for r in ROLES}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_migration_job_is_a_pre_install_and_pre_upgrade_hook(rendered: dict[str, str], values: str) -> None:
    docs = documents(rendered[values])
    (job,) = by_kind(docs, "Job")
    ann = job["metadata"]["annotations"]
    assert set(ann["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in ann["helm.sh/hook-delete-policy"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    vals = values_of(values)
    if vals["auth"]["enabled"] and vals["auth"]["register"]:
        # migrate, then register the tokens (test_security.py checks which)
        assert c["command"][:2] == ["sh", "-ec"] and c["command"][2].startswith("noetl-rt migrate\n"), c["command"]
    else:
        assert c["command"] == ["noetl-rt", "migrate"]
    assert c["image"] == find(docs, "Deployment", "noetl-api")["spec"]["template"]["spec"]["containers"][0]["image"]
    # the schema owner's DSN
    assert _env(c)["NOETL_POSTGRES_DSN"]["valueFrom"]["secretKeyRef"] == {
        "name": vals["postgres"]["existingSecret"], "key": vals["postgres"]["ownerDsnKey"]}
    # a pre-install hook runs before the release's ConfigMap/ServiceAccount exist
    assert "envFrom" not in c and "serviceAccountName" not in pod


def test_servicemonitor_selects_the_headless_services_metrics_port(rendered: dict[str, str]) -> None:
    docs = documents(rendered["scale-3"])
    (sm,) = by_kind(docs, "ServiceMonitor")
    selector = sm["spec"]["selector"]["matchLabels"]
    selected = [s for s in by_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert sorted(s["metadata"]["name"] for s in selected) == sorted(f"noetl-{r}-headless" for r in ROLES)
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # the dashboards and alerts group by the `component` target label
    assert any(r.get("targetLabel") == "component" for r in endpoint["relabelings"])
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_dashboards_ship_as_configmaps_for_the_grafana_sidecar(rendered: dict[str, str], values: str) -> None:
    maps = [c for c in by_kind(documents(rendered[values]), "ConfigMap")
            if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(k for c in maps for k in c["data"]) == files
    assert len(files) == 1 + len(ROLES)
    for c in maps:
        for text in c["data"].values():
            assert json.loads(text)["uid"].startswith("noetl-")


def test_config_map_settings_are_known_and_valid(rendered: dict[str, str]) -> None:
    """Every NOETL_* name the chart sets is a field of one of the runtime's settings classes,
    and every value loads (pydantic validation, as each role's main() does)."""
    from noetl_common import config as cfg

    classes = [cfg.CoreSettings, cfg.ShardSettings, cfg.CommandSettings, cfg.ExecutionSettings,
               cfg.ProjectionSettings, cfg.CheckpointSettings, cfg.CompactorSettings, cfg.ResultStoreSettings,
               cfg.WorkerSettings, cfg.TracingSettings, cfg.AuthSettings, cfg.TlsSettings, cfg.CredentialSettings,
               cfg.NatsSettings, cfg.LimitSettings]
    known = {f"{c.model_config.get('env_prefix', '')}{f}".upper() for c in classes for f in c.model_fields}
    # a planned name must not be read already (then it belongs out of PLANNED_SETTINGS)
    assert not PLANNED_SETTINGS & known, sorted(PLANNED_SETTINGS & known)
    for values in (*VALUE_SETS, "live", "lite"):
        docs = documents(rendered[values])
        env: dict[str, str] = dict(find(docs, "ConfigMap", f"{NAMESPACE}-config")["data"])
        for dep in by_kind(docs, "Deployment"):
            for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]:
                env.setdefault(e["name"], e.get("value", "placeholder"))
        unknown = sorted(n for n in env if n.startswith("NOETL_") and n not in known | PLANNED_SETTINGS)
        assert not unknown, f"{values}: settings the runtime does not read: {unknown}"
        env.update({"NOETL_RESULT_S3_ACCESS_KEY": "a", "NOETL_RESULT_S3_SECRET_KEY": "s"})
        saved = dict(os.environ)
        try:
            os.environ.update(env)
            for c in classes:
                cfg.load(c)  # raises ConfigError naming the variable
        finally:
            os.environ.clear()
            os.environ.update(saved)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_tracing_settings_reach_every_role(rendered: dict[str, str], values: str) -> None:
    """tracing.* becomes NOETL_OTEL_* in the ConfigMap (off by default); collector headers
    come only from a Secret, and only with the otlp exporter."""
    docs = documents(rendered[values])
    tracing = values_of(values)["tracing"]
    data = find(docs, "ConfigMap", f"{NAMESPACE}-config")["data"]
    assert data["NOETL_OTEL_EXPORTER"] == tracing["exporter"]
    assert data.get("NOETL_OTEL_ENDPOINT", "") == tracing["endpoint"]
    assert float(data["NOETL_OTEL_SAMPLE_RATIO"]) == float(tracing["sampleRatio"])
    for role in ROLES:
        (c,) = find(docs, "Deployment", f"noetl-{role}")["spec"]["template"]["spec"]["containers"]
        headers = _env(c).get("OTEL_EXPORTER_OTLP_HEADERS")
        if tracing["existingSecret"] and tracing["exporter"] == "otlp":
            assert headers is not None and headers["valueFrom"]["secretKeyRef"] == {
                "name": tracing["existingSecret"], "key": tracing["headersKey"]}, role
        else:
            assert headers is None, role
    if values == "default":
        assert data["NOETL_OTEL_EXPORTER"] == "none"


def test_values_schema_refuses_credentials_and_chart_owned_settings() -> None:
    bad = {
        "config.NOETL_POSTGRES_DSN=host=x password=y": "NOETL_POSTGRES_DSN",
        "config.NOETL_GRPC_LISTEN=0.0.0.0:1": "NOETL_GRPC_LISTEN",
        "nats.url=nats://user:pw@nats:4222": "nats.url",
        "tracing.endpoint=https://user:pw@collector:4318": "tracing.endpoint",
        "tracing.exporter=otlp": "tracing",
        "config.NOETL_OTEL_EXPORTER=console": "NOETL_OTEL_EXPORTER",
        "worker.replicas=-1": "worker.replicas",
        "api.bogus=1": "bogus",
        "config.NOETL_AUTH_TOKEN=noetl_x": "NOETL_AUTH_TOKEN",
        "config.NOETL_CREDENTIALS_KEYS=k1:AAAA": "NOETL_CREDENTIALS_KEYS",
        "config.NOETL_AUTH_ENABLED=false": "NOETL_AUTH_ENABLED",
        "worker.env.NOETL_TLS_CA_FILE=/tmp/ca.crt": "NOETL_TLS_CA_FILE",
        "api.env.NOETL_WORKER_API_LISTEN=0.0.0.0:1": "NOETL_WORKER_API_LISTEN",
        "nats.urlKeys.worker=": "nats.urlKeys.worker",
        "postgres.dsnKeys.worker=": "postgres.dsnKeys.worker",
        "tls.certManager.privateKey.algorithm=DSA": "tls.certManager.privateKey.algorithm",
        "networkPolicy.bogus=1": "bogus",
    }
    for setting, why in bad.items():
        proc = run([tool("helm"), "template", "x", str(CHART), "--set", setting], check=False, timeout=60)
        assert proc.returncode != 0, setting
        assert why in proc.stderr, (setting, proc.stderr)


def test_notes_tell_how_to_submit_a_first_execution(tmp_path: Any) -> None:
    """NOTES.txt, rendered in the chart's context (helm shows notes only on a real install:
    a copy of the chart wraps them in a ConfigMap that `helm template` renders)."""
    chart = tmp_path / "noetl"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_for_test.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "\n{{- end -}}\n")
    (chart / "templates" / "notes-for-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: |-\n    {{- include "test.notes" . | nindent 4 }}\n')
    out = helm("template", "noetl", str(chart), "--namespace", NAMESPACE,
               "--show-only", "templates/notes-for-test.yaml").stdout
    text = yaml.safe_load(out)["data"]["notes"]
    assert f"kubectl -n {NAMESPACE} port-forward svc/noetl-api 50051:50051" in text, text
    assert "noetl-rt run examples/hello_world.yaml --api localhost:50051" in text, text
    assert f"kubectl -n {NAMESPACE} scale deploy/noetl-worker --replicas=4" in text, text
    # the admin token and the CA the CLI needs with the default (secure) values
    assert f"export NOETL_TOKEN=$(kubectl -n {NAMESPACE} get secret noetl-auth -o jsonpath='{{.data.admin}}'" in text, text
    assert "export NOETL_TLS_CA_FILE=" in text, text
    assert (REPO / "examples" / "hello_world.yaml").exists()


def test_chart_packages_with_its_dashboards(tmp_path: Any) -> None:
    helm("package", str(CHART), "--destination", str(tmp_path))
    (pkg,) = tmp_path.glob("noetl-*.tgz")
    docs = documents(helm("template", "noetl", str(pkg), "--namespace", NAMESPACE).stdout)
    maps = [c for c in by_kind(docs, "ConfigMap") if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(maps) == 1 + len(ROLES)
