"""The chart's security wiring (issue 12; docs/DEPLOY.md "Security"), for every values set:
which role gets which Secret (and which never does), the token Secret and its registration,
the per-role certificates, the refusals when a Secret is not named or missing, and what the
NetworkPolicies let through (evaluated by a small model of NetworkPolicy semantics)."""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from deploytools import (
    CHART,
    NAMESPACE,
    REPO,
    ROLE_KEYS,
    ROLES,
    by_kind,
    documents,
    find,
    helm,
    run,
    tool,
    values_of,
)

SETS = ("default", "scale-3", "mtls", "plaintext", "features", "example")
NATS_ROLES = ("api", "projector", "checkpointer", "reaper", "worker")
TOKEN_KEYS = (*ROLES, "admin")
TLS_DIR = "/etc/noetl/tls"


def _pod(docs: Sequence[dict[str, Any]], role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = find(docs, "Deployment", f"noetl-{role}")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def _env(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_ref(entry: Mapping[str, Any]) -> tuple[str, str]:
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def _secrets_read(pod: Mapping[str, Any], container: Mapping[str, Any]) -> set[tuple[str, str]]:
    """Every (Secret, key) a pod can read: env secretKeyRefs and secret volumes' items."""
    out = {_secret_ref(e) for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    for vol in pod.get("volumes", []):
        if "secret" in vol:
            items = vol["secret"].get("items")
            assert items, f"secret volume {vol['name']} mounts every key of {vol['secret']['secretName']}"
            out |= {(vol["secret"]["secretName"], i["key"]) for i in items}
    return out


def _tls_secret(vals: Mapping[str, Any], role: str) -> str:
    tls = vals["tls"]
    if tls["certManager"]["enabled"]:
        return f"noetl-{role}-tls"
    return str(tls["roleSecrets"].get(ROLE_KEYS[role], tls["existingSecret"]))


def _expected_secrets(vals: Mapping[str, Any], role: str) -> set[tuple[str, str]]:
    """What each role needs, and nothing more."""
    key = ROLE_KEYS[role]
    pg = vals["postgres"]
    out = {(pg["roleSecrets"].get(key, pg["existingSecret"]), pg["dsnKeys"][key])}
    if vals["auth"]["enabled"]:
        out.add((vals["auth"]["existingSecret"] or "noetl-auth", role))
    if vals["tls"]["enabled"]:
        out |= {(_tls_secret(vals, role), k) for k in ("tls.crt", "tls.key", "ca.crt")}
    if role == "api":
        out.add((vals["credentials"]["existingSecret"], vals["credentials"]["keysKey"]))
    if pg["ca"]["existingSecret"]:
        out.add((pg["ca"]["existingSecret"], pg["ca"]["key"]))
    nats = vals["nats"]
    if role in NATS_ROLES:
        if nats["existingSecret"]:
            out.add((nats["existingSecret"], nats["urlKeys"][key]))
        if nats["ca"]["existingSecret"]:
            out.add((nats["ca"]["existingSecret"], nats["ca"]["key"]))
        if nats["credsSecret"]:
            out.add((nats["credsSecret"], f"{role}.creds"))
    s3 = vals["resultStore"]["s3"]
    if s3["existingSecret"] and role in ("api", "worker"):
        out |= {(s3["existingSecret"], s3["accessKeyKey"]), (s3["existingSecret"], s3["secretKeyKey"])}
    tracing = vals["tracing"]
    if tracing["existingSecret"] and tracing["exporter"] == "otlp":
        out.add((tracing["existingSecret"], tracing["headersKey"]))
    return out


# ---------------------------------------------------------------- what each role gets


@pytest.mark.parametrize("values", SETS)
def test_each_role_reads_only_the_secrets_it_uses(rendered: dict[str, str], values: str) -> None:
    """A role's pod can read exactly the Secret keys its role needs: the credentials master
    key only on api pods, each role its own token, DSN, NATS URL and certificate."""
    docs = documents(rendered[values])
    vals = values_of(values)
    for role in ROLES:
        pod, c = _pod(docs, role)
        assert _secrets_read(pod, c) == _expected_secrets(vals, role), role


@pytest.mark.parametrize("values", SETS)
def test_identity_and_tls_env_per_role(rendered: dict[str, str], values: str) -> None:
    docs = documents(rendered[values])
    vals = values_of(values)
    auth, tls = vals["auth"], vals["tls"]
    for role in ROLES:
        pod, c = _pod(docs, role)
        env = _env(c)
        # tokens: on, each role's own key of the tokens Secret
        assert env["NOETL_AUTH_ENABLED"]["value"] == str(auth["enabled"]).lower(), role
        if auth["enabled"]:
            assert _secret_ref(env["NOETL_AUTH_TOKEN"]) == (auth["existingSecret"] or "noetl-auth", role)
        else:
            assert "NOETL_AUTH_TOKEN" not in env, role
        # the credentials master key: api pods only
        if role == "api":
            assert _secret_ref(env["NOETL_CREDENTIALS_KEYS"]) == (vals["credentials"]["existingSecret"],
                                                                  vals["credentials"]["keysKey"])
        else:
            assert "NOETL_CREDENTIALS_KEYS" not in env, role
        # TLS files: in the role's TLS Secret volume, mounted read-only
        tls_env = {n: e["value"] for n, e in env.items() if n.startswith("NOETL_TLS_")}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        if tls["enabled"]:
            assert tls_env["NOETL_TLS_CA_FILE"] == f"{TLS_DIR}/ca.crt"
            assert tls_env["NOETL_TLS_CERT_FILE"] == f"{TLS_DIR}/tls.crt"
            assert tls_env["NOETL_TLS_KEY_FILE"] == f"{TLS_DIR}/tls.key"
            assert tls_env["NOETL_TLS_CLIENT_AUTH"] == str(tls["clientAuth"]).lower()
            assert tls_env.get("NOETL_TLS_SERVER_NAME", "") == tls["serverName"]
            assert mounts["tls"] == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
            secret = volumes["tls"]["secret"]
            assert secret["secretName"] == _tls_secret(vals, role)
            assert {i["path"] for i in secret["items"]} == {"tls.crt", "tls.key", "ca.crt"}
            assert secret["defaultMode"] & 0o007 == 0, "TLS files readable by others"
        else:
            assert not tls_env and "tls" not in mounts and "tls" not in volumes, role
        # NATS: only the roles that use it
        nats_env = {n for n in env if n.startswith("NOETL_NATS_")}
        if role in NATS_ROLES:
            assert "NOETL_NATS_URL" in nats_env, role
            if vals["nats"]["existingSecret"]:
                assert _secret_ref(env["NOETL_NATS_URL"]) == (vals["nats"]["existingSecret"],
                                                              vals["nats"]["urlKeys"][ROLE_KEYS[role]])
        else:
            assert not nats_env and not {"nats-ca", "nats-creds"} & set(volumes), role
        # every file a setting names is in a mounted volume
        for name, entry in env.items():
            path = entry.get("value", "")
            if name.endswith("_FILE") and path:
                assert any(path.startswith(m["mountPath"] + "/") for m in c["volumeMounts"]), (role, name, path)


@pytest.mark.parametrize("values", SETS)
def test_no_secret_value_is_inline(rendered: dict[str, str], values: str) -> None:
    """No token, key, password or private key in any rendered object but the generated
    tokens Secret: env values, the ConfigMap, the Job's script are all free of them."""
    docs = documents(rendered[values])
    # random token text (metric names like noetl_engine_events_total are lower case)
    token = re.compile(r"noetl_[A-Za-z0-9_-]*[A-Z0-9][A-Za-z0-9_-]*")
    generated = [base64.b64decode(v).decode() for s in by_kind(docs, "Secret") for v in s["data"].values()]
    for doc in docs:
        if doc["kind"] == "Secret":
            assert doc["metadata"]["name"] == "noetl-auth", doc["metadata"]["name"]
            continue
        text = yaml.safe_dump(doc)
        assert not [m for m in token.findall(text) if len(m) >= 38], (doc["kind"], doc["metadata"]["name"])
        assert not [g for g in generated if g in text], (doc["kind"], doc["metadata"]["name"])
        assert "PRIVATE KEY" not in text and "password=" not in text.lower(), (doc["kind"], doc["metadata"]["name"])
    data = find(documents(rendered[values]), "ConfigMap", f"{NAMESPACE}-config")["data"]
    secretish = re.compile(r"DSN|URL|SECRET|PASSWORD|TOKEN|KEY|CREDENTIAL|HEADERS")
    assert not [n for n in data if secretish.search(n) and n != "NOETL_OTEL_ENDPOINT"], sorted(data)


def test_worker_api_port_is_for_the_workers(rendered: dict[str, str]) -> None:
    docs = documents(rendered["default"])
    vals = values_of("default")
    port = vals["ports"]["workerApi"]
    for role in ROLES:
        env = _env(_pod(docs, role)[1])
        assert ("NOETL_WORKER_API_LISTEN" in env) == (role == "api"), role
        assert ("NOETL_WORKER_API_TARGET" in env) == (role == "worker"), role
    assert _env(_pod(docs, "api")[1])["NOETL_WORKER_API_LISTEN"]["value"] == f"0.0.0.0:{port}"
    assert _env(_pod(docs, "worker")[1])["NOETL_WORKER_API_TARGET"]["value"].endswith(
        f"noetl-api-headless.{NAMESPACE}.svc.cluster.local:{port}")
    assert port not in [p["port"] for p in find(docs, "Service", "noetl-api")["spec"]["ports"]]


# ---------------------------------------------------------------- tokens


@pytest.mark.parametrize("values", ["default", "mtls"])
def test_generated_tokens_secret_is_a_hook_before_the_migration(rendered: dict[str, str], values: str) -> None:
    docs = documents(rendered[values])
    (secret,) = by_kind(docs, "Secret")
    (job,) = by_kind(docs, "Job")
    ann = secret["metadata"]["annotations"]
    assert set(ann["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert int(ann["helm.sh/hook-weight"]) < int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
    # recreated with the looked-up values on upgrade; never deleted after the hook ran
    assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation"
    tokens = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(tokens) == set(TOKEN_KEYS)
    for key, value in tokens.items():
        # noetl_common.auth.register_token: `noetl_` + at least 32 random characters
        assert re.fullmatch(r"noetl_[A-Za-z0-9]{43}", value), key
    assert len(set(tokens.values())) == len(tokens)
    # kept across upgrades: the template reuses what it looks up
    source = (CHART / "templates" / "auth-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in source and "index $old $key" in source


def test_existing_tokens_secret_is_not_rendered(rendered: dict[str, str]) -> None:
    assert values_of("scale-3")["auth"]["existingSecret"]
    assert not by_kind(documents(rendered["scale-3"]), "Secret")
    assert not by_kind(documents(rendered["plaintext"]), "Secret")


def _register_lines(job: Mapping[str, Any]) -> dict[str, str]:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return dict(re.findall(r"^\s*register (\S+) (\S+)$", c["command"][2], re.M))


@pytest.mark.parametrize("values", ["default", "scale-3", "mtls"])
def test_migration_job_registers_each_token_with_its_role(rendered: dict[str, str], values: str) -> None:
    docs = documents(rendered[values])
    vals = values_of(values)
    (job,) = by_kind(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert _register_lines(job) == {**{r: "service" for r in ROLES if r != "worker"}, "worker": "worker",
                                    "admin": "admin"}
    script = c["command"][2]
    assert 'noetl-rt token register --role "$2" --name "$name" < "/etc/noetl/auth/$1"' in script
    # idempotent on upgrades: the runtime's refusal of a known token (noetl_common.auth) is success
    import inspect

    from noetl_common import auth
    assert "a live token has that name, or the token is known" in inspect.getsource(auth.register_token)
    assert '*"a live token has that name, or the token is known"*) echo' in script
    assert script.index("noetl-rt migrate") < script.index("register api")
    auth = next(v for v in pod["volumes"] if v["name"] == "auth")["secret"]
    assert auth["secretName"] == (vals["auth"]["existingSecret"] or "noetl-auth")
    assert {"name": "auth", "mountPath": "/etc/noetl/auth", "readOnly": True} in c["volumeMounts"]
    # the Job talks to Postgres only: the owner DSN, nothing else secret
    assert _secrets_read(pod, c) - {(auth["secretName"], k) for k in TOKEN_KEYS} == {
        (vals["postgres"]["existingSecret"], vals["postgres"]["ownerDsnKey"])} | (
        {(vals["postgres"]["ca"]["existingSecret"], vals["postgres"]["ca"]["key"])}
        if vals["postgres"]["ca"]["existingSecret"] else set())
    assert not {n for n in _env(c) if n.startswith(("NOETL_TLS_", "NOETL_AUTH_", "NOETL_CREDENTIALS"))}


def test_migration_job_without_admin_token_or_registration() -> None:
    docs = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--set", "auth.bootstrapAdmin=false").stdout)
    (job,) = by_kind(docs, "Job")
    assert "admin" not in _register_lines(job)
    (auth,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    assert "admin" not in {i["key"] for i in auth["secret"]["items"]}
    docs = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--set", "auth.register=false").stdout)
    (job,) = by_kind(docs, "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["noetl-rt", "migrate"]
    assert "auth" not in {v["name"] for v in job["spec"]["template"]["spec"]["volumes"]}


# ---------------------------------------------------------------- certificates


def test_certificates_name_only_their_roles_services(rendered: dict[str, str]) -> None:
    docs = documents(rendered["mtls"])
    vals = values_of("mtls")
    certs = {c["metadata"]["name"]: c["spec"] for c in by_kind(docs, "Certificate")}
    assert set(certs) == {f"noetl-{r}" for r in ROLES}
    for role in ROLES:
        spec = certs[f"noetl-{role}"]
        pod, _ = _pod(docs, role)
        tls_volume = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert spec["secretName"] == tls_volume["secret"]["secretName"]
        services = [f"noetl-{role}-headless"] + (["noetl-api"] if role == "api" else [])
        names = [f"{s}{suffix}" for s in services
                 for suffix in ("", f".{NAMESPACE}", f".{NAMESPACE}.svc", f".{NAMESPACE}.svc.cluster.local")]
        if role == "api":
            names += ["localhost", *vals["tls"]["certManager"]["extraDnsNames"]]
            assert spec["ipAddresses"] == ["127.0.0.1"]  # the CLI through kubectl port-forward
        else:
            assert "ipAddresses" not in spec, role
        assert spec["dnsNames"] == names, role
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == vals["tls"]["certManager"]["issuerRef"]
    # every name a client dials is in the certificate of the role it dials
    for role in ROLES:
        for name, entry in _env(_pod(docs, role)[1]).items():
            if name.endswith("_TARGET"):
                host = entry["value"].removeprefix("dns:///").rsplit(":", 1)[0]
                target = re.fullmatch(r"noetl-(.+)-headless\..*", host)
                assert target, host
                assert host in certs[f"noetl-{target.group(1)}"]["dnsNames"], (role, name)
    # a worker's certificate cannot pose as another role
    assert not [n for n in certs["noetl-worker"]["dnsNames"] if "worker" not in n]
    docs = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--values", str(CHART / "ci" / "mtls-values.yaml"),
                          "--set", "tls.certManager.apiLocalhost=false").stdout)
    api = find(docs, "Certificate", "noetl-api")["spec"]
    assert "localhost" not in api["dnsNames"] and "ipAddresses" not in api


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(("setting", "message"), [
    ("tls.existingSecret=", "tls.existingSecret is empty"),
    ("credentials.existingSecret=", "credentials.existingSecret is empty"),
    ("postgres.existingSecret=", "postgres.existingSecret is empty"),
    ("postgres.ownerDsnKey=", "postgres.ownerDsnKey is empty"),
    ("tls.certManager.enabled=true", "tls.certManager.issuerRef.name is empty"),
    ("tls.enabled=false", "tls.clientAuth needs tls.enabled"),
    ("migration.enabled=false", "auth.register needs migration.enabled"),
    ("ports.health=50051", "ports.grpc and ports.health are both 50051"),
])
def test_refuses_to_render_without_what_it_needs(setting: str, message: str) -> None:
    extra = ["--set", "tls.clientAuth=true"] if setting == "tls.enabled=false" else []
    proc = run([tool("helm"), "template", "noetl", str(CHART), "-n", NAMESPACE, "--set", setting, *extra],
               check=False, timeout=60)
    assert proc.returncode != 0, setting
    assert message in proc.stderr, proc.stderr


def test_role_secret_may_stand_in_for_the_shared_one() -> None:
    """With every role's TLS Secret named, the shared one may be empty; with one missing, the
    refusal names that role's value."""
    sets = [f"tls.roleSecrets.{ROLE_KEYS[r]}=tls-{r}" for r in ROLES]
    helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--set", ",".join(["tls.existingSecret=", *sets]))
    proc = run([tool("helm"), "template", "noetl", str(CHART), "-n", NAMESPACE, "--set",
                ",".join(["tls.existingSecret=", *sets[:-1]])], check=False, timeout=60)
    assert proc.returncode != 0 and "tls.roleSecrets.worker is not set" in proc.stderr, proc.stderr


def _chart_with_test_template(tmp_path: Any, body: str) -> Any:
    chart = tmp_path / "noetl"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "secret-checks-for-test.yaml").write_text(body)
    return chart


def test_required_secrets_list_every_secret_and_key(tmp_path: Any) -> None:
    """What `helm install` looks up (noetl.requiredSecrets): every Secret and key the pods and
    the Job read, except those the chart or cert-manager creates."""
    chart = _chart_with_test_template(tmp_path, (
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: required\ndata:\n"
        '  required: |-\n    {{- include "noetl.requiredSecrets" . | nindent 4 }}\n'))
    for values in ("default", "scale-3", "mtls", "plaintext"):
        vals = values_of(values)
        args = ["--values", str(CHART / "ci" / f"{values}-values.yaml")] if values != "default" else []
        out = helm("template", "noetl", str(chart), "-n", NAMESPACE, *args,
                   "--show-only", "templates/secret-checks-for-test.yaml").stdout
        required = yaml.safe_load(yaml.safe_load(out)["data"]["required"])
        listed = {(name, item["key"]) for name, items in required.items() for item in items}
        docs = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, *args).stdout)
        read: set[tuple[str, str]] = set()
        for role in ROLES:
            read |= _secrets_read(*_pod(docs, role))
        (job,) = by_kind(docs, "Job")
        read |= _secrets_read(job["spec"]["template"]["spec"], job["spec"]["template"]["spec"]["containers"][0])
        created = {d["metadata"]["name"] for d in by_kind(docs, "Secret")} | {
            c["spec"]["secretName"] for c in by_kind(docs, "Certificate")}
        assert listed == {(s, k) for s, k in read if s not in created}, values
        for items in required.values():
            assert all(item["value"] for item in items)
        if vals["auth"]["existingSecret"]:
            assert {(vals["auth"]["existingSecret"], k) for k in TOKEN_KEYS} <= listed


@pytest.mark.parametrize(("secret", "message"), [
    ({}, 'Secret "noetl-tls" (tls.existingSecret) not found in namespace "noetl"'),
    ({"data": {"tls.crt": "eA==", "tls.key": "eA=="}}, 'Secret "noetl-tls" has no key "ca.crt" (tls.existingSecret)'),
    ({"data": {"tls.crt": "eA==", "tls.key": "eA==", "ca.crt": "eA=="}}, ""),
])
def test_install_refuses_a_missing_secret_or_key(tmp_path: Any, secret: dict[str, Any], message: str) -> None:
    """noetl.checkSecret with what `lookup` would return (helm template cannot look up)."""
    chart = _chart_with_test_template(tmp_path, (
        '{{- $needs := get (include "noetl.requiredSecrets" . | fromYaml) "noetl-tls" }}\n'
        '{{- include "noetl.checkSecret" (dict "name" "noetl-tls" "needs" $needs "secret" (fromJson '
        f"{json.dumps(json.dumps(secret))}"
        ') "namespace" .Release.Namespace) }}\n'))
    proc = run([tool("helm"), "template", "noetl", str(chart), "-n", NAMESPACE], check=False, timeout=60)
    if message:
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr


def test_secret_checks_glue_with_lookups_stood_in(tmp_path: Any) -> None:
    """noetl.checkSecrets as `helm install` runs it: the two `lookup`s replaced in a copy of
    the chart (a cluster whose namespace has no Secrets), the first required Secret is named."""
    chart = tmp_path / "noetl"
    shutil.copytree(CHART, chart)
    helpers = chart / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    sa = 'lookup "v1" "ServiceAccount" .Release.Namespace "default"'
    secret = '(lookup "v1" "Secret" $.Release.Namespace $name)'
    assert text.count(sa) == 1 and text.count(secret) == 1
    helpers.write_text(text.replace(sa, 'dict "kind" "ServiceAccount"').replace(secret, "(dict)"))
    proc = run([tool("helm"), "template", "noetl", str(chart), "-n", NAMESPACE], check=False, timeout=60)
    assert proc.returncode != 0 and 'Secret "noetl-credentials-key" (credentials.existingSecret, credentials.keysKey) not found' in proc.stderr, \
        proc.stderr
    helm("template", "noetl", str(chart), "-n", NAMESPACE, "--set", "secretChecks=false")


def test_secret_checks_run_only_against_a_cluster() -> None:
    """`helm template` (no cluster: lookups return nothing) renders; the checks look up the
    namespace's `default` ServiceAccount first, and can be switched off."""
    source = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "ServiceAccount" .Release.Namespace "default"' in source
    assert "include \"noetl.checkSecrets\" ." in (CHART / "templates" / "validate.yaml").read_text()
    helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--set", "secretChecks=false")


# ---------------------------------------------------------------- NetworkPolicies


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str]
    ip: str = "10.244.0.10"


@dataclass(frozen=True)
class Address:
    """An address outside the cluster's pods (Postgres, NATS, S3, the internet)."""
    ip: str


NS_LABELS = {ns: {"kubernetes.io/metadata.name": ns} for ns in (NAMESPACE, "apps", "other", "monitoring",
                                                                 "kube-system", "ops")}


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return True
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []), "NotIn": not present or value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], other: Pod | Address, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        # pods are not matched by CIDR in this model (what an ipBlock covers of pod
        # addresses depends on the network plugin); external addresses are
        if not isinstance(other, Address):
            return False
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        net = ipaddress.ip_network(block["cidr"])
        return ip.version == net.version and ip in net and not any(
            ip in ipaddress.ip_network(x) for x in block.get("except", []) if ipaddress.ip_network(x).version == ip.version)
    if isinstance(other, Address):
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], NS_LABELS[other.namespace]):
            return False
    elif other.namespace != policy_ns:
        return False
    return _selects(peer.get("podSelector"), other.labels)


def _port_matches(ports: Sequence[Mapping[str, Any]] | None, port: int, protocol: str) -> bool:
    return not ports or any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports)


def _allows(policies: Sequence[dict[str, Any]], pod: Pod, other: Pod | Address, port: int, protocol: str,
            direction: str) -> bool:
    kind, peers_key = ("Ingress", "from") if direction == "ingress" else ("Egress", "to")
    applicable = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                  and _selects(p["spec"]["podSelector"], pod.labels) and kind in p["spec"]["policyTypes"]]
    if not applicable:
        return True
    for policy in applicable:
        for rule in policy["spec"].get(direction, []) or []:
            if _port_matches(rule.get("ports"), port, protocol) and (
                    peers_key not in rule or any(_peer_matches(peer, other, pod.namespace) for peer in rule[peers_key])):
                return True
    return False


def _reachable(policies: Sequence[dict[str, Any]], src: Pod, dst: Pod | Address, port: int,
               protocol: str = "TCP") -> bool:
    out = _allows(policies, src, dst, port, protocol, "egress")
    if isinstance(dst, Pod):
        out = out and _allows(policies, dst, src, port, protocol, "ingress")
    return out


@dataclass
class Cluster:
    policies: list[dict[str, Any]]
    ports: dict[str, int]
    pods: dict[str, Pod] = field(default_factory=dict)


def _cluster(rendered: str, values: str) -> Cluster:
    docs = documents(rendered)
    vals = values_of(values)
    cluster = Cluster(by_kind(docs, "NetworkPolicy"), {
        "grpc": vals["ports"]["grpc"], "workerApi": vals["ports"]["workerApi"], "health": vals["ports"]["health"],
        "metrics": vals["ports"]["metrics"]})
    for role in ROLES:
        labels = find(docs, "Deployment", f"noetl-{role}")["spec"]["template"]["metadata"]["labels"]
        cluster.pods[role] = Pod(role, NAMESPACE, labels)
    (job,) = by_kind(docs, "Job")
    cluster.pods["migrate"] = Pod("migrate", NAMESPACE, job["spec"]["template"]["metadata"]["labels"])
    cluster.pods["neighbour"] = Pod("neighbour", NAMESPACE, {"app": "something-else"})
    cluster.pods["apps-client"] = Pod("apps-client", "apps", {"app": "client"})
    cluster.pods["inventory"] = Pod("inventory", "apps", {"app": "inventory"})
    cluster.pods["other-client"] = Pod("other-client", "other", {"app": "client"})
    cluster.pods["ops"] = Pod("ops", "ops", {"app": "toolbox"})
    cluster.pods["prometheus"] = Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
    cluster.pods["kube-dns"] = Pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
    return cluster


# Inside the release, exactly these (source, destination, port) are open.
INTERNAL = {("worker", "api", "grpc"), ("worker", "api", "workerApi"), ("reaper", "api", "grpc")} | {
    (r, "shard-manager", "grpc") for r in ROLES if r != "shard-manager"}


@pytest.mark.parametrize("values", ["default", "scale-3", "mtls", "features"])
def test_network_policies_open_only_what_the_roles_use(rendered: dict[str, str], values: str) -> None:
    c = _cluster(rendered[values], values)
    release = [*ROLES, "migrate"]
    for src in release:
        for dst in release:
            for port_name, port in c.ports.items():
                expected = (src, dst, port_name) in INTERNAL
                assert _reachable(c.policies, c.pods[src], c.pods[dst], port) == expected, (src, dst, port_name)


@pytest.mark.parametrize("values", ["default", "scale-3", "mtls", "features"])
def test_network_policies_from_outside_the_release(rendered: dict[str, str], values: str) -> None:
    c = _cluster(rendered[values], values)
    np = values_of(values)["networkPolicy"]
    for name in ("neighbour", "apps-client", "other-client", "ops"):
        outsider = c.pods[name]
        for role in ROLES:
            for port_name, port in c.ports.items():
                reachable = _reachable(c.policies, outsider, c.pods[role], port)
                if role == "api" and port_name == "grpc":
                    # the clients' port: from anywhere, or from the configured peers
                    expected = np["clients"]["anywhere"] or name == "apps-client"
                elif role == "shard-manager" and port_name == "grpc":
                    expected = bool(np["extraIngress"].get("shardManager")) and name == "ops"
                else:
                    expected = False
                assert reachable == expected, (name, role, port_name)
        assert not _reachable(c.policies, outsider, c.pods["migrate"], c.ports["grpc"])
    # Prometheus scrapes every role's metrics port, and nothing else
    for role in ROLES:
        assert _reachable(c.policies, c.pods["prometheus"], c.pods[role], c.ports["metrics"]), role
        if not (role == "api" and np["clients"]["anywhere"]):
            assert not _reachable(c.policies, c.pods["prometheus"], c.pods[role], c.ports["grpc"]), role


def test_network_policies_egress_beyond_the_release(rendered: dict[str, str]) -> None:
    c = _cluster(rendered["default"], "default")
    postgres, nats, internet = Address("10.20.0.5"), Address("10.30.0.7"), Address("203.0.113.9")
    for name in (*ROLES, "migrate"):
        pod = c.pods[name]
        assert _reachable(c.policies, pod, c.pods["kube-dns"], 53, "UDP"), name
        assert _reachable(c.policies, pod, c.pods["kube-dns"], 53, "TCP"), name
        assert _reachable(c.policies, pod, postgres, 5432), name
        assert _reachable(c.policies, pod, nats, 4222) == (name in NATS_ROLES), name
        # only the workers' tasks may call anything else
        assert _reachable(c.policies, pod, internet, 443) == (name == "worker"), name
        if name != "worker":
            assert not _reachable(c.policies, pod, c.pods["apps-client"], 8080), name


def test_network_policies_narrowed(rendered: dict[str, str]) -> None:
    """scale-3 narrows Postgres, NATS, the tasks' egress and adds rules per role."""
    c = _cluster(rendered["scale-3"], "scale-3")
    api, worker = c.pods["api"], c.pods["worker"]
    assert _reachable(c.policies, api, Address("10.20.0.5"), 5432)
    assert not _reachable(c.policies, api, Address("10.20.0.6"), 5432)
    assert not _reachable(c.policies, api, Address("10.30.0.7"), 4222)  # NATS only in namespace nats
    assert _reachable(c.policies, worker, Address("203.0.113.9"), 443)
    assert not _reachable(c.policies, worker, Address("203.0.113.9"), 22)
    assert not _reachable(c.policies, worker, Address("10.1.2.3"), 5432)  # private ranges excepted
    assert _reachable(c.policies, worker, c.pods["inventory"], 8080)  # extraEgress
    assert not _reachable(c.policies, api, c.pods["inventory"], 8080)
    # S3 (https) and the OTLP collector (4318) from the endpoints in config/tracing
    assert _reachable(c.policies, api, Address("198.51.100.4"), 443)
    assert not _reachable(c.policies, c.pods["projector"], Address("198.51.100.4"), 443)
    assert _reachable(c.policies, c.pods["projector"], Address("198.51.100.5"), 4318)


@pytest.mark.parametrize("values", SETS)
def test_default_deny_selects_every_pod_of_the_release(rendered: dict[str, str], values: str) -> None:
    docs = documents(rendered[values])
    policies = {p["metadata"]["name"]: p for p in by_kind(docs, "NetworkPolicy")}
    if not values_of(values)["networkPolicy"]["enabled"]:
        assert not policies
        return
    deny = policies.pop("noetl-default-deny")["spec"]
    assert deny["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in deny and "egress" not in deny
    (job,) = by_kind(docs, "Job")
    pods = {r: find(docs, "Deployment", f"noetl-{r}")["spec"]["template"]["metadata"]["labels"] for r in ROLES}
    pods["migrate"] = job["spec"]["template"]["metadata"]["labels"]
    for name, labels in pods.items():
        assert _selects(deny["podSelector"], labels), name
        own = [p for p in policies.values() if _selects(p["spec"]["podSelector"], labels)]
        assert [p["metadata"]["name"] for p in own] == [f"noetl-{name}"], name
        assert own[0]["spec"]["policyTypes"] == ["Ingress", "Egress"]


# ---------------------------------------------------------------- documentation


def test_deploy_docs_cover_the_security_values() -> None:
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    assert "## Security" in text
    section = text[text.index("## Security"):]
    for needle in ("auth.existingSecret", "tls.existingSecret", "tls.roleSecrets", "tls.certManager", "tls.clientAuth",
                   "credentials.existingSecret", "postgres.dsnKeys", "postgres.ownerDsnKey", "postgres.ca",
                   "nats.urlKeys", "nats.credsSecret", "nats.ca", "networkPolicy.clients", "networkPolicy.workerTasks",
                   "networkPolicy.prometheus", "NOETL_HEALTH_LISTEN", "secretChecks", "cert-manager",
                   "noetl-rt token register", "Planned"):
        assert needle in section, needle


# ---------------------------------------------------------------- extension points (issue 17)


def _pod_security(docs: Sequence[dict[str, Any]], role: str) -> tuple[Any, ...]:
    pod, c = _pod(docs, role)
    return (pod["securityContext"], c["securityContext"], pod["automountServiceAccountToken"],
            pod.get("hostNetwork"), pod.get("hostPID"), pod.get("hostIPC"), pod["enableServiceLinks"])


def test_extension_points_do_not_weaken_the_pods_or_the_policies(rendered: dict[str, str]) -> None:
    """ci/features-values.yaml (extra env/volumes/objects, digests, KEDA, Ingress, GRPCRoute)
    changes no pod's security context, mounts no host path, and leaves every NetworkPolicy as
    the defaults render it."""
    default, features = documents(rendered["default"]), documents(rendered["features"])
    for role in ROLES:
        assert _pod_security(features, role) == _pod_security(default, role), role
        pod, c = _pod(features, role)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert not [v for v in pod["volumes"] if "hostPath" in v], role
    assert by_kind(features, "NetworkPolicy") == by_kind(default, "NetworkPolicy")
    (job,) = by_kind(features, "Job")
    spec = job["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["automountServiceAccountToken"] is False


def test_ingress_and_routes_reach_only_the_clients_port(rendered: dict[str, str]) -> None:
    """The Ingress, GRPCRoute and BackendTLSPolicy name the clients' Service noetl-api (its
    gRPC port, never the WorkerService port or another role's Service); the KEDA triggers
    carry no credential (authenticationRef names a TriggerAuthentication)."""
    docs = documents(rendered["features"])
    worker_api_port = values_of("features")["ports"]["workerApi"]
    services: list[tuple[str, Any]] = []
    for ing in by_kind(docs, "Ingress"):
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                svc = path["backend"]["service"]
                services.append((svc["name"], svc["port"].get("name", svc["port"].get("number"))))
    for route in by_kind(docs, "GRPCRoute"):
        services += [(b["name"], b["port"]) for r in route["spec"]["rules"] for b in r["backendRefs"]]
    for policy in by_kind(docs, "BackendTLSPolicy"):
        services += [(t["name"], t.get("sectionName", "grpc")) for t in policy["spec"]["targetRefs"]]
    assert len(services) == 3
    api = find(docs, "Service", "noetl-api")
    allowed = {p["name"] for p in api["spec"]["ports"]} | {p["port"] for p in api["spec"]["ports"]}
    assert worker_api_port not in allowed
    for name, port in services:
        assert name == "noetl-api" and port in allowed, (name, port)
    for so in by_kind(docs, "ScaledObject"):
        for trigger in so["spec"]["triggers"]:
            text = json.dumps(trigger["metadata"]).lower()
            assert "password" not in text and "token" not in text and "@" not in text, trigger
