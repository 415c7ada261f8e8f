"""The real roles, as processes, on a local stack whose Postgres stops: `noetl-rt run` fails
fast naming postgres and the fix, `dev status` shows it DEAD, `dev up` restarts it in
place (same port and data, the roles untouched), and `dev status` is healthy again.
The roles reach Postgres through the chaos tests' fault proxy (in pass mode), the CLI and
the test directly: real role traffic goes through it.

How the roles themselves cope with the outage (retrying, NOT_SERVING meanwhile) is not
tested here: only what the launcher and the CLI do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from noetl_cli import devstack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from faultproxy import FaultProxy

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HELLO = REPO / "examples" / "hello_world.yaml"


@pytest.fixture(scope="module")
def proxy() -> Iterator[FaultProxy]:
    with FaultProxy() as p:
        yield p


@pytest.fixture(scope="module")
def stack(proxy: FaultProxy) -> Iterator[devstack.StackState]:
    home = Path(tempfile.mkdtemp(prefix="noetl-outage-"))
    os.chmod(home, 0o755)
    state = devstack.up(home, timeout=120, role_postgres_dsn=proxy.dsn_via)
    try:
        yield state
    finally:
        state.shutdown()
        shutil.rmtree(home, ignore_errors=True)


def cli(state: devstack.StackState, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NOETL_API", "NOETL_POSTGRES_DSN")}
    env["NOETL_HOME"] = str(state.home)  # the api comes from the local stack's state file
    return subprocess.run([sys.executable, "-m", "noetl_cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=str(REPO))


def test_run_fails_fast_naming_postgres_and_dev_up_restarts_it(stack: devstack.StackState,
                                                              proxy: FaultProxy) -> None:
    assert conninfo_to_dict(stack.role_postgres_dsn)["port"] == str(proxy.port) and proxy.open_connections > 0
    assert conninfo_to_dict(stack.role_dsn("worker"))["port"] == str(proxy.port)  # each role's own user, via it
    before = cli(stack, "run", str(HELLO), "--json")
    assert before.returncode == 0, before.stderr
    execution_id = json.loads(before.stdout)["execution_id"]
    roles = {p.instance: p.pid for p in stack.processes()}
    pg_pid, port = stack.postgres["pid"], stack.postgres["port"]

    stack.stop_postgres("fast")
    started = time.monotonic()
    run = cli(stack, "run", str(HELLO))
    assert time.monotonic() - started < 15
    assert run.returncode == 1
    assert run.stderr.strip() == (f"error: the local stack's postgres is not running (pid {pg_pid}); "
                                  "`noetl-rt dev up` restarts it in place (data kept)")

    status = cli(stack, "dev", "status", "--json")
    assert status.returncode == 1
    doc = json.loads(status.stdout)
    assert doc["postgres"] == {"status": "DEAD", "pid": pg_pid, "port": port}
    assert "not running: postgres" in status.stderr

    up = cli(stack, "dev", "up", "--detach")
    assert up.returncode == 0, up.stderr
    assert f"postgres restarted in place (port {port}" in up.stderr and "every role SERVING" in up.stderr
    stack.refresh()
    assert stack.postgres["port"] == port and stack.postgres_alive()
    assert {p.instance: p.pid for p in stack.processes()} == roles
    with psycopg.connect(stack.postgres_dsn) as conn:  # the same DSN, the same data
        row = conn.execute("SELECT status FROM noetl.execution WHERE execution_id = %s",
                           (int(execution_id),)).fetchone()
    assert row is not None
    healthy = cli(stack, "dev", "status", "--json")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert json.loads(healthy.stdout)["healthy"] is True
