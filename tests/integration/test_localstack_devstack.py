"""The local stack launcher supervising role processes, with a FAKE role program (a tiny
gRPC server with grpc.health.v1 that writes its ready file), so process supervision is
tested independently of the real roles: start order and wiring, status, kill/restart,
an early exit, a hang, and that `down` leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakerole import command_for, write_fake_role
from psycopg.conninfo import conninfo_to_dict
from waiting import until_sync

from noetl_cli import devstack, stackpg
from noetl_cli.localstack import pid_alive
from noetl_cli.main import main
from noetl_cli.supervise import group_members

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fake_role(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_role(tmp_path_factory.mktemp("fake"))


def ready_data(proc: devstack.ServiceProcess) -> dict:  # type: ignore[type-arg]
    return json.loads(Path(proc.ready_file).read_text())


def assert_gone(pids: list[int]) -> None:
    alive = [p for p in pids if p and (pid_alive(p) or group_members(p))]
    assert not alive, f"processes left behind: {alive}"


@pytest.fixture(scope="module")
def stack(session_dir: Path, fake_role: Path) -> Iterator[devstack.StackState]:
    home = session_dir / "stack-home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NOETL_SHARD_LEASE_SEC", "3")  # user NOETL_* settings pass through
        mp.setenv("NOETL_API_TARGET", "wrong:1")  # ... except what the stack decides
        lines: list[str] = []
        state = devstack.up(home, {"api": 2, "worker": 2}, role_command=command_for(fake_role),
                            env={"FAKE_CHILD": "1", "FAKE_IGNORE_TERM_ROLE": "reaper"}, progress=lines.append)
    state.progress_lines = lines  # type: ignore[attr-defined]
    yield state
    devstack.down(home, timeout=1)


def test_stack_is_up_and_wired(stack: devstack.StackState) -> None:
    lines = stack.progress_lines  # type: ignore[attr-defined]
    assert lines[0].startswith("postgres ready (port ") and lines[1].startswith("nats ready (port ")
    assert "api-1 SERVING at " + stack.process("api", 1).grpc in lines
    assert [r for r in stack.services] == list(devstack.ROLES)
    assert [p.instance for p in stack.processes("worker")] == ["worker-0", "worker-1"]

    sm = stack.process("shard-manager")
    api0, api1 = stack.processes("api")
    assert stack.shard_manager == sm.grpc
    assert stack.api == f"ipv4:{api0.grpc},{api1.grpc}"

    sm_env = ready_data(sm)["env"]
    assert sm_env["NOETL_SHARD_MANAGER_TARGET"] == "" and sm_env["NOETL_API_TARGET"] == ""
    api_env = ready_data(api0)["env"]
    assert api_env["NOETL_SHARD_MANAGER_TARGET"] == stack.shard_manager
    worker_env = ready_data(stack.process("worker", 1))["env"]
    assert worker_env["NOETL_API_TARGET"] == stack.api
    assert worker_env["NOETL_SHARD_MANAGER_TARGET"] == stack.shard_manager
    # the worker's own database user (not the owner's DSN): stackpg
    assert worker_env["NOETL_POSTGRES_DSN"] == stack.role_dsn("worker") != stack.postgres_dsn
    assert conninfo_to_dict(worker_env["NOETL_POSTGRES_DSN"])["user"] == stackpg.login_user("worker")
    assert worker_env["NOETL_INSTANCE"] == "worker-1"
    assert worker_env["NOETL_SHARD_LEASE_SEC"] == "3"
    assert worker_env["NOETL_GRPC_LISTEN"] == "127.0.0.1:0"
    assert worker_env["NOETL_METRICS_LISTEN"] == "127.0.0.1:0"
    assert worker_env["NOETL_READY_FILE"] == str(stack.run_dir / "worker-1.json")

    # migrated database and NATS streams exist
    import psycopg

    with psycopg.connect(stack.postgres_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM noetl.schema_migration").fetchone()[0] >= 1  # type: ignore[index]
    assert Path(stack.nats["store_dir"]).is_dir()

    # the credentials master key: made at up (0600, in a 0700 directory), given to the api only
    key_file = stack.credentials_key_file
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and oct(key_file.parent.stat().st_mode & 0o777) == "0o700"
    keys = key_file.read_text().strip()
    assert keys.startswith("local:") and len(keys) == len("local:") + 44
    assert {ready_data(p)["env"].get("NOETL_CREDENTIALS_KEYS") for p in stack.processes("api")} == {keys}
    assert all("NOETL_CREDENTIALS_KEYS" not in ready_data(p)["env"] for p in stack.processes() if p.role != "api")

    # NATS: TLS, a user per role (its password in secrets.json, never in state.json); roles
    # without NATS get no NATS URL
    assert stack.nats_url.startswith("tls://127.0.0.1:") and "@" not in stack.nats_url
    worker_url = worker_env["NOETL_NATS_URL"]
    assert worker_url == stack.nats_user_url("worker") and worker_url.startswith("tls://worker:")
    assert worker_env["NOETL_NATS_TLS_CA_FILE"] == stack.ca_file != ""
    assert api_env["NOETL_NATS_URL"].startswith("tls://api:") and sm_env["NOETL_NATS_URL"] == ""
    nats_conf = Path(stack.nats["config"])
    assert oct(nats_conf.stat().st_mode & 0o777) == "0o600"
    assert worker_url.split(":")[2].split("@")[0] not in (stack.home / "dev" / "state.json").read_text()

    recorded = json.loads((stack.home / "dev" / "state.json").read_text())
    assert recorded["api"] == stack.api and recorded["home"] == str(stack.home)
    assert keys.split(":", 1)[1] not in json.dumps(recorded)
    assert set(recorded) >= {"api", "shard_manager", "postgres_dsn", "nats_url", "postgres", "nats", "services"}
    assert set(recorded["services"]["api"][0]) >= {"pid", "grpc", "metrics", "instance", "log"}


def test_a_key_given_by_the_user_goes_to_the_api_only(stack: devstack.StackState,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_CREDENTIALS_KEYS", "mine:" + "B" * 43 + "=")
    assert stack.role_env(stack.process("api"))["NOETL_CREDENTIALS_KEYS"] == "mine:" + "B" * 43 + "="
    for proc in stack.processes():
        if proc.role != "api":
            assert "NOETL_CREDENTIALS_KEYS" not in stack.role_env(proc)


def test_status_json(stack: devstack.StackState, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev", "status", "--json", "--home", str(stack.home)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["api", "postgres_dsn", "nats_url", "services", "postgres", "nats", "healthy"]
    assert doc["api"] == stack.api and doc["postgres_dsn"] == stack.postgres_dsn
    assert doc["nats_url"] == stack.nats_url
    assert doc["postgres"] == {"status": "running", "pid": stack.postgres["pid"], "port": stack.postgres["port"]}
    assert doc["nats"] == {"status": "running", "pid": stack.nats["pid"], "port": stack.nats["port"]}
    assert doc["healthy"] is True
    assert list(doc["services"]) == list(devstack.ROLES)
    for role, entries in doc["services"].items():
        assert len(entries) == (2 if role in ("api", "worker") else 1)
        for e in entries:
            assert set(e) == {"pid", "health", "metrics", "grpc", "instance"}
            assert e["health"] == "SERVING" and isinstance(e["pid"], int)
            assert e["instance"].startswith(role + "-")


def test_up_refuses_while_a_stack_runs(stack: devstack.StackState, fake_role: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(devstack.StackRunning):
        devstack.up(stack.home, role_command=command_for(fake_role))
    assert main(["dev", "up", "--detach", "--home", str(stack.home)]) == 1
    assert "already running" in capsys.readouterr().err
    assert devstack.status(stack.home).healthy  # type: ignore[union-attr]


def test_kill_and_restart_one_replica(stack: devstack.StackState) -> None:
    worker = stack.process("worker", 1)
    old_pid, old_grpc, old_child = worker.pid, worker.grpc, ready_data(worker)["child"]
    stack.kill("worker", 1)
    until_sync(lambda: not worker.alive(), timeout=10, what="worker-1 to die", interval=0.02)
    report = devstack.status(stack.home)
    assert report is not None and not report.healthy
    assert [e["health"] for e in report.services["worker"]] == ["SERVING", "DEAD"]
    assert_gone([old_pid, old_child])

    stack.restart("worker", 1)
    assert worker.pid != old_pid and worker.grpc == old_grpc  # same port: targets stay valid
    assert "restart of worker-1" in Path(worker.log).read_text()
    report = devstack.status(stack.home)
    assert report is not None and report.healthy
    assert report.services["worker"][1]["pid"] == worker.pid

    extra = stack.add_replica("worker")
    assert extra.instance == "worker-2" and extra.health() == "SERVING"
    assert [e["instance"] for e in devstack.status(stack.home).services["worker"]] == [  # type: ignore[union-attr]
        "worker-0", "worker-1", "worker-2"]


def test_down_leaves_nothing_behind(stack: devstack.StackState) -> None:
    procs = stack.processes()
    pids = [p.pid for p in procs] + [ready_data(p)["child"] for p in procs]
    pids += [stack.nats["pid"], stack.postgres["pid"]]
    assert all(pid_alive(p) for p in pids)
    started = time.monotonic()
    assert devstack.down(stack.home, timeout=1) is True  # the reaper ignores SIGTERM: SIGKILL after 1 s
    assert time.monotonic() - started < 30
    assert_gone(pids)
    dev = stack.home / "dev"
    assert not (dev / "state.json").exists() and not (dev / "pg").exists() and not (dev / "nats").exists()
    assert not (dev / "secrets").exists()  # the key goes with the data it encrypted
    assert (dev / "logs" / "worker-1.log").exists()  # logs stay for post-mortems
    assert devstack.status(stack.home) is None
    assert devstack.down(stack.home) is False  # idempotent


def test_one_up_at_a_time(tmp_path: Path, fake_role: Path) -> None:
    from noetl_cli.devstack import _start_lock

    with _start_lock(tmp_path), pytest.raises(devstack.StackRunning, match="another"):
        devstack.up(tmp_path, role_command=command_for(fake_role))


def test_early_exit_fails_up_with_the_log_tail(tmp_path: Path, fake_role: Path) -> None:
    lines: list[str] = []
    with pytest.raises(devstack.StackError) as exc:
        devstack.up(tmp_path / "home", role_command=command_for(fake_role), env={"FAKE_FAIL_ROLE": "projector"},
                    progress=lines.append)
    err = exc.value
    assert err.instance == "projector-0" and "exited with code 3" in str(err)
    assert "cannot start: FAKE_FAIL_ROLE says so" in err.log_tail
    assert not (tmp_path / "home" / "dev" / "state.json").exists()
    assert not (tmp_path / "home" / "dev" / "pg").exists()
    started = [int(m) for line in lines for m in re.findall(r"\(pid (\d+)", line)]
    assert len(started) >= 2  # at least shard-manager-0 and api-0 were up before projector-0 failed
    assert_gone(started)


def test_a_hanging_role_times_out(tmp_path: Path, fake_role: Path) -> None:
    with pytest.raises(devstack.StackError) as exc:
        devstack.up(tmp_path / "home", {"worker": 2}, role_command=command_for(fake_role), timeout=8,
                    env={"FAKE_HANG_ROLE": "compactor"})
    assert exc.value.instance == "compactor-0" and "did not become ready" in str(exc.value)
    assert "compactor: hanging" in exc.value.log_tail
    assert not (tmp_path / "home" / "dev" / "state.json").exists()


# ---------------------------------------------------------------- the CLI, as a user runs it


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "noetl_cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def cli_env(fake_role: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NOETL_API", "NOETL_POSTGRES_DSN")}
    env.update({"NOETL_HOME": str(home), "NOETL_DEV_ROLE_COMMAND": f"{{python}} {fake_role} {{role}}"})
    return env


def recorded_pids(home: Path) -> list[int]:
    state = json.loads((home / "dev" / "state.json").read_text())
    pids = [s["pid"] for procs in state["services"].values() for s in procs]
    return [*pids, state["nats"]["pid"], state["postgres"]["pid"]]


def test_cli_dev_up_detach_status_down(tmp_path: Path, fake_role: Path) -> None:
    home = tmp_path / "home"
    env = cli_env(fake_role, home)
    up = cli("dev", "up", "--detach", "--scale", "api=2", env=env)
    assert up.returncode == 0, up.stderr
    assert "postgres ready (port " in up.stderr and "api-1 SERVING at 127.0.0.1:" in up.stderr
    assert "local stack up" in up.stdout
    pids = recorded_pids(home)
    try:
        assert all(pid_alive(p) for p in pids)  # they outlive the CLI process
        status = cli("dev", "status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert doc["api"].startswith("ipv4:127.0.0.1:") and len(doc["services"]["api"]) == 2
        human = cli("dev", "status", env=env)
        assert human.returncode == 0 and "worker-0" in human.stdout and "SERVING" in human.stdout
    finally:
        down = cli("dev", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert "local stack stopped" in down.stderr
    assert_gone(pids)
    assert cli("dev", "status", env=env).returncode == 3
    assert cli("dev", "down", env=env).returncode == 0


def test_cli_dev_up_foreground_stops_on_sigterm(tmp_path: Path, fake_role: Path) -> None:
    home = tmp_path / "home"
    proc = subprocess.Popen([sys.executable, "-m", "noetl_cli", "dev", "up"], env=cli_env(fake_role, home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        state_file = home / "dev" / "state.json"
        until_sync(lambda: proc.poll() is not None or (
            state_file.exists() and json.loads(state_file.read_text() or "{}").get("phase") == "up"),
            timeout=90, what="`dev up` to record phase up (or to exit)", interval=0.1)
        assert proc.poll() is None, proc.communicate()
        pids = recorded_pids(home)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "stopping the local stack" in err and "local stack stopped" in err
    assert_gone(pids)
    assert not state_file.exists()


def test_cli_dev_up_reports_a_failing_role(tmp_path: Path, fake_role: Path) -> None:
    env = cli_env(fake_role, tmp_path / "home")
    env["FAKE_FAIL_ROLE"] = "api"
    res = cli("dev", "up", "--detach", env=env)
    assert res.returncode == 1
    assert "error: api-0 exited with code 3" in res.stderr
    assert "api: cannot start: FAKE_FAIL_ROLE says so" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "home" / "dev" / "state.json").exists()
