"""The chart's extension points (issue 17): the image registry and digests, extra env,
volumes and objects, pod labels and annotations per role, KEDA autoscaling of the workers
and the api, and the api behind an Ingress or a Gateway API GRPCRoute. Each is rendered on
(`ci/features-values.yaml`, and `--set` variations) and its fields checked; bad values are
refused by the schema or the chart's checks, naming the value."""

from __future__ import annotations

from typing import Any

import pytest
from deploytools import (
    CHART,
    NAMESPACE,
    ROLE_KEYS,
    ROLES,
    by_kind,
    documents,
    find,
    helm,
    json_schema_errors,
    run,
    tool,
    values_of,
)

from noetl_common import natsio, pools

DIGEST = "sha256:" + "ab" * 32


def _render(*args: str) -> list[dict[str, Any]]:
    return documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, *args).stdout)


def _refused(*args: str) -> str:
    proc = run([tool("helm"), "template", "noetl", str(CHART), "-n", NAMESPACE, *args], check=False, timeout=60)
    assert proc.returncode != 0, f"rendered: {args}"
    return proc.stderr


def _container(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (c,) = find(docs, "Deployment", f"noetl-{role}")["spec"]["template"]["spec"]["containers"]
    return c


def _pod(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return find(docs, "Deployment", f"noetl-{role}")["spec"]["template"]


# ---------------------------------------------------------------- images


def test_image_registry_and_digest_per_role() -> None:
    docs = _render("--set", "global.imageRegistry=mirror.example.com:5000/dockerhub/",
                   "--set", f"image.digests.worker={DIGEST}", "--set", f"image.digests.api={DIGEST}")
    for role in ROLES:
        image = _container(docs, role)["image"]
        expected = f"mirror.example.com:5000/dockerhub/noetl-runtime-{role}:0.1.0"
        assert image == (expected + f"@{DIGEST}" if role in ("api", "worker") else expected), image
    # the migration Job runs the api's image, pinned the same way
    (job,) = by_kind(docs, "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == _container(docs, "api")["image"]


@pytest.mark.parametrize(("setting", "field"), [
    ("image.digests.worker=sha256:abc", "digests"),
    ("image.digests.bogus=" + DIGEST, "bogus"),
    ("global.imageRegistry=reg.example.com/x:tag", "imageRegistry"),
])
def test_schema_refuses_bad_image_values(setting: str, field: str) -> None:
    assert field in _refused("--set", setting)


# ---------------------------------------------------------------- extra env, volumes, labels, objects


def test_extra_env_volumes_and_labels_per_role(rendered: dict[str, str]) -> None:
    docs = documents(rendered["features"])
    vals = values_of("features")
    for role in ROLES:
        rv = vals[ROLE_KEYS[role]]
        c = _container(docs, role)
        template = _pod(docs, role)
        names = [e["name"] for e in c["env"]]
        extra = [*vals["extraEnv"], *rv["extraEnv"]]
        # after the chart's own, global first, each once
        assert c["env"][-len(extra):] == extra, role
        assert len(names) == len(set(names)), role
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        for vol in [*vals["extraVolumes"], *rv["extraVolumes"]]:
            assert volumes[vol["name"]] == vol, role
        for mount in [*vals["extraVolumeMounts"], *rv["extraVolumeMounts"]]:
            assert mounts[mount["name"]] == mount, role
        # the chart's mounts are still there and still read-only
        assert mounts["tmp"]["mountPath"] == "/tmp" and mounts["tls"]["readOnly"] is True
        labels = template["metadata"]["labels"]
        assert {**vals["podLabels"], **rv["podLabels"]}.items() <= labels.items(), role
        annotations = template["metadata"]["annotations"]
        assert {**vals["podAnnotations"], **rv["podAnnotations"]}.items() <= annotations.items(), role
    worker = _pod(docs, "worker")
    assert worker["metadata"]["labels"]["example.com/pool"] == "batch"
    assert "example.com/pool" not in _pod(docs, "api")["metadata"]["labels"]
    assert "scratch" not in {v["name"] for v in _pod(docs, "api")["spec"]["volumes"]}


def test_pod_labels_cannot_move_a_pod_out_of_its_selector() -> None:
    docs = _render("--set", "podLabels.app\\.kubernetes\\.io/component=other",
                   "--set", "worker.podLabels.app\\.kubernetes\\.io/instance=other")
    for role in ROLES:
        dep = find(docs, "Deployment", f"noetl-{role}")
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_extra_objects_are_rendered_through_tpl(rendered: dict[str, str]) -> None:
    docs = documents(rendered["features"])
    cm = find(docs, "ConfigMap", "corp-settings")
    assert cm["metadata"]["namespace"] == NAMESPACE and cm["data"] == {"region": "eu-west-1"}
    auth = find(docs, "TriggerAuthentication", "noetl-prometheus")
    assert auth["metadata"]["namespace"] == NAMESPACE


def test_migration_pod_annotations(rendered: dict[str, str]) -> None:
    (job,) = by_kind(documents(rendered["features"]), "Job")
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["sidecar.istio.io/inject"] == "false"
    assert annotations["example.com/owner"] == "platform"  # the global podAnnotations too
    (job,) = by_kind(documents(rendered["default"]), "Job")
    assert "annotations" not in job["spec"]["template"]["metadata"]


@pytest.mark.parametrize(("setting", "field"), [
    # names the chart sets or takes from Secrets
    ('extraEnv=[{"name": "NOETL_POSTGRES_DSN", "value": "host=x"}]', "extraEnv"),
    ('worker.extraEnv=[{"name": "NOETL_TLS_CA_FILE", "value": "/tmp/ca"}]', "worker.extraEnv"),
    ('api.extraEnv=[{"name": "NOETL_CREDENTIALS_KEYS", "value": "k"}]', "api.extraEnv"),
    ('extraEnv=[{"name": "OTEL_EXPORTER_OTLP_HEADERS", "value": "a=b"}]', "extraEnv"),
    ('extraEnv=[{"name": "X", "bogus": "1"}]', "bogus"),
    # the node's file system, the chart's own volumes and mount points
    ('extraVolumes=[{"name": "host", "hostPath": {"path": "/"}}]', "hostPath"),
    ('worker.extraVolumes=[{"name": "tls", "emptyDir": {}}]', "worker.extraVolumes"),
    ('extraVolumeMounts=[{"name": "x", "mountPath": "/etc/noetl/tls"}]', "mountPath"),
    ('extraVolumeMounts=[{"name": "x", "mountPath": "/tmp"}]', "mountPath"),
    ('extraObjects=[1]', "extraObjects"),
])
def test_schema_refuses_extras_that_would_weaken_the_pods(setting: str, field: str) -> None:
    assert field in _refused("--set-json", setting)


@pytest.mark.parametrize(("settings", "message"), [
    (['extraVolumes=[{"name": "a", "emptyDir": {}}]', 'worker.extraVolumes=[{"name": "a", "emptyDir": {}}]'],
     'the volume name "a" is used twice in the worker role'),
    (['extraVolumeMounts=[{"name": "nope", "mountPath": "/x"}]'],
     'the api role mounts a volume "nope" that neither extraVolumes nor api.extraVolumes defines'),
])
def test_refuses_inconsistent_extra_volumes(settings: list[str], message: str) -> None:
    args = [a for s in settings for a in ("--set-json", s)]
    assert message in _refused(*args)


# ---------------------------------------------------------------- KEDA

# The parameters of the two KEDA scalers the chart uses (keda.sh/docs/2.x/scalers/prometheus,
# /nats-jetstream): the CRD keeps a trigger's metadata as a free map of strings, so this
# schema is ours: every key known to the scaler, the required ones present, numbers as
# strings.
_NUMBER = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
_BOOL = {"type": "string", "enum": ["true", "false"]}
TRIGGER_SCHEMA = {
    "type": "object",
    "required": ["type", "metadata"],
    "properties": {"authenticationRef": {"type": "object", "required": ["name"],
                                         "properties": {"name": {"type": "string", "minLength": 1}}}},
    "oneOf": [
        {"properties": {"type": {"const": "prometheus"}, "metadata": {
            "type": "object", "additionalProperties": False,
            "required": ["serverAddress", "query", "threshold"],
            "properties": {"serverAddress": {"type": "string", "pattern": "^https?://"},
                           "query": {"type": "string", "minLength": 1}, "threshold": _NUMBER,
                           "activationThreshold": _NUMBER, "ignoreNullValues": _BOOL, "unsafeSsl": _BOOL,
                           "namespace": {"type": "string"}, "customHeaders": {"type": "string"},
                           "queryParameters": {"type": "string"}, "timeout": _NUMBER}}}},
        {"properties": {"type": {"const": "nats-jetstream"}, "metadata": {
            "type": "object", "additionalProperties": False,
            "required": ["natsServerMonitoringEndpoint", "account", "stream", "consumer", "lagThreshold"],
            "properties": {"natsServerMonitoringEndpoint": {"type": "string", "pattern": "^[^/:]+(:[0-9]+)?$"},
                           "account": {"type": "string", "minLength": 1}, "stream": {"type": "string"},
                           "consumer": {"type": "string"}, "lagThreshold": _NUMBER,
                           "activationLagThreshold": _NUMBER, "useHttps": _BOOL}}}},
    ],
}


def _scaled(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return find(docs, "ScaledObject", f"noetl-{role}")


def test_trigger_schema_is_strict() -> None:
    """The schema above can fail: a misspelt or missing parameter, a number not a string."""
    good = {"type": "prometheus", "metadata": {"serverAddress": "http://p:9090", "query": "1", "threshold": "8"}}
    assert json_schema_errors(TRIGGER_SCHEMA, good) == []
    assert json_schema_errors(TRIGGER_SCHEMA, {**good, "metadata": {**good["metadata"], "treshold": "8"}})
    assert json_schema_errors(TRIGGER_SCHEMA, {**good, "metadata": {**good["metadata"], "threshold": 8}})
    assert json_schema_errors(TRIGGER_SCHEMA, {"type": "nats-jetstream", "metadata": {"stream": "s"}})


def test_keda_scaled_objects(rendered: dict[str, str]) -> None:
    docs = documents(rendered["features"])
    vals = values_of("features")
    auto = vals["autoscaling"]
    for role in ("worker", "api"):
        so = _scaled(docs, role)
        spec = so["spec"]
        a = auto[role]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"noetl-{role}"}
        find(docs, "Deployment", f"noetl-{role}")  # the target exists
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (a["minReplicas"], a["maxReplicas"])
        assert spec["pollingInterval"] == a["pollingInterval"] and spec["cooldownPeriod"] == a["cooldownPeriod"]
        assert so["metadata"]["labels"]["app.kubernetes.io/component"] == role
        for trigger in spec["triggers"]:
            assert json_schema_errors(TRIGGER_SCHEMA, trigger) == [], trigger
        # the Deployment leaves the count to the HPA KEDA makes
        assert "replicas" not in find(docs, "Deployment", f"noetl-{role}")["spec"]
    worker = _scaled(docs, "worker")["spec"]
    assert worker["fallback"] == {"failureThreshold": 3, "replicas": 2}
    assert worker["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == auto["worker"]["behavior"]
    prom, *nats_triggers = worker["triggers"]
    sel = f'namespace="{NAMESPACE}"'
    assert prom["type"] == "prometheus" and prom["metadata"]["query"] == (
        f"(max(noetl_queued_commands{{{sel}}}) or vector(0)) + (sum(noetl_worker_busy{{{sel}}}) or vector(0))")
    # a worker's share: as many commands as it has slots
    assert prom["metadata"]["threshold"] == str(vals["worker"]["concurrency"])
    assert prom["authenticationRef"] == {"name": "noetl-prometheus"}
    find(docs, "TriggerAuthentication", "noetl-prometheus")
    # the runtime's own stream and the durable consumers of the workers' pool, one per priority
    pool = str(vals["worker"]["pool"]).split(",")[0].strip()
    assert [(t["type"], t["metadata"]["stream"], t["metadata"]["consumer"]) for t in nats_triggers] == [
        ("nats-jetstream", natsio.COMMANDS_STREAM, pools.consumer_name(pool, p)) for p in pools.PRIORITIES]
    assert all(t["metadata"]["lagThreshold"] == str(vals["worker"]["concurrency"]) for t in nats_triggers)
    (api,) = _scaled(docs, "api")["spec"]["triggers"]
    assert api["metadata"]["query"] == f"max(noetl_active_executions{{{sel}}}) or vector(0)"
    assert api["metadata"]["threshold"] == "1500"


def test_keda_queries_read_metrics_the_runtime_exports(rendered: dict[str, str], tmp_path: Any) -> None:
    """The queries parse (promtool, as recording rules) and read only exported metrics."""
    from test_dashboards import _series_names, exported_metrics

    docs = documents(rendered["features"])
    queries = [t["metadata"]["query"] for role in ("worker", "api")
               for t in _scaled(docs, role)["spec"]["triggers"] if t["type"] == "prometheus"]
    assert len(queries) == 2
    exported = exported_metrics()
    for q in queries:
        assert _series_names(q) and _series_names(q) <= set(exported), q
    rules = tmp_path / "keda.yaml"
    rules.write_text("groups:\n  - name: keda\n    rules:\n" + "".join(
        f"      - record: noetl:keda_{i}\n        expr: '{q}'\n" for i, q in enumerate(queries)))
    run([tool("promtool"), "check", "rules", str(rules)], timeout=60)


def test_keda_query_and_thresholds_from_values() -> None:
    docs = _render("--set", "autoscaling.worker.enabled=true", "--set", "autoscaling.worker.prometheus.query="
                   'sum(noetl_worker_busy{namespace="{{ .Release.Namespace }}"})',
                   "--set", "autoscaling.worker.prometheus.threshold=5.5", "--set", "worker.concurrency=3")
    (t,) = _scaled(docs, "worker")["spec"]["triggers"]
    assert t["metadata"]["query"] == f'sum(noetl_worker_busy{{namespace="{NAMESPACE}"}})'
    assert t["metadata"]["threshold"] == "5.5"
    assert "fallback" not in _scaled(docs, "worker")["spec"]
    # api without the worker; no KEDA object for a role that is not enabled
    docs = _render("--set", "autoscaling.api.enabled=true")
    assert [s["metadata"]["name"] for s in by_kind(docs, "ScaledObject")] == ["noetl-api"]
    assert find(docs, "Deployment", "noetl-worker")["spec"]["replicas"] == 2


@pytest.mark.parametrize(("settings", "message"), [
    (["autoscaling.worker.enabled=true", "autoscaling.worker.prometheus.enabled=false"],
     "autoscaling.worker.enabled needs a trigger"),
    (["autoscaling.worker.enabled=true", "autoscaling.worker.minReplicas=5", "autoscaling.worker.maxReplicas=2"],
     "autoscaling.worker.maxReplicas (2) is below autoscaling.worker.minReplicas (5)"),
    (["autoscaling.api.enabled=true", "autoscaling.api.maxReplicas=17"],
     "autoscaling.api.maxReplicas (17) is above NOETL_SHARD_COUNT (16)"),
    (["autoscaling.api.minReplicas=0"], "autoscaling.api.minReplicas"),
    (["autoscaling.worker.prometheus.threshold=eight"], "autoscaling.worker.prometheus.threshold"),
    (["autoscaling.worker.natsJetstream.monitoringEndpoint=http://nats:8222"], "monitoringEndpoint"),
    (["autoscaling.worker.bogus=1"], "bogus"),
])
def test_refuses_bad_autoscaling_values(settings: list[str], message: str) -> None:
    assert message in _refused(*[a for s in settings for a in ("--set", s)])


# ---------------------------------------------------------------- Ingress and GRPCRoute


def _only_the_client_port(backend_service: str, port: Any, docs: list[dict[str, Any]]) -> None:
    svc = find(docs, "Service", backend_service)
    assert backend_service == "noetl-api" and svc["spec"]["type"] == "ClusterIP"
    (svc_port,) = svc["spec"]["ports"]
    assert port in (svc_port["name"], svc_port["port"]) and svc_port["targetPort"] == "grpc"


def test_ingress_tls_passthrough(rendered: dict[str, str]) -> None:
    docs = documents(rendered["features"])
    vals = values_of("features")
    ing = find(docs, "Ingress", "noetl-api")
    assert ing["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/ssl-passthrough": "true"}
    assert ing["spec"]["ingressClassName"] == "nginx" and "tls" not in ing["spec"]
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == vals["api"]["ingress"]["host"]
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    _only_the_client_port(path["backend"]["service"]["name"], path["backend"]["service"]["port"]["name"], docs)
    # the api terminates the clients' TLS itself: its certificate names the Ingress host
    cert = find(docs, "Certificate", "noetl-api")["spec"]
    assert rule["host"] in cert["dnsNames"]
    assert not [c for c in by_kind(docs, "Certificate") if c["metadata"]["name"] != "noetl-api"
                and rule["host"] in c["spec"]["dnsNames"]]


def test_ingress_terminate_reencrypts_and_verifies_the_api() -> None:
    docs = _render("--set", "api.ingress.enabled=true", "--set", "api.ingress.host=noetl.example.com",
                   "--set", "api.ingress.tlsMode=terminate", "--set", "api.ingress.secretName=noetl-public-tls",
                   "--set", "api.ingress.backendCaSecret=noetl-ca", "--set", "api.ingress.annotations.a=b")
    ing = find(docs, "Ingress", "noetl-api")
    assert ing["metadata"]["annotations"] == {
        "a": "b",
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPCS",
        "nginx.ingress.kubernetes.io/proxy-ssl-verify": "on",
        "nginx.ingress.kubernetes.io/proxy-ssl-secret": f"{NAMESPACE}/noetl-ca",
        "nginx.ingress.kubernetes.io/proxy-ssl-name": f"noetl-api.{NAMESPACE}.svc.cluster.local",
        "nginx.ingress.kubernetes.io/proxy-ssl-server-name": "on",
    }
    assert ing["spec"]["tls"] == [{"hosts": ["noetl.example.com"], "secretName": "noetl-public-tls"}]
    # the name nginx verifies is one the api's certificate has (tls.existingSecret: documented;
    # cert-manager: rendered)
    docs = _render("--set", "api.ingress.enabled=true", "--set", "api.ingress.host=noetl.example.com",
                   "--set", "api.ingress.tlsMode=terminate", "--set", "api.ingress.secretName=s",
                   "--set", "api.ingress.backendCaSecret=noetl-ca", "--set", "tls.certManager.enabled=true",
                   "--set", "tls.certManager.issuerRef.name=ca")
    name = find(docs, "Ingress", "noetl-api")["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-ssl-name"]
    assert name in find(docs, "Certificate", "noetl-api")["spec"]["dnsNames"]
    # no TLS to the api: plain gRPC (h2c), nothing to verify; other controllers: no nginx annotations
    docs = _render("--values", str(CHART / "ci" / "plaintext-values.yaml"), "--set", "api.ingress.enabled=true",
                   "--set", "api.ingress.host=h.example.com", "--set", "api.ingress.tlsMode=terminate",
                   "--set", "api.ingress.secretName=s")
    assert find(docs, "Ingress", "noetl-api")["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPC"}
    docs = _render("--set", "api.ingress.enabled=true", "--set", "api.ingress.host=h.example.com",
                   "--set", "api.ingress.nginxAnnotations=false")
    assert "annotations" not in find(docs, "Ingress", "noetl-api")["metadata"]


def test_grpc_route_and_backend_tls_policy(rendered: dict[str, str]) -> None:
    docs = documents(rendered["features"])
    vals = values_of("features")["api"]["grpcRoute"]
    route = find(docs, "GRPCRoute", "noetl-api")["spec"]
    assert route["parentRefs"] == vals["parentRefs"] and route["hostnames"] == vals["hostnames"]
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    _only_the_client_port(backend["name"], backend["port"], docs)
    policy = find(docs, "BackendTLSPolicy", "noetl-api")["spec"]
    assert policy["targetRefs"] == [{"group": "", "kind": "Service", "name": "noetl-api"}]
    assert policy["validation"]["caCertificateRefs"] == vals["backendTLS"]["caCertificateRefs"]
    # the Gateway verifies a name the api's certificate has
    assert policy["validation"]["hostname"] in find(docs, "Certificate", "noetl-api")["spec"]["dnsNames"]
    # without TLS to the api there is nothing to verify: no policy
    docs = _render("--values", str(CHART / "ci" / "plaintext-values.yaml"), "--set", "api.grpcRoute.enabled=true",
                   "--set-json", 'api.grpcRoute.parentRefs=[{"name": "gw"}]')
    assert by_kind(docs, "GRPCRoute") and not by_kind(docs, "BackendTLSPolicy")
    docs = _render("--set", "api.grpcRoute.enabled=true", "--set-json", 'api.grpcRoute.parentRefs=[{"name": "gw"}]',
                   "--set", "api.grpcRoute.backendTLS.wellKnownCACertificates=System",
                   "--set", "api.grpcRoute.backendTLS.apiVersion=gateway.networking.k8s.io/v1alpha3")
    policy = find(docs, "BackendTLSPolicy", "noetl-api")
    assert policy["apiVersion"] == "gateway.networking.k8s.io/v1alpha3"
    assert policy["spec"]["validation"]["wellKnownCACertificates"] == "System"
    assert policy["spec"]["targetRefs"][0]["sectionName"] == "grpc"


@pytest.mark.parametrize(("settings", "message"), [
    (["api.ingress.enabled=true"], "api.ingress.host is empty"),
    (["api.ingress.enabled=true", "api.ingress.host=h.example.com", "tls.enabled=false"],
     "api.ingress.tlsMode=passthrough needs tls.enabled"),
    (["api.ingress.enabled=true", "api.ingress.host=h.example.com", "api.ingress.tlsMode=terminate"],
     "api.ingress.secretName is empty"),
    (["api.ingress.enabled=true", "api.ingress.host=h.example.com", "api.ingress.tlsMode=terminate",
      "api.ingress.secretName=s"], "api.ingress.backendCaSecret is empty"),
    (["api.ingress.enabled=true", "api.ingress.host=h.example.com", "api.ingress.tlsMode=terminate",
      "api.ingress.secretName=s", "api.ingress.backendCaSecret=c", "tls.clientAuth=true"],
     "api.ingress.tlsMode=terminate cannot be used with tls.clientAuth"),
    (["api.ingress.tlsMode=reencrypt"], "api.ingress.tlsMode"),
    (["api.ingress.host=Not_A_Host"], "api.ingress.host"),
    (["api.grpcRoute.enabled=true"], "api.grpcRoute.parentRefs is empty"),
    (["api.grpcRoute.enabled=true", "api.grpcRoute.parentRefs[0].name=gw"],
     "api.grpcRoute.backendTLS.caCertificateRefs is empty"),
    (["api.grpcRoute.enabled=true", "api.grpcRoute.parentRefs[0].name=gw", "tls.clientAuth=true",
      "api.grpcRoute.backendTLS.wellKnownCACertificates=System"], "api.grpcRoute cannot be used with tls.clientAuth"),
    (["api.grpcRoute.hostnames[0]=bad host"], "api.grpcRoute.hostnames"),
])
def test_refuses_bad_ingress_and_route_values(settings: list[str], message: str) -> None:
    assert message in _refused(*[a for s in settings for a in ("--set", s)])
