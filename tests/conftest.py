"""Session fixtures: a real Postgres and a real NATS JetStream server on free loopback
ports, started by the tests (never assumed to be running), migrated once."""

from __future__ import annotations

import os

# Before anything imports grpc: the tests spawn servers while gRPC channels are open
# (see libs/noetl_common/__init__.py: grpc/grpc#43055).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The upstream conformance data: NOETL_CONFORMANCE_DIR, default ../shared/conformance/noetl-e2e
# (tests/conformance_data.py); tests that need it skip when it is not there.


@pytest.fixture(scope="session")
def session_dir() -> Iterator[Path]:
    base = Path(os.environ.get("NOETL_TEST_TMP", tempfile.gettempdir()))
    d = Path(tempfile.mkdtemp(prefix="noetl-test-", dir=base))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server(session_dir: Path):  # type: ignore[no-untyped-def]
    from noetl_cli.localstack import start_postgres

    server = start_postgres(session_dir / "pg")
    yield server
    server.stop("immediate")


@pytest.fixture(scope="session")
def pg_dsn(pg_server) -> str:  # type: ignore[no-untyped-def]
    """DSN of a migrated database (schema `noetl` at the latest migration)."""
    from noetl_common.db import migrate

    migrate(pg_server.dsn)
    return str(pg_server.dsn)


@pytest.fixture(scope="session")
def nats_server(session_dir: Path):  # type: ignore[no-untyped-def]
    from noetl_cli.localstack import start_nats

    server = start_nats(session_dir / "nats")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:  # type: ignore[no-untyped-def]
    return str(nats_server.url)


@pytest.fixture(scope="session")
def s3_server(session_dir: Path):  # type: ignore[no-untyped-def]
    """A real S3-protocol server (SeaweedFS, SigV4 enforced) with the bucket ``noetl-test``."""
    from noetl_cli.localstack import start_s3

    server = start_s3(session_dir / "s3", buckets=("noetl-test",))
    yield server
    server.stop()
