"""The local stack's Postgres security: TLS with ``verify-full`` and SCRAM passwords only,
and one LOGIN user per role.

The server (``secure``, at every start): its certificate and key signed by the stack's
CA (``stackcerts``) copied into the data directory (owned by the server's OS user, key
0600), ``ssl=on``, and a ``pg_hba.conf`` that accepts only ``hostssl ...
scram-sha-256`` on loopback: plaintext TCP and the Unix socket are refused. Every DSN
the stack hands out says ``sslmode=verify-full sslrootcert=<the stack's CA>``.

The users: one LOGIN user per role, a member of the role's
group role (``noetl_common.dbroles``), with a random password kept in
``<home>/dev/secrets.json`` (mode 0600, ``postgres_users``), never in state.json. Each
role process gets a DSN for its own user in its environment only (``role_dsn``); the
owner (``noetl``, migrations and the tests' own queries) connects with a libpq
``passfile`` (``localstack.PostgresServer``), so no DSN recorded anywhere holds a
password."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from noetl_common.dbroles import ROLES, group_role
from noetl_common.errors import Unavailable

from . import stackcerts, stacksecrets

OWNER_PASSFILE = "owner.pgpass"
SERVER_CERT = "server.crt"
SERVER_KEY = "server.key"
#: postgres -o options: TLS on with the certificate in the data directory, SCRAM hashes.
SERVER_OPTIONS = (f"-c ssl=on -c ssl_cert_file={SERVER_CERT} -c ssl_key_file={SERVER_KEY}"
                  " -c ssl_min_protocol_version=TLSv1.2 -c password_encryption=scram-sha-256")
HBA = """# noetl local stack (noetl_cli/stackpg.py): TLS and SCRAM passwords only
hostssl all all 127.0.0.1/32 scram-sha-256
hostssl all all ::1/128 scram-sha-256
hostnossl all all all reject
local all all reject
"""


def owner_passfile(root: Path) -> Path:
    return root / OWNER_PASSFILE


def owner_dsn(port: int, user: str, database: str, ca_file: str, passfile: str) -> str:
    """The owner's DSN: loopback, verify-full against ``ca_file``, password from ``passfile``."""
    params = {"host": "127.0.0.1", "port": str(port), "user": user, "dbname": database}
    if ca_file:
        params.update(sslmode="verify-full", sslrootcert=ca_file)
    if passfile:
        params["passfile"] = passfile
    return make_conninfo(**params)


@contextlib.contextmanager
def initdb_password(root: Path, chown: Callable[[Path], None]) -> Iterator[Path]:
    """A fresh owner password: written to the owner's libpq passfile (0600) and, for the
    duration of ``initdb --pwfile``, to a file the server's OS user can read."""
    password = secrets.token_urlsafe(24)
    _write(owner_passfile(root), f"*:*:*:noetl:{password}\n")
    pwfile = root / ".initdb.pw"
    _write(pwfile, password + "\n")
    chown(pwfile)
    try:
        yield pwfile
    finally:
        pwfile.unlink(missing_ok=True)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def secure(root: Path, datadir: Path, tls_dir: Path, chown: Callable[[Path], None]) -> dict[str, Path]:
    """Make the data directory serve TLS only with SCRAM (before each start: a restart in
    place comes back the same); returns the CA and certificate paths used."""
    if not owner_passfile(root).exists():
        raise Unavailable(f"{datadir} has no owner password file ({owner_passfile(root)}): it was made by an older"
                          " version with trust authentication; delete the stack (noetl-rt dev down) and start again")
    tls = stackcerts.ensure(tls_dir)
    for src, name in ((tls["cert"], SERVER_CERT), (tls["key"], SERVER_KEY)):
        dst = datadir / name
        dst.unlink(missing_ok=True)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh, open(src, "rb") as data:
            shutil.copyfileobj(data, fh)
    (datadir / "pg_hba.conf").write_text(HBA)
    for name in (SERVER_CERT, SERVER_KEY, "pg_hba.conf"):
        chown(datadir / name)
    return tls

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
