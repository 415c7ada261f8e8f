"""End-to-end fixtures: one local stack (seven role processes, real Postgres and NATS)
per session, with the credentials the conformance playbooks name."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The repository root, for the http fixture server the tests share with the bench
# (bench/fixture_api.py): `from bench.fixture_api import serve`.
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from chaos import Db
from harness import CREDENTIALS, Runner, start_stack

from noetl_cli import devstack
from noetl_cli.client import Api
from noetl_client import values
from noetl_proto.v1 import catalog_pb2


@pytest.fixture(scope="session")
def stack() -> Iterator[devstack.StackState]:
    home = Path(tempfile.mkdtemp(prefix="noetl-e2e-"))
    os.chmod(home, 0o755)
    state = start_stack(home)
    try:
        api = Api(state.api, token=state.tokens.get("admin", ""), ca_file=state.ca_file)
        dsn = state.postgres_dsn
        for name in CREDENTIALS:
            api.credentials.PutCredential(catalog_pb2.PutCredentialRequest(
                name=name, kind="postgres", data=values.to_struct({"dsn": dsn})), timeout=10)
        api.close()
        yield state
    finally:
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def runner(stack: devstack.StackState) -> Iterator[Runner]:
    r = Runner(stack)
    yield r
    r.api.close()




@pytest.fixture(scope="module")
def db(runner: Runner) -> Iterator[Db]:
    """One autocommit connection to the Postgres of the module's ``runner`` (a module's own
    stack when it defines one, else the session's)."""
    d = Db(runner.state.postgres_dsn)
    yield d
    d.close()
