"""The local stack itself: seven roles as separate processes, all SERVING; `dev status
--json` shape; `dev down` leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from harness import REPO

from noetl_cli import devstack
from noetl_cli.localstack import pid_alive

pytestmark = pytest.mark.e2e

ROLES = {"shard-manager", "api", "projector", "checkpointer", "compactor", "reaper", "worker"}


def test_status_json_lists_every_role_serving(stack: devstack.StackState) -> None:
    st = devstack.status(stack.home)
    assert st is not None
    doc = st.to_json()
    assert {"api", "postgres_dsn", "nats_url", "services"} <= set(doc)
    assert set(doc["services"]) == ROLES
    pids = set()
    for role, procs in doc["services"].items():
        assert procs, role
        for p in procs:
            assert p["health"] == "SERVING", (role, p)
            assert ":" in p["metrics"] and p["pid"] > 0
            pids.add(p["pid"])
    assert len(pids) == len(ROLES), "each role is its own OS process"


def test_cli_dev_up_scale_status_down_leaves_nothing() -> None:
    home = Path(tempfile.mkdtemp(prefix="noetl-dev-"))
    os.chmod(home, 0o755)
    env = {**os.environ, "NOETL_HOME": str(home)}
    env.pop("NOETL_API", None)
    cli = [sys.executable, "-m", "noetl_cli"]
    try:
        up = subprocess.run([*cli, "dev", "up", "--detach", "--scale", "api=2,worker=2"], env=env,
                            capture_output=True, text=True, timeout=180, cwd=str(REPO))
        assert up.returncode == 0, up.stderr
        status = subprocess.run([*cli, "dev", "status", "--json"], env=env, capture_output=True, text=True,
                                timeout=60, cwd=str(REPO))
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert len(doc["services"]["api"]) == 2 and len(doc["services"]["worker"]) == 2
        assert doc["api"].startswith("ipv4:") and doc["api"].count(",") == 1
        pids = [p["pid"] for procs in doc["services"].values() for p in procs]
        state = json.loads((home / "dev" / "state.json").read_text())
        infra = [state["postgres"]["pid"], state["nats"]["pid"]]
        down = subprocess.run([*cli, "dev", "down"], env=env, capture_output=True, text=True, timeout=120,
                              cwd=str(REPO))
        assert down.returncode == 0, down.stderr
        assert not [p for p in pids + infra if pid_alive(p)], "dev down left processes behind"
        again = subprocess.run([*cli, "dev", "status", "--json"], env=env, capture_output=True, text=True,
                               timeout=60, cwd=str(REPO))
        assert again.returncode == 3
    finally:
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)
