"""A half-dead local stack heals in place: Postgres (postmaster SIGKILLed, or stopped with
pg_ctl) and NATS (SIGKILLed) come back on their data, store and port, dead role replicas
under their instance name and gRPC port, and everything alive is left alone. The roles
are the FAKE role program (fakerole.py); Postgres and NATS are real."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fakerole import command_for, write_fake_role
from psycopg.conninfo import conninfo_to_dict
from waiting import until_sync

from noetl_cli import devstack, stackpg
from noetl_cli.home import state_path
from noetl_cli.localstack import group_members, pid_alive
from noetl_cli.main import main
from noetl_cli.ports import PortTaken

pytestmark = pytest.mark.integration

ROLE_DSN_SUFFIX = " application_name=noetl-role"


@pytest.fixture(scope="module")
def health_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("health")


@pytest.fixture(scope="module")
def stack(session_dir: Path, tmp_path_factory: pytest.TempPathFactory,
          health_dir: Path) -> Iterator[devstack.StackState]:
    fake = write_fake_role(tmp_path_factory.mktemp("fake"))
    home = session_dir / "heal-home"
    # synchronous_commit: a commit acknowledged before the postmaster is SIGKILLed survives it.
    # role_postgres_dsn: the roles get their own DSN (a fault proxy's, in chaos tests).
    state = devstack.up(home, {"worker": 2}, role_command=command_for(fake),
                        env={"FAKE_HEALTH_DIR": str(health_dir)}, synchronous_commit=True,
                        role_postgres_dsn=lambda direct: direct + ROLE_DSN_SUFFIX)
    yield state
    state.shutdown(timeout=2)  # refresh(): also what a `dev up` in this process restarted


def role_pids(state: devstack.StackState) -> dict[str, int]:
    return {p.instance: p.pid for p in state.processes()}


def status_json(home: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = main(["dev", "status", "--json", "--home", str(home)])
    return code, json.loads(capsys.readouterr().out)


async def stream_names(stack: devstack.StackState) -> list[str]:
    nc = await stack.nats_connect("test-heal")
    try:
        return [s.config.name for s in await nc.jetstream().streams_info() if s.config.name]
    finally:
        await nc.close()


def test_dev_up_restarts_killed_postgres_and_nats_in_place(
        stack: devstack.StackState, capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(stack.postgres_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE heal_probe (x int)")
        conn.execute("INSERT INTO heal_probe VALUES (42)")
    streams = asyncio.run(stream_names(stack))
    assert streams, "the stack created its JetStream streams"
    roles = role_pids(stack)
    pg_pid, pg_port = stack.postgres["pid"], stack.postgres["port"]
    nats_pid, nats_port = stack.nats["pid"], stack.nats["port"]

    # A client session is open while the postmaster dies: its backend lingers a moment.
    held = psycopg.connect(stack.postgres_dsn, autocommit=True)
    assert stack.kill_postgres() == pg_pid and not pid_alive(pg_pid)
    assert stack.kill_nats() == nats_pid and not pid_alive(nats_pid)
    held.close()

    code, doc = status_json(stack.home, capsys)
    assert code == 1
    assert doc["postgres"] == {"status": "DEAD", "pid": pg_pid, "port": pg_port}
    assert doc["nats"] == {"status": "DEAD", "pid": nats_pid, "port": nats_port}
    assert doc["healthy"] is False
    assert {e["instance"]: e["health"] for es in doc["services"].values() for e in es} == dict.fromkeys(
        roles, "SERVING")
    assert main(["dev", "status", "--home", str(stack.home)]) == 1
    human = capsys.readouterr()
    assert f"DEAD, pid {pg_pid} gone" in human.out and f"DEAD, pid {nats_pid} gone" in human.out
    assert "not running: postgres, nats; `noetl-rt dev up` restarts them in place" in human.err

    assert main(["dev", "up", "--detach", "--home", str(stack.home)]) == 0
    out = capsys.readouterr()
    assert "healing the local stack" in out.err
    assert f"postgres restarted in place (port {pg_port}" in out.err
    assert f"nats restarted in place (port {nats_port}" in out.err
    assert "local stack up (restarted in place: postgres, nats)" in out.out

    stack.refresh()
    assert stack.postgres["port"] == pg_port and stack.postgres["pid"] != pg_pid
    assert stack.nats["port"] == nats_port and stack.nats["pid"] != nats_pid
    assert role_pids(stack) == roles, "live roles are left alone"
    with psycopg.connect(stack.postgres_dsn) as conn:  # the same DSN: same port, same data
        assert conn.execute("SELECT x FROM heal_probe").fetchall() == [(42,)]
        settings = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name IN "
                                     "('fsync', 'synchronous_commit', 'full_page_writes')").fetchall())
        assert settings == {"fsync": "off", "synchronous_commit": "on", "full_page_writes": "off"}
    assert sorted(asyncio.run(stream_names(stack))) == sorted(streams)
    code, doc = status_json(stack.home, capsys)
    assert code == 0 and doc["healthy"] is True
    assert doc["postgres"]["status"] == doc["nats"]["status"] == "running"


def test_postgres_stopped_with_pg_ctl_and_started_again(stack: devstack.StackState,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    stack.refresh()
    port, pid = stack.postgres["port"], stack.postgres["pid"]
    for mode in ("fast", "immediate"):
        stack.stop_postgres(mode)
        assert not stack.postgres_alive() and not group_members(pid)
        code, doc = status_json(stack.home, capsys)
        assert code == 1 and doc["postgres"]["status"] == "DEAD"
        pid = stack.start_postgres()
        assert stack.postgres_alive() and stack.postgres["port"] == port
        assert json.loads((stack.home / "dev" / "state.json").read_text())["postgres"]["pid"] == pid
        with psycopg.connect(stack.postgres_dsn) as conn:
            assert conn.execute("SELECT x FROM heal_probe").fetchall() == [(42,)]
            assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
        # back with the same TLS-only pg_hba and the roles' users
        with pytest.raises(psycopg.OperationalError, match="no encryption"):
            psycopg.connect(stack.postgres_dsn + " sslmode=disable")
        with psycopg.connect(stack.role_dsn("worker")) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (stackpg.login_user("worker"),)
    assert stack.start_postgres() == pid  # already running: no-op
    assert stack.start_nats() == stack.nats["pid"]


def role_dsn(proc: devstack.ServiceProcess) -> str:
    return str(json.loads(Path(proc.ready_file).read_text())["env"]["NOETL_POSTGRES_DSN"])


def test_up_restarts_a_dead_replica_under_its_name_and_port(stack: devstack.StackState) -> None:
    assert stack.role_postgres_dsn == stack.postgres_dsn + ROLE_DSN_SUFFIX
    # the worker's own login user on the roles' way to Postgres; no password in state.json
    worker_dsn = conninfo_to_dict(role_dsn(stack.process("worker", 1)))
    assert worker_dsn.pop("user") == stackpg.login_user("worker") and worker_dsn.pop("password")
    via = conninfo_to_dict(stack.role_postgres_dsn)
    assert via.pop("passfile") and worker_dsn == {k: v for k, v in via.items() if k != "user"}
    recorded = state_path(stack.home).read_text()
    assert "password" not in recorded and stackpg.passwords(stack.dev_dir)["worker"] not in recorded
    assert stack.client_env()["NOETL_POSTGRES_DSN"] == stack.postgres_dsn  # clients and tests: direct
    worker = stack.process("worker", 1)
    old_pid, old_grpc = worker.pid, worker.grpc
    others = {k: v for k, v in role_pids(stack).items() if k != "worker-1"}
    stack.kill("worker", 1)
    until_sync(lambda: not worker.alive(), timeout=10, what="worker-1 to die")
    lines: list[str] = []
    healed = devstack.up(stack.home, progress=lines.append)
    assert healed.healed == ["worker-1"]
    again = healed.process("worker", 1)
    assert again.pid != old_pid and again.grpc == old_grpc and again.instance == "worker-1"
    assert role_dsn(again) == stack.role_dsn("worker")  # recorded in state.json, given again
    assert any(line.startswith("worker-1 restarted (pid ") for line in lines), lines
    healed.forget_children()
    stack.refresh()
    assert {k: v for k, v in role_pids(stack).items() if k != "worker-1"} == others
    assert stack.process("worker", 1).pid == again.pid
    assert devstack.status(stack.home).healthy  # type: ignore[union-attr]


def test_heal_waits_for_every_role_to_answer_serving(stack: devstack.StackState, health_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A role that answers NOT_SERVING (as one that lost Postgres does) is shown as such,
    and heal returns only once it is SERVING again."""
    flag = health_dir / "projector-0"
    flag.write_text("NOT_SERVING")
    try:
        until_sync(lambda: status_json(stack.home, capsys)[1]["services"]["projector"][0]["health"] == "NOT_SERVING",
                   timeout=10, what="projector-0 to report NOT_SERVING")
        assert main(["dev", "status", "--home", str(stack.home)]) == 1
        assert "NOT_SERVING" in capsys.readouterr().out
        with pytest.raises(devstack.StackError, match="projector-0 is not SERVING"):
            stack.heal(timeout=1)
        stack.kill_nats()
        flag.write_text("SERVING")
        assert stack.heal() == ["nats"]
    finally:
        flag.unlink(missing_ok=True)
    assert devstack.status(stack.home).healthy  # type: ignore[union-attr]


def test_a_taken_port_fails_clearly_and_keeps_the_stack(stack: devstack.StackState,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    port = stack.nats["port"]
    stack.kill_nats()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(PortTaken) as exc:
            stack.start_nats()
        assert exc.value.port == port and f"pid {os.getpid()} (" in exc.value.holder
        assert main(["dev", "up", "--detach", "--home", str(stack.home)]) == 1
        err = capsys.readouterr().err
        assert f"cannot start nats on its port {port}: the port is taken by pid " in err
        assert "`noetl-rt dev down` to start afresh" in err
    assert (stack.home / "dev" / "state.json").exists() and stack.postgres_alive()
    assert stack.heal() == ["nats"]


def test_a_whole_stack_is_not_restarted(stack: devstack.StackState) -> None:
    with pytest.raises(devstack.StackRunning, match="already running"):
        devstack.up(stack.home)
    assert devstack.heal(stack.home).healed == []
    with pytest.raises(Exception, match="no local stack recorded"):
        devstack.heal(stack.home / "nothing-here")
