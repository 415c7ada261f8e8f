"""``noetl-rt token ...``: API tokens (docs/DEPLOY.md "Security").

    token create --role ROLE --name NAME   (admin token) prints the new token, once
    token list [--all]                     (admin token) names, roles, dates; never tokens
    token revoke NAME                      (admin token)
    token register --role ROLE --name NAME (the database, no api) registers a token read
                                           from stdin or $NOETL_AUTH_TOKEN: the first admin
                                           token, and the roles' own tokens at install

Which token a command sends: ``--token-file PATH``, else ``$NOETL_TOKEN``, else the
local stack's admin token (``<home>/dev/secrets.json``) when it talks to the local stack.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping

from noetl_common import auth
from noetl_common.db import make_pool
from noetl_proto.v1 import auth_pb2

from . import output
from .apichannel import Api
from .output import CliError
from .stackprobe import resolve_ca, resolve_token  # noqa: F401  (re-exported)


def create(api: Api, role: str, name: str, *, as_json: bool) -> int:
    resp = api.call(api.tokens.CreateToken, auth_pb2.CreateTokenRequest(role=role, name=name))
    if as_json:
        print(json.dumps({"token": resp.token, "name": resp.info.name, "role": resp.info.role,
                          "token_id": resp.info.token_id}))
    else:
        print(resp.token)
        print(f"token {resp.info.name!r} (role {resp.info.role}, id {resp.info.token_id}): keep it, it is not "
              "shown again", file=sys.stderr)
    return 0


def list_tokens(api: Api, *, include_revoked: bool, as_json: bool) -> int:
    resp = api.call(api.tokens.ListTokens, auth_pb2.ListTokensRequest(include_revoked=include_revoked))
    rows = [{"token_id": t.token_id, "name": t.name, "role": t.role, "created_by": t.created_by,
             "created_at": t.created_at.ToJsonString() if t.HasField("created_at") else "",
             "revoked_at": t.revoked_at.ToJsonString() if t.HasField("revoked_at") else ""} for t in resp.tokens]
    if as_json:
        print(json.dumps(rows))
    else:
        print(output.table([(r["token_id"], r["name"], r["role"], r["created_at"], r["revoked_at"] or "-")
                            for r in rows], header=["ID", "NAME", "ROLE", "CREATED", "REVOKED"]))
    return 0


def revoke(api: Api, name: str) -> int:
    resp = api.call(api.tokens.RevokeToken, auth_pb2.RevokeTokenRequest(name=name))
    if not resp.revoked:
        raise CliError(f"no live token named {name!r}", code=1)
    print(f"revoked {name}")
    return 0


def register(dsn: str, role: str, name: str, environ: Mapping[str, str] | None = None) -> int:
    """Register the token on stdin (or $NOETL_AUTH_TOKEN) under ``name`` straight in the
    database: how the first admin token and the roles' own tokens come to exist."""
    env = os.environ if environ is None else environ
    token = env.get("NOETL_AUTH_TOKEN", "").strip()
    if not token and not sys.stdin.isatty():
        token = sys.stdin.read().strip()
    if not token:
        raise CliError("no token: pipe it on stdin or set NOETL_AUTH_TOKEN (never as an argument)", code=2)

    async def go() -> auth.Identity:
        pool = make_pool(dsn, min_size=1, max_size=1, name="noetl-rt-token")
        await pool.open(wait=True, timeout=30)
        try:
            return await auth.register_token(pool, auth.parse_role(role), name, token,
                                             created_by="noetl-rt token register")
        finally:
            await pool.close()

    identity = asyncio.run(go())
    print(json.dumps({"token_id": identity.token_id, "name": identity.name, "role": identity.role.value}))
    return 0
