"""The grant matrix (noetl_common.dbroles) as Postgres enforces it: each group role, through
a login user of its own, may do what the matrix says and nothing else; the worker's
login reads no credential, token or event-log table."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta

import psycopg
import pytest
from psycopg import errors

from noetl_cli import stackpg
from noetl_common import dbroles
from noetl_common.db import migrate
from noetl_common.ids import snowflake_at

PRIVS = {"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER"}


@pytest.fixture(scope="module")
def logins(pg_dsn: str) -> dict[str, str]:
    """A login DSN per role (the local stack's users, with fresh passwords)."""
    passwords = {role: secrets.token_urlsafe(16) for role in dbroles.ROLES}
    stackpg.ensure_logins(pg_dsn, passwords)
    return {role: stackpg.role_dsn(pg_dsn, role, pw) for role, pw in passwords.items()}


@pytest.fixture
def worker(logins: dict[str, str]) -> Iterator[psycopg.Connection]:
    with psycopg.connect(logins["worker"], autocommit=True) as conn:
        yield conn


def denied(conn: psycopg.Connection, statement: str, params: tuple[object, ...] = ()) -> bool:
    try:
        conn.execute(statement, params)  # type: ignore[arg-type]
    except errors.InsufficientPrivilege:
        return True
    return False


def test_every_table_has_decided_grants(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        assert dbroles.undecided(conn) == [], "add the table to noetl_common.dbroles.GRANTS"


def test_the_worker_reads_no_credential_token_or_log(worker: psycopg.Connection) -> None:
    assert worker.execute("SELECT current_user").fetchone() == (stackpg.login_user("worker"),)
    for table in ("credential", "api_token", "runtime_secret", "event", "command", "execution_request",
                  "engine_state", "catalog", "execution", "shard_lease", "runtime", "manifest"):
        assert denied(worker, f"SELECT 1 FROM noetl.{table} LIMIT 1"), table
    assert denied(worker, "INSERT INTO noetl.credential (name, kind, data) VALUES ('x', 'generic', '{}')")
    assert denied(worker, "UPDATE noetl.credential SET kind = kind")
    assert denied(worker, "DELETE FROM noetl.credential")
    assert denied(worker, "DELETE FROM noetl.result_ref")
    assert denied(worker, "CREATE TABLE noetl.mine (x int)")
    assert denied(worker, "SELECT noetl.create_event_partition(current_date + 30)")


def test_the_worker_does_what_it_needs(worker: psycopg.Connection) -> None:
    with worker.transaction(force_rollback=True):
        ref = worker.execute("SELECT nextval(pg_get_serial_sequence('noetl.result_ref', 'ref_id'))").fetchone()
        assert ref is not None
        worker.execute("INSERT INTO noetl.result_ref (ref_id, execution_id, step, tier, uri, size_bytes)"
                       " VALUES (%s, 1, 's', 'db', 'pg://result_payload/1', 2)", (ref[0],))
        worker.execute("INSERT INTO noetl.result_payload (ref_id, data) VALUES (%s, '{}')", (ref[0],))
        assert worker.execute("SELECT count(*) FROM noetl.result_ref r JOIN noetl.result_payload p"
                              " USING (ref_id) WHERE ref_id = %s", (ref[0],)).fetchone() == (1,)
        worker.execute("SELECT count(*) FROM noetl.loop_result")
    # a token is looked up by its hash, never listed
    assert worker.execute("SELECT * FROM noetl.token_identity('nope')").fetchall() == []


def test_the_matrix_is_what_postgres_enforces(pg_dsn: str) -> None:
    """has_table_privilege of every group role on every table and sequence is the matrix,
    and PUBLIC has nothing in schema noetl."""
    with psycopg.connect(pg_dsn) as conn:
        kinds = dict(conn.execute(
            "SELECT c.relname, c.relkind FROM pg_class c WHERE c.relnamespace = 'noetl'::regnamespace"
            " AND c.relkind IN ('r', 'p', 'S') AND NOT c.relispartition").fetchall())
        for obj, grants in dbroles.GRANTS.items():
            assert obj in kinds, f"{obj} is in the matrix but not in the database"
            for role in dbroles.ROLES:
                group = dbroles.group_role(role)
                want = set(grants.get(role, ()))
                if kinds[obj] == "S":
                    have = {p for p in ("USAGE", "SELECT", "UPDATE") if conn.execute(
                        "SELECT has_sequence_privilege(%s, %s, %s)", (group, f"noetl.{obj}", p)).fetchone()[0]}
                else:
                    have = {p for p in PRIVS if conn.execute(
                        "SELECT has_table_privilege(%s, %s, %s)", (group, f"noetl.{obj}", p)).fetchone()[0]}
                assert have == want, (role, obj)
            public = conn.execute("SELECT count(*) FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid ="
                                  " %s::regclass AND a.grantee = 0", (f"noetl.{obj}",)).fetchone()
            assert public == (0,), f"PUBLIC has a privilege on {obj}"
        for fn, allowed in dbroles.FUNCTIONS.items():
            for role in dbroles.ROLES:
                ok = conn.execute("SELECT has_function_privilege(%s, %s, 'EXECUTE')",
                                  (dbroles.group_role(role), f"noetl.{fn}")).fetchone()[0]
                assert ok == (role in allowed), (role, fn)
            public = conn.execute("SELECT count(*) FROM pg_proc p, aclexplode(coalesce(p.proacl,"
                                  " acldefault('f', p.proowner))) a WHERE p.oid = %s::regprocedure AND a.grantee = 0",
                                  (f"noetl.{fn}",)).fetchone()
            assert public == (0,), f"PUBLIC may execute {fn}"


def test_apply_converges(pg_dsn: str, logins: dict[str, str]) -> None:
    """A hand-made grant does not survive the next migrate; migrate is idempotent."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("GRANT SELECT ON noetl.credential TO noetl_worker")
    assert migrate(pg_dsn) == []
    with psycopg.connect(logins["worker"], autocommit=True) as worker:
        assert denied(worker, "SELECT 1 FROM noetl.credential")


def test_the_compactor_creates_and_drops_partitions_through_the_owner(pg_dsn: str, logins: dict[str, str]) -> None:
    day = datetime.now(UTC).date() + timedelta(days=400)
    name = f"event_p{day:%Y%m%d}"
    with psycopg.connect(logins["compactor"], autocommit=True) as conn:
        assert denied(conn, f"CREATE TABLE noetl.{name} PARTITION OF noetl.event FOR VALUES FROM (1) TO (2)")
        assert conn.execute("SELECT noetl.create_event_partition(%s)", (day,)).fetchone() == (name,)
        assert conn.execute("SELECT noetl.create_event_partition(%s)", (day,)).fetchone() == (None,)
        bound = conn.execute("SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c WHERE relname = %s",
                             (name,)).fetchone()
        assert bound == (f"FOR VALUES FROM ('{_ms(day)}') TO ('{_ms(day + timedelta(days=1))}')",)
        with pytest.raises(errors.InvalidParameterValue):
            conn.execute("SELECT noetl.drop_event_partition('credential')")
        assert conn.execute("SELECT noetl.drop_event_partition(%s)", (name,)).fetchone() == (True,)
        assert denied(conn, "DROP TABLE noetl.execution")


def _ms(day: date) -> int:
    return snowflake_at(int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp() * 1000))


def test_the_shard_manager_may_end_another_roles_session(logins: dict[str, str]) -> None:
    """The leader ends a dead member's session holding a lease row (pg_signal_backend);
    no other role may."""
    with psycopg.connect(logins["api"], autocommit=True) as api:
        pid = api.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        with psycopg.connect(logins["worker"], autocommit=True) as worker:
            assert denied(worker, "SELECT pg_terminate_backend(%s)", (pid,))
        with psycopg.connect(logins["shard-manager"], autocommit=True) as sm:
            assert sm.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone() == (True,)


def test_logins_are_members_only_of_their_group(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        for role in dbroles.ROLES:
            groups = [r[0] for r in conn.execute(
                "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
                " JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = %s", (stackpg.login_user(role),))]
            assert groups == [dbroles.group_role(role)]
            assert conn.execute("SELECT rolsuper OR rolcreaterole OR rolcreatedb OR rolbypassrls"
                                " FROM pg_roles WHERE rolname = %s",
                                (stackpg.login_user(role),)).fetchone() == (False,)
