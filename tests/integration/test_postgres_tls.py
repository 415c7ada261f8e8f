"""The test and local-stack Postgres serves TLS only, with SCRAM passwords, and its DSNs
verify the server (``sslmode=verify-full`` against the stack's CA): plaintext, the Unix
socket, another CA and another name are refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from noetl_cli import stackcerts

pytestmark = pytest.mark.integration


def _connect(dsn: str, **changes: str) -> tuple[bool, bool]:
    with psycopg.connect(make_conninfo(dsn, connect_timeout="5", **changes)) as conn:
        row = conn.execute("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
        assert row is not None
        return bool(row[0]), str(row[1]).startswith("TLSv1.")


def test_verify_full_connects_over_tls(pg_server) -> None:  # type: ignore[no-untyped-def]
    params = conninfo_to_dict(pg_server.dsn)
    assert params["sslmode"] == "verify-full" and Path(str(params["sslrootcert"])).exists()
    assert "password" not in params  # the owner's password is in its passfile, 0600
    assert stat.S_IMODE(os.stat(str(params["passfile"])).st_mode) == 0o600
    assert _connect(pg_server.dsn) == (True, True)
    assert _connect(pg_server.dsn, host="localhost") == (True, True)  # a name the certificate has


def test_plaintext_is_refused(pg_server) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(psycopg.OperationalError, match=r"pg_hba\.conf rejects"):
        _connect(pg_server.dsn, sslmode="disable")


def test_the_unix_socket_is_refused(pg_server) -> None:  # type: ignore[no-untyped-def]
    sockdir = Path(pg_server.datadir).parent / "pgsock"
    with pytest.raises(psycopg.OperationalError, match=r"pg_hba\.conf rejects"):
        _connect(pg_server.dsn, host=str(sockdir), sslmode="disable")


def test_a_wrong_password_is_refused(pg_server) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        _connect(pg_server.dsn, passfile=os.devnull, password="not-the-password")


def test_a_server_signed_by_another_ca_is_refused(pg_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    other = stackcerts.ensure(tmp_path)["ca"]  # a CA of the same name, another key
    with pytest.raises(psycopg.OperationalError, match="SSL error"):
        _connect(pg_server.dsn, sslrootcert=str(other))


def test_a_name_the_certificate_does_not_have_is_refused(pg_server) -> None:  # type: ignore[no-untyped-def]
    # the same server at the same address, called by another name
    with pytest.raises(psycopg.OperationalError, match="does not match host name"):
        _connect(pg_server.dsn, host="db.noetl.invalid", hostaddr="127.0.0.1")
    # verify-ca (no name check) would accept it: verify-full is what refuses
    assert _connect(pg_server.dsn, host="db.noetl.invalid", hostaddr="127.0.0.1", sslmode="verify-ca")[0]
