"""Least privilege in Postgres, against the roles as processes (issue 12, acceptance):
every role process connects as its own login user over verify-full TLS, and with the
worker's database user a SELECT on the credential table fails. The rest of the e2e suite
runs on these users, which shows their grants suffice."""

from __future__ import annotations

import psycopg
import pytest
from chaos import Db
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict
from waiting import until_sync

from noetl_cli import devstack, stackpg
from noetl_common import dbroles

pytestmark = pytest.mark.e2e


def test_each_role_runs_as_its_own_database_user(stack: devstack.StackState, db: Db) -> None:
    apps = {f"noetl-{role}": stackpg.login_user(role) for role in dbroles.ROLES}

    def sessions() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for row in db.conn.execute("SELECT application_name AS app, usename AS usr, ssl FROM pg_stat_activity a"
                                   " JOIN pg_stat_ssl s USING (pid) WHERE application_name = ANY(%s)",
                                   (list(apps),)).fetchall():
            assert row["ssl"], row  # every runtime session is TLS
            found.setdefault(row["app"], set()).add(row["usr"])
        return found

    until_sync(lambda: set(sessions()) == set(apps), timeout=30, what="a session of every role")
    assert sessions() == {app: {user} for app, user in apps.items()}
    for role in dbroles.ROLES:
        dsn = conninfo_to_dict(stack.role_dsn(role))
        assert dsn["user"] == stackpg.login_user(role) and dsn["sslmode"] == "verify-full"


def test_the_workers_database_user_cannot_read_credentials(stack: devstack.StackState, db: Db) -> None:
    assert db.conn.execute("SELECT count(*) AS n FROM noetl.credential").fetchone()["n"] > 0  # there are some
    with psycopg.connect(stack.role_dsn("worker"), autocommit=True) as worker:
        for table in ("credential", "api_token", "runtime_secret", "event", "command"):
            with pytest.raises(errors.InsufficientPrivilege):
                worker.execute(f"SELECT * FROM noetl.{table} LIMIT 1")
        with pytest.raises(errors.InsufficientPrivilege):
            worker.execute("UPDATE noetl.credential SET kind = kind")
        # what it needs: the result store
        worker.execute("SELECT 1 FROM noetl.result_ref LIMIT 1")


def test_only_the_api_reads_credentials(stack: devstack.StackState) -> None:
    for role in dbroles.ROLES:
        with psycopg.connect(stack.role_dsn(role), autocommit=True) as conn:
            try:
                conn.execute("SELECT name FROM noetl.credential LIMIT 1")
                readable = True
            except errors.InsufficientPrivilege:
                readable = False
        assert readable == (role == "api"), role
