"""The recipes of docs/DEPLOY.md for what the chart does not install: NATS with the official
chart (deploy/helm/examples/nats-values.yaml) and PostgreSQL with CloudNativePG
(deploy/helm/examples/cnpg-cluster.yaml), and the chart's values that use them
(deploy/helm/examples/noetl-values.yaml, rendered and validated like every values set by
test_chart.py and test_chart_security.py).

Neither the NATS chart nor the CNPG Cluster CRD can be rendered or validated here (no
network to their chart and CRD, no npm/PyPI package of their schemas): each is checked
against a JSON schema of our own covering the fields the recipe uses (our reading of the
NATS chart 1.x values and CNPG's postgresql.cnpg.io/v1 Cluster), and every value that must
agree with the runtime or the chart's values is compared: user names, permissions,
Secrets, ports, database, CA."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import yaml
from deploytools import EXAMPLES, REPO, ROLE_KEYS, ROLES, documents, find, json_schema_errors, values_of

from noetl_common import dbroles, natsio, natsperms

NATS_VALUES = EXAMPLES / "nats-values.yaml"
CNPG = EXAMPLES / "cnpg-cluster.yaml"
DEPLOY_MD = REPO / "docs" / "DEPLOY.md"

_STR = {"type": "string", "minLength": 1}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
# Our reading of the official NATS chart's values (nats-io/k8s helm/charts/nats, 1.x): the
# keys the recipe sets, with their types; anything else under these keys is a typo.
NATS_CHART_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["config", "container"],
    "properties": {
        "config": {"type": "object", "additionalProperties": False, "properties": {
            "cluster": {"type": "object", "additionalProperties": False,
                        "properties": {"enabled": {"type": "boolean"}, "replicas": {"type": "integer", "minimum": 1}}},
            "jetstream": {"type": "object", "additionalProperties": False, "required": ["enabled"], "properties": {
                "enabled": {"type": "boolean"},
                "fileStore": {"type": "object", "additionalProperties": False, "properties": {
                    "enabled": {"type": "boolean"},
                    "pvc": {"type": "object", "additionalProperties": False,
                            "properties": {"enabled": {"type": "boolean"}, "size": _STR}}}},
                "memoryStore": {"type": "object", "additionalProperties": False,
                                "properties": {"enabled": {"type": "boolean"}}},
                "merge": {"type": "object"}}},
            "nats": {"type": "object", "additionalProperties": False, "properties": {
                "port": _PORT,
                "tls": {"type": "object", "additionalProperties": False,
                        "properties": {"enabled": {"type": "boolean"}, "secretName": _STR}}}},
            "monitor": {"type": "object", "additionalProperties": False,
                        "properties": {"enabled": {"type": "boolean"}, "port": _PORT}},
            "merge": {"type": "object", "additionalProperties": False, "properties": {
                "authorization": {"type": "object", "additionalProperties": False, "required": ["users"], "properties": {
                    "users": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["user", "password", "permissions"],
                        "properties": {"user": _STR, "password": {"type": "string", "pattern": r"^<< \$[A-Z_]+ >>$"},
                                       "permissions": {"type": "object", "additionalProperties": False, "properties": {
                                           "publish": {"type": "object", "properties": {"allow": {"type": "array"}}},
                                           "subscribe": {"type": "object",
                                                         "properties": {"allow": {"type": "array"}}}}}}}}}}}}}},
        "container": {"type": "object", "additionalProperties": False, "properties": {
            "env": {"type": "object", "additionalProperties": {
                "type": "object", "additionalProperties": False, "required": ["valueFrom"],
                "properties": {"valueFrom": {"type": "object", "required": ["secretKeyRef"]}}}}}},
    },
}
# Our reading of CloudNativePG's Cluster (postgresql.cnpg.io/v1) for the fields the recipe uses.
_ROLE = {"type": "object", "additionalProperties": False, "required": ["name", "login"], "properties": {
    "name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$"}, "ensure": {"enum": ["present", "absent"]},
    "login": {"type": "boolean"}, "comment": {"type": "string"},
    "inRoles": {"type": "array", "items": _STR},
    "passwordSecret": {"type": "object", "additionalProperties": False, "required": ["name"],
                       "properties": {"name": _STR}}}}
CNPG_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "postgresql.cnpg.io/v1"}, "kind": {"const": "Cluster"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": _STR, "namespace": _STR}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["instances", "storage", "bootstrap"],
                 "properties": {
                     "instances": {"type": "integer", "minimum": 1},
                     "storage": {"type": "object", "required": ["size"], "properties": {"size": _STR}},
                     "postgresql": {"type": "object", "additionalProperties": False, "properties": {
                         "parameters": {"type": "object", "additionalProperties": {"type": "string"}},
                         "pg_hba": {"type": "array", "items": {"type": "string"}}}},
                     "bootstrap": {"type": "object", "additionalProperties": False, "properties": {
                         "initdb": {"type": "object", "additionalProperties": False,
                                    "required": ["database", "owner", "secret"],
                                    "properties": {"database": _STR, "owner": _STR,
                                                   "secret": {"type": "object", "required": ["name"],
                                                              "properties": {"name": _STR}}}}}},
                     "managed": {"type": "object", "additionalProperties": False, "properties": {
                         "roles": {"type": "array", "items": _ROLE}}}}},
    },
}


def _nats() -> dict[str, Any]:
    return dict(yaml.safe_load(NATS_VALUES.read_text()))


def _cluster() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(CNPG.read_text()) if d]
    return dict(doc)


def test_examples_are_generated_and_current() -> None:
    """nats-values.yaml (and the chart's other generated files) match their sources."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_chart_files.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_own_schemas_can_fail() -> None:
    nats = _nats()
    assert json_schema_errors(NATS_CHART_SCHEMA, nats) == []
    bad = yaml.safe_load(NATS_VALUES.read_text())
    bad["config"]["jetstream"]["filestore"] = {}
    assert any("filestore" in e for e in json_schema_errors(NATS_CHART_SCHEMA, bad))
    cluster = _cluster()
    assert json_schema_errors(CNPG_SCHEMA, cluster) == []
    cluster["spec"]["managed"]["roles"][0]["password"] = "x"
    assert json_schema_errors(CNPG_SCHEMA, cluster)


def test_nats_users_and_permissions_are_the_runtimes() -> None:
    nats = _nats()
    users = {u["user"]: u for u in nats["config"]["merge"]["authorization"]["users"]}
    perms = natsperms.role_permissions()
    assert set(users) == {f"noetl_{r}" for r in perms}  # the NATS roles and admin
    env = nats["container"]["env"]
    for role, p in perms.items():
        user = users[f"noetl_{role}"]
        assert user["permissions"]["publish"]["allow"] == list(p.publish), role
        assert user["permissions"]["subscribe"]["allow"] == list(p.subscribe), role
        var = re.fullmatch(r"<< \$(\w+) >>", user["password"])
        assert var, user["password"]
        assert env[var.group(1)]["valueFrom"]["secretKeyRef"] == {"name": "noetl-nats-users", "key": role}
    # the chart's NATS roles are the runtime's
    assert set(values_of("example")["nats"]["urlKeys"]) == {ROLE_KEYS[r] for r in natsperms.ROLES}


def test_nats_server_settings_match_the_chart_values() -> None:
    nats = _nats()["config"]
    vals = values_of("example")
    assert nats["jetstream"]["enabled"] is True and nats["jetstream"]["fileStore"]["enabled"] is True
    # streams with R3 need three servers
    assert nats["cluster"]["enabled"] and nats["cluster"]["replicas"] >= int(vals["config"]["NOETL_NATS_STREAM_REPLICAS"])
    # clients over TLS; the roles verify the server with the CA from nats.ca
    assert nats["nats"]["tls"]["enabled"] is True and vals["nats"]["ca"]["existingSecret"]
    # the client port the NetworkPolicies open, and the monitoring port KEDA reads
    assert [p["port"] for p in vals["networkPolicy"]["nats"]["ports"]] == [nats["nats"]["port"]]
    endpoint = vals["autoscaling"]["worker"]["natsJetstream"]["monitoringEndpoint"]
    assert endpoint.endswith(f":{nats['monitor']['port']}") and nats["monitor"]["enabled"]
    assert endpoint.split(".")[:2] == ["nats", "nats"]  # the `nats` release's Service in namespace nats
    peer = vals["networkPolicy"]["nats"]["to"][0]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "nats"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
    text = NATS_VALUES.read_text()
    assert natsio.COMMANDS_STREAM in text and "noetl-workers-" in text


def test_cnpg_roles_are_the_grant_matrix() -> None:
    spec = _cluster()["spec"]
    roles = {r["name"]: r for r in spec["managed"]["roles"]}
    for role in dbroles.ROLES:
        group = roles[dbroles.group_role(role)]
        assert group["login"] is False and group.get("ensure", "present") == "present", role
        assert set(group.get("inRoles", [])) == set(dbroles.MEMBERSHIPS.get(role, ())), role
        login = roles[dbroles.group_role(role) + "_u"]
        assert login["login"] is True and login["inRoles"] == [dbroles.group_role(role)], role
        assert login["passwordSecret"] == {"name": f"noetl-pg-{role}"}, role
    assert len(roles) == 2 * len(dbroles.ROLES)
    # the owner makes the schema; it is not one of the roles' users
    assert spec["bootstrap"]["initdb"]["owner"] == "noetl_owner" and "noetl_owner" not in roles
    # TLS only
    assert spec["postgresql"]["pg_hba"][0] == "hostnossl all all all reject"
    assert spec["postgresql"]["parameters"]["synchronous_commit"] == "on"


def test_cnpg_cluster_matches_the_chart_values_and_the_docs() -> None:
    cluster = _cluster()
    name, ns = cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    database = cluster["spec"]["bootstrap"]["initdb"]["database"]
    vals = values_of("example")
    assert vals["postgres"]["ca"] == {"existingSecret": f"{name}-ca", "key": "ca.crt"}  # CNPG's CA Secret
    peer = vals["networkPolicy"]["postgres"]["to"][0]
    assert peer == {"podSelector": {"matchLabels": {"cnpg.io/cluster": name}}}
    assert [p["port"] for p in vals["networkPolicy"]["postgres"]["ports"]] == [5432]
    docs = DEPLOY_MD.read_text()
    section = docs[docs.index("### PostgreSQL with CloudNativePG"):]
    # the DSNs the recipe builds: the read-write Service, the database, verify-full with the CA
    # where the chart mounts it, each role's login user
    assert f"host={name}-rw.{ns}.svc port=5432 dbname={database}" in section
    assert "sslmode=verify-full sslrootcert=/etc/noetl/postgres-ca/ca.crt" in section
    assert 'user=noetl_${r//-/_}_u' in section and "noetl-pg-$r" in section
    assert "--from-literal=owner=" in section and cluster["spec"]["bootstrap"]["initdb"]["secret"]["name"] in section


def test_nats_recipe_builds_the_urls_the_chart_reads() -> None:
    docs = DEPLOY_MD.read_text()
    section = docs[docs.index("### NATS with the official chart"):]
    assert "tls://noetl_$r:" in section and "@nats.nats.svc.cluster.local:4222" in section
    assert "noetl-nats-users" in section and "kubectl -n noetl create secret generic noetl-nats" in section
    for role in natsperms.ROLES:
        assert role in section


def test_example_values_render_every_role_against_the_recipes(rendered: dict[str, str]) -> None:
    docs = documents(rendered["example"])
    for role in ROLES:
        pod = find(docs, "Deployment", f"noetl-{role}")["spec"]["template"]["spec"]
        ca = [v for v in pod["volumes"] if v["name"] == "postgres-ca"]
        assert ca and ca[0]["secret"]["secretName"] == "noetl-pg-ca", role
    so = find(docs, "ScaledObject", "noetl-worker")
    assert {t["type"] for t in so["spec"]["triggers"]} == {"prometheus", "nats-jetstream"}
