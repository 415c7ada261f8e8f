"""The local stack itself: seven roles as separate processes, all SERVING; `dev status
--json` shape; scaled replicas behind one api target that survives a dead replica;
`dev down` leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest
from harness import REPO
from waiting import until_sync

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


SCALED = {"shard-manager": 1, "api": 3, "projector": 2, "checkpointer": 1, "compactor": 1, "reaper": 1, "worker": 3}
HELLO = REPO / "examples" / "hello_world.yaml"


def _hello_world_via_cli(cli: list[str], env: dict[str, str]) -> dict[str, object]:
    run = subprocess.run([*cli, "run", str(HELLO), "--json", "--timeout", "90"], env=env, capture_output=True,
                         text=True, timeout=150, cwd=str(REPO))
    assert run.returncode == 0, (run.stdout, run.stderr)
    doc = json.loads(run.stdout)
    assert doc["status"] == "COMPLETED", doc
    steps = doc["steps"]
    assert steps["start"]["result"] == {"message": "Hello, World!", "length": 5}
    assert steps["shout"]["result"] == {"said": "HELLO, WORLD!"} and "whisper" not in steps
    assert steps["end"]["result"] == {"status": "done", "said": "HELLO, WORLD!"}
    return doc


def test_cli_dev_up_scale_status_kill_an_api_down_leaves_nothing() -> None:
    """Exactly `noetl-rt dev up --detach --scale api=3,projector=2,worker=3`: `"api"` is one
    round-robin target reaching the three replicas; the CLI runs hello_world, and still
    does after one api replica is SIGKILLed; `dev down` leaves no process behind."""
    home = Path(tempfile.mkdtemp(prefix="noetl-dev-"))
    os.chmod(home, 0o755)
    env = {**os.environ, "NOETL_HOME": str(home)}
    env.pop("NOETL_API", None)
    # NOETL_* settings pass through to the roles: fast leases, so the killed replica's
    # shards move within seconds rather than the default 30 s
    env.update({"NOETL_SHARD_HEARTBEAT_SEC": "1", "NOETL_SHARD_LEASE_SEC": "3"})
    cli = [str(Path(sys.executable).parent / "noetl-rt")]
    assert Path(cli[0]).exists(), f"the noetl-rt entry point is not installed: {cli[0]}"
    try:
        up = subprocess.run([*cli, "dev", "up", "--detach", "--scale", "api=3,projector=2,worker=3"], env=env,
                            capture_output=True, text=True, timeout=180, cwd=str(REPO))
        assert up.returncode == 0, up.stderr
        status = subprocess.run([*cli, "dev", "status", "--json"], env=env, capture_output=True, text=True,
                                timeout=60, cwd=str(REPO))
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert {role: len(procs) for role, procs in doc["services"].items()} == SCALED
        assert all(p["health"] == "SERVING" for procs in doc["services"].values() for p in procs), doc
        apis = doc["services"]["api"]
        addresses = [p["grpc"] for p in apis]
        assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses), addresses
        assert doc["api"] == "ipv4:" + ",".join(addresses), doc["api"]  # one target, every replica
        pids = [p["pid"] for procs in doc["services"].values() for p in procs]
        assert len(set(pids)) == sum(SCALED.values()), "each replica is its own OS process"
        state = json.loads((home / "dev" / "state.json").read_text())
        infra = [state["postgres"]["pid"], state["nats"]["pid"]]

        # `cluster`: the shard-manager's map; every sharded role's 16 shards held by live members
        cluster = subprocess.run([*cli, "cluster", "--json"], env=env, capture_output=True, text=True, timeout=60,
                                 cwd=str(REPO))
        assert cluster.returncode == 0, (cluster.stdout, cluster.stderr)
        view = json.loads(cluster.stdout)
        assert view["leader"]["instance"] == doc["services"]["shard-manager"][0]["instance"]
        assert view["unsettled"] == []
        for role in ("api", "projector", "checkpointer", "compactor", "reaper"):
            held = sorted(s for m in view["members"] if m["role"] == role for s in m["shards"])
            assert held == list(range(16)), (role, view["members"])
        projectors = [m for m in view["members"] if m["role"] == "projector"]
        assert sorted(len(m["shards"]) for m in projectors) == [8, 8], projectors  # balanced
        assert {m["pid"] for m in view["members"]} == set(pids)

        first = _hello_world_via_cli(cli, env)

        victim = apis[1]
        os.kill(victim["pid"], signal.SIGKILL)
        until_sync(lambda: not pid_alive(victim["pid"]), timeout=10, what=f"{victim['instance']} to die")
        again = subprocess.run([*cli, "dev", "status", "--json"], env=env, capture_output=True, text=True,
                               timeout=60, cwd=str(REPO))
        after = json.loads(again.stdout)
        assert again.returncode == 1, "a dead replica makes the stack unhealthy"
        assert after["api"] == doc["api"]
        assert [p["health"] != "SERVING" for p in after["services"]["api"]] == [False, True, False]

        second = _hello_world_via_cli(cli, env)  # same target, one address dead
        assert second["execution_id"] != first["execution_id"]
        # the dead replica's engine shards are taken over by the live ones
        live = {apis[0]["instance"], apis[2]["instance"]}
        with psycopg.connect(doc["postgres_dsn"], autocommit=True) as conn:
            def moved() -> bool:
                owners = conn.execute(
                    "SELECT l.shard_id, r.instance FROM noetl.shard_lease l LEFT JOIN noetl.runtime r"
                    " ON r.runtime_id = l.owner_runtime_id AND r.status = 'alive' WHERE l.role = 'api'").fetchall()
                assert len(owners) == 16 and {o[1] for o in owners} == live, owners
                return True

            until_sync(moved, timeout=30, what=f"api shards moved to {sorted(live)}", interval=0.1,
                       ignoring=AssertionError)
        cluster = subprocess.run([*cli, "cluster", "--role", "api"], env=env, capture_output=True, text=True,
                                 timeout=60, cwd=str(REPO))
        assert cluster.returncode == 0, (cluster.stdout, cluster.stderr)
        rows = {line.split()[1]: line.split() for line in cluster.stdout.splitlines()[2:]}
        assert rows[victim["instance"]][2:4] == ["no", "-"], cluster.stdout  # dead, holds nothing
        assert all(rows[i][2] == "yes" and rows[i][3] != "-" for i in live), cluster.stdout

        down = subprocess.run([*cli, "dev", "down"], env=env, capture_output=True, text=True, timeout=120,
                              cwd=str(REPO))
        assert down.returncode == 0, down.stderr
        assert not [p for p in pids + infra if pid_alive(p)], "dev down left processes behind"
        gone = subprocess.run([*cli, "dev", "status", "--json"], env=env, capture_output=True, text=True,
                              timeout=60, cwd=str(REPO))
        assert gone.returncode == 3
    finally:
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)
