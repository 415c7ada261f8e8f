"""What the CLI says when the api cannot be reached, cannot serve, or the local stack has a
dead part: the pure mapping, then real gRPC servers on loopback (an api double that
answers UNAVAILABLE / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED, a socket that accepts and
never answers) and recorded local stacks whose processes are gone."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from noetl_cli import apichannel
from noetl_cli.apichannel import Api, CannotServe, describe_failure
from noetl_cli.home import write_state
from noetl_cli.main import main
from noetl_cli.supervise import start_ticks
from noetl_common.errors import Overloaded, Unavailable
from noetl_proto.v1 import execution_pb2, execution_pb2_grpc

S = grpc.StatusCode


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("NOETL_API", "NOETL_HOME", "NOETL_POSTGRES_DSN", "NOETL_SHARD_MANAGER_TARGET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def playbook(tmp_path: Path) -> Path:
    path = tmp_path / "pb.yaml"
    path.write_text("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t, path: t}\nworkflow: []\n")
    return path


# ---------------------------------------------------------------- the mapping


@pytest.mark.parametrize(("code", "details", "answered", "kind", "message"), [
    (S.UNAVAILABLE, "postgres unavailable: connection refused", True, CannotServe,
     "the api cannot serve the request: postgres unavailable: connection refused"),
    (S.UNAVAILABLE, "failed to connect to all addresses", False, Unavailable,
     "cannot reach the api at h:1 (from --api): failed to connect to all addresses"),
    (S.RESOURCE_EXHAUSTED, "too many executions in flight", True, Overloaded,
     "the api cannot serve the request: too many executions in flight"),
    (S.DEADLINE_EXCEEDED, "Deadline Exceeded", True, Unavailable,
     "the api at h:1 (from --api) did not answer within 30s"),
    (S.DEADLINE_EXCEEDED, "postgres did not answer within 5s", True, CannotServe,
     "the api cannot serve the request: postgres did not answer within 5s"),
])
def test_describe_failure(code: grpc.StatusCode, details: str, answered: bool, kind: type, message: str) -> None:
    err = describe_failure(code, details, answered=answered, target="h:1", source="--api")
    assert type(err) is kind and str(err) == message


def test_other_statuses_are_left_to_the_common_translation() -> None:
    for code in (S.INVALID_ARGUMENT, S.NOT_FOUND, S.INTERNAL, S.FAILED_PRECONDITION):
        assert describe_failure(code, "x", answered=True) is None
    err = describe_failure(S.UNAVAILABLE, "down", answered=True, what="shard-manager")
    assert str(err) == "the shard-manager cannot serve the request: down"


# ---------------------------------------------------------------- a real gRPC double of the api


class Failing(execution_pb2_grpc.ExecutionServiceServicer):
    """Every call fails with ``code``/``message``, or sleeps ``delay`` seconds first."""

    def __init__(self) -> None:
        self.code = S.UNAVAILABLE
        self.message = "postgres unavailable: connection to server at 127.0.0.1:5 refused"
        self.delay = 0.0
        self.calls = 0

    def SubmitExecution(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)  # a slow server (not a wait): the client's deadline is the test's point
        context.abort(self.code, self.message)

    def GetExecution(self, request: Any, context: Any) -> Any:
        return self.SubmitExecution(request, context)


@pytest.fixture
def failing() -> Iterator[tuple[str, Failing]]:
    servicer = Failing()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(servicer, server)
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # as an api without Postgres will say
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_run_prints_the_servers_reason_at_once(failing: tuple[str, Failing], playbook: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    target, servicer = failing
    started = time.monotonic()
    assert main(["--api", target, "run", str(playbook)]) == 1
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert err.startswith("error: the api cannot serve the request: postgres unavailable: connection to server")
    assert "Traceback" not in err and "cannot reach" not in err

    servicer.code, servicer.message = S.RESOURCE_EXHAUSTED, "too many executions in flight (limit 1000)"
    assert main(["--api", target, "status", "7"]) == 1
    assert "error: the api cannot serve the request: too many executions in flight (limit 1000)" in \
        capsys.readouterr().err


def test_a_call_past_its_deadline_names_the_api_and_the_wait(failing: tuple[str, Failing]) -> None:
    target, servicer = failing
    servicer.delay = 2.0
    with Api(target, "--api") as api, pytest.raises(Unavailable) as exc:
        api.call(api.executions.SubmitExecution, execution_pb2.SubmitExecutionRequest(), timeout=0.3)
    assert str(exc.value) == f"the api at {target} (from --api) did not answer within 0.3s"


def test_an_api_that_accepts_but_never_answers_fails_after_the_connect_timeout(
        playbook: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(apichannel, "CONNECT_TIMEOUT", 1.0)
    with socket.socket() as mute:  # the kernel completes the handshake; nobody ever answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        target = f"127.0.0.1:{mute.getsockname()[1]}"
        started = time.monotonic()
        assert main(["--api", target, "run", str(playbook)]) == 1
        elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 10, elapsed
    assert f"error: cannot reach the api at {target} (from --api): no answer within 1s" in capsys.readouterr().err


# ---------------------------------------------------------------- the local stack's dead parts


def _alive() -> dict[str, int]:
    return {"pid": os.getpid(), "started": start_ticks(os.getpid())}


def _dead(pid: int = 0) -> dict[str, int]:
    pid = pid or os.getpid()
    return {"pid": pid, "started": start_ticks(os.getpid()) + 1}  # the recorded process is gone


def _stack(home: Path, api: str, *, postgres: dict[str, int], nats: dict[str, int],
           api_proc: dict[str, int]) -> None:
    write_state(home, {"api": api, "postgres_dsn": "host=127.0.0.1 port=9", "nats_url": "nats://127.0.0.1:9",
                       "phase": "up", "postgres": postgres, "nats": nats,
                       "services": {"api": [{**api_proc, "instance": "api-0", "grpc": api, "index": 0}]}})


def test_a_dead_postgres_of_the_local_stack_fails_before_any_call(
        tmp_path: Path, playbook: Path, failing: tuple[str, Failing], capsys: pytest.CaptureFixture[str]) -> None:
    target, servicer = failing
    home = tmp_path / "h"
    _stack(home, target, postgres=_dead(4242), nats=_alive(), api_proc=_alive())
    assert main(["--home", str(home), "run", str(playbook)]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: the local stack's postgres is not running (pid 4242); "
        "`noetl-rt dev up` restarts it in place (data kept)")
    assert servicer.calls == 0
    # --api given: not the local stack, so no diagnosis; the server's reason
    assert main(["--home", str(home), "--api", target, "run", str(playbook)]) == 1
    assert "the api cannot serve the request: postgres unavailable" in capsys.readouterr().err


def test_a_dead_nats_blocks_run_but_not_reads(tmp_path: Path, playbook: Path, failing: tuple[str, Failing],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    target, servicer = failing
    home = tmp_path / "h"
    _stack(home, target, postgres=_alive(), nats=_dead(77), api_proc=_alive())
    assert main(["--home", str(home), "run", str(playbook)]) == 1
    assert "error: the local stack's nats is not running (pid 77); `noetl-rt dev up` restarts it" in \
        capsys.readouterr().err
    assert main(["--home", str(home), "status", "7"]) == 1  # reaches the api; its answer, then the diagnosis
    err = capsys.readouterr().err
    assert "error: the api cannot serve the request: postgres unavailable" in err
    assert "the local stack's nats is not running (pid 77)" in err and servicer.calls >= 1


def test_a_dead_api_of_the_local_stack_is_named(tmp_path: Path, playbook: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "h"
    _stack(home, "127.0.0.1:1", postgres=_alive(), nats=_alive(), api_proc=_dead(5151))
    assert main(["--home", str(home), "run", str(playbook)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: cannot reach the api at 127.0.0.1:1 (from the local stack")
    assert err[1] == ("the local stack's api-0 is not running (pid 5151); "
                      "`noetl-rt dev up` restarts it in place (data kept)")


def test_several_dead_parts_are_listed(tmp_path: Path, playbook: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "h"
    _stack(home, "127.0.0.1:1", postgres=_dead(11), nats=_dead(12), api_proc=_dead(13))
    assert main(["--home", str(home), "watch", "7"]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: the local stack's postgres (pid 11), nats (pid 12) and api-0 (pid 13) are not running; "
        "`noetl-rt dev up` restarts them in place (data kept)")
