"""The local stack's database users: one LOGIN user per role, a member of the role's
group role (``noetl_common.dbroles``), with a random password kept in
``<home>/dev/secrets.json`` (mode 0600, ``postgres_users``), never in state.json. Each
role process gets a DSN for its own user in its environment only (``role_dsn``); the
owner (``noetl``, migrations and the tests' own queries) connects with a libpq
``passfile`` (``localstack.PostgresServer``), so no DSN recorded anywhere holds a
password."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from noetl_common.dbroles import ROLES, group_role

from . import stacksecrets

KEY = "postgres_users"


def login_user(role: str) -> str:
    """The local stack's LOGIN user of ``role``: ``noetl_worker_login`` etc."""
    return f"{group_role(role)}_login"


def role_dsn(base: str, role: str, password: str) -> str:
    """``base`` (host, port, TLS settings: the owner's DSN or a fault proxy's) as ``role``'s
    login user with its password (and no passfile)."""
    params = {k: v for k, v in conninfo_to_dict(base).items() if k != "passfile"}
    params.update(user=login_user(role), password=password)
    return make_conninfo(**params)  # type: ignore[arg-type]


def ensure_logins(owner_dsn: str, passwords: Mapping[str, str]) -> None:
    """Create (or reset the password of) each role's login user, a member of its group
    role (which ``db.migrate`` created). Run with the owner's DSN."""
    with psycopg.connect(owner_dsn, autocommit=True) as conn:
        for role, password in passwords.items():
            user, group = sql.Identifier(login_user(role)), sql.Identifier(group_role(role))
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (login_user(role),)).fetchone()
            verb = sql.SQL("ALTER ROLE" if exists else "CREATE ROLE")
            conn.execute(sql.SQL("{} {} WITH LOGIN INHERIT PASSWORD {}").format(verb, user, sql.Literal(password)))
            conn.execute(sql.SQL("GRANT {} TO {}").format(group, user))


def passwords(dev: Path) -> dict[str, str]:
    """The stack's login passwords by role, made (and saved with the stack's other
    secrets, 0600) unless they exist."""
    data = stacksecrets.load(dev)
    found = data.get(KEY)
    if isinstance(found, dict) and all(r in found for r in ROLES):
        return {str(k): str(v) for k, v in found.items()}
    made = {role: secrets.token_urlsafe(24) for role in ROLES}
    data[KEY] = made
    stacksecrets.save(dev, data)
    return made
