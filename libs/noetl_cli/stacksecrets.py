"""The local stack's secrets: the tokens it issues at ``dev up`` (an ``admin`` token for
the CLI, a ``service`` token for the runtime's own roles, a ``worker`` token for the
workers), kept in ``<home>/dev/secrets.json`` (mode 0600), never in state.json. Their
hashes are registered in ``noetl.api_token`` straight through the stack's database
(``noetl_db.tokens``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from noetl_common.roles import Role

FILE = "secrets.json"
TOKEN_ROLES = (Role.ADMIN, Role.SERVICE, Role.WORKER)


def path(dev: Path) -> Path:
    return dev / FILE


def load(dev: Path) -> dict[str, object]:
    try:
        data = json.loads(path(dev).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save(dev: Path, data: dict[str, object]) -> None:
    dev.mkdir(parents=True, exist_ok=True)
    tmp = path(dev).with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path(dev))


def tokens(dev: Path) -> dict[str, str]:
    found = load(dev).get("tokens")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def issue_tokens(dev: Path, dsn: str) -> dict[str, str]:
    """Issue (or keep) the stack's tokens and make sure their hashes are registered."""
    import psycopg  # here: a client command reads its token from this module without Postgres

    from noetl_common import auth  # here too: the server side of tokens (grpc interceptors, logging)
    from noetl_db import tokens as tokens_db

    issued = tokens(dev) or {role.value: auth.new_token() for role in TOKEN_ROLES}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for role, token in issued.items():
            tokens_db.register_sync(conn, f"local-{role}", role, auth.token_sha256(token), "dev up")
    data = load(dev)
    data["tokens"] = issued
    save(dev, data)
    return issued
