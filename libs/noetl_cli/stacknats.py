"""The local stack's NATS security: TLS with the stack's certificate and one user per role
with the permissions of ``noetl_common.natsperms``.

At ``dev up`` a password is made for every role and ``admin`` and kept in
``<home>/dev/secrets.json`` (mode 0600, ``stacksecrets``) under ``nats``, never in
state.json; the server's configuration is written to ``<home>/dev/nats/nats.conf``
(mode 0600: it holds the passwords) and a restart of NATS in place (``stackinfra``, the
fault tests) starts it with that same file. Clients must speak TLS (the server's
certificate is the roles' one, signed by the stack's CA, for 127.0.0.1). Each role
process gets ``tls://<role>:<password>@127.0.0.1:<port>`` and the CA
(``NOETL_NATS_TLS_CA_FILE``); roles without NATS (shard-manager, compactor) get no
NATS URL. ``state.nats_url`` (state.json, ``dev status``) carries no credentials; tests
and tools connect as ``admin`` (``StackState.nats_user_url``)."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from noetl_common import natsperms

from . import localstack, stackcerts, stacksecrets

CONFIG = "nats.conf"
USERS = (*natsperms.ROLES, natsperms.ADMIN)


def passwords(dev: Path) -> dict[str, str]:
    """The stack's NATS passwords by user ({} before ``dev up`` made them)."""
    found = stacksecrets.load(dev).get("nats")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def ensure_passwords(dev: Path) -> dict[str, str]:
    """Make (or keep) a password for every role and ``admin``."""
    have = passwords(dev)
    if all(have.get(u) for u in USERS):
        return have
    made = {u: have.get(u) or secrets.token_urlsafe(24) for u in USERS}
    data = stacksecrets.load(dev)
    data["nats"] = made
    stacksecrets.save(dev, data)
    return made


def config_text(*, port: int, store_dir: Path, tls: dict[str, Path], users: dict[str, str],
                kv_bucket: str = natsperms.DEFAULT_KV_BUCKET) -> str:
    """nats-server configuration: loopback only, JetStream on, TLS required, the users."""
    return "\n".join([
        f"listen: {json.dumps(f'127.0.0.1:{port}')}",
        f"jetstream {{ store_dir: {json.dumps(str(store_dir))} }}",
        f"tls {{ cert_file: {json.dumps(str(tls['cert']))}, key_file: {json.dumps(str(tls['key']))}, timeout: 5 }}",
        natsperms.authorization_block(users, kv_bucket=kv_bucket),
    ])


def write_config(root: Path, *, port: int, dev: Path, kv_bucket: str = natsperms.DEFAULT_KV_BUCKET) -> Path:
    """Write ``root/nats.conf`` (0600) for ``port``: certificates and passwords are made
    first when missing."""
    root.mkdir(parents=True, exist_ok=True)
    text = config_text(port=port, store_dir=(root / "jetstream").resolve(), tls=stackcerts.ensure(dev),
                       users=ensure_passwords(dev), kv_bucket=kv_bucket)
    path = root / CONFIG
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


def start(dev: Path, env: Mapping[str, str] | None = None) -> localstack.NatsServer:
    """Start the stack's NATS (TLS, users) under ``dev/nats`` on a free port. ``env`` is
    the roles' environment (its ``NOETL_RESULT_KV_BUCKET`` names the result KV bucket
    the permissions grant)."""
    root = dev / "nats"
    port = localstack.free_port()
    bucket = (env or {}).get("NOETL_RESULT_KV_BUCKET") or natsperms.DEFAULT_KV_BUCKET
    return localstack.start_nats(root, port=port, config=write_config(root, port=port, dev=dev, kv_bucket=bucket))


def user_url(url: str, dev: Path, user: str) -> str:
    """``url`` (``tls://127.0.0.1:PORT``) with ``user``'s credentials; ``""`` for a
    user without a NATS password (a role that does not use NATS)."""
    password = passwords(dev).get(user)
    if not url or not password:
        return ""
    scheme, _, host = url.partition("://")
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{host}"


def role_env(url: str, dev: Path, role: str) -> dict[str, str]:
    """A role process's NATS settings: its own user, the CA to trust. A stack without
    NATS passwords (made before this existed) keeps the plain URL."""
    if not passwords(dev):
        return {"NOETL_NATS_URL": url}
    ca = stackcerts.paths(dev)["ca"]
    return {"NOETL_NATS_URL": user_url(url, dev, role), "NOETL_NATS_TLS_CA_FILE": str(ca) if ca.exists() else ""}
