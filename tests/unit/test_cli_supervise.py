"""Pure pieces of the launcher: targets, exit descriptions, log tails, state round trips."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from noetl_cli import devstack
from noetl_cli.supervise import (
    ServiceProcess,
    describe_exit,
    group_members,
    log_tail,
    same_process,
    start_ticks,
    target_of,
)


def test_target_of() -> None:
    assert target_of([]) == ""
    assert target_of(["127.0.0.1:5"]) == "127.0.0.1:5"
    assert target_of(["127.0.0.1:5", "", "127.0.0.1:6"]) == "ipv4:127.0.0.1:5,127.0.0.1:6"


def test_describe_exit() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(None) == "exited"


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 3) == "line 97\nline 98\nline 99"
    assert log_tail(tmp_path / "missing.log") == ""


def test_process_identity() -> None:
    me = os.getpid()
    assert start_ticks(me) > 0
    assert same_process(me, start_ticks(me)) and same_process(me)
    assert not same_process(me, start_ticks(me) + 1)  # a reused pid is not the recorded process
    assert me in group_members(os.getpgid(me))


def test_state_round_trip(tmp_path: Path) -> None:
    proc = ServiceProcess(role="api", index=1, pid=4242, grpc="127.0.0.1:5", metrics="127.0.0.1:6",
                          log="/l/api-1.log", ready_file="/r/api-1.json", runtime_id=9, command=["x", "api"],
                          started=77)
    assert proc.instance == "api-1"
    state = devstack.StackState(home=tmp_path, api="127.0.0.1:5", shard_manager="127.0.0.1:4",
                                postgres_dsn="host=h", nats_url="nats://n", postgres={"pid": 1},
                                nats={"pid": 2}, services={"api": [proc]}, phase="up",
                                env_overrides={"A": "b"})
    state.save()
    loaded = devstack.StackState.load(tmp_path)
    assert loaded is not None
    assert loaded.to_json() == state.to_json()
    assert loaded.process("api", 1).started == 77
    assert loaded.client_env()["NOETL_API"] == "127.0.0.1:5"
    assert devstack.StackState.load(tmp_path / "nothing") is None
