"""The client commands against an in-process fake api (a gRPC test double on loopback)."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from noetl_cli import client
from noetl_cli.main import main
from noetl_client import values
from noetl_proto.v1 import (
    catalog_pb2,
    catalog_pb2_grpc,
    common_pb2,
    execution_pb2,
    execution_pb2_grpc,
)

EXEC_ID = 9_007_199_254_740_993  # above 2**53: must survive as a string in JSON


def snapshot(status: int, steps: dict[str, int], results: bool = False) -> execution_pb2.Execution:
    ex = execution_pb2.Execution(execution_id=EXEC_ID, shard_id=1, playbook_path="tests/fake",
                                 playbook_version=1, status=status)  # type: ignore[arg-type]
    for name, st in steps.items():
        s = ex.steps.add(name=name, status=st)  # type: ignore[arg-type]
        if results:
            s.result.CopyFrom(values.to_value({"step": name}))
    if status == common_pb2.EXECUTION_STATUS_FAILED:
        ex.error = "step end failed"
    return ex


RUN, DONE = common_pb2.STEP_STATUS_RUNNING, common_pb2.STEP_STATUS_COMPLETED
E_RUN, E_DONE = common_pb2.EXECUTION_STATUS_RUNNING, common_pb2.EXECUTION_STATUS_COMPLETED


@dataclass
class Fake:
    """What the fake api answers; tests adjust it."""

    watch: list[execution_pb2.Execution] = field(default_factory=lambda: [
        snapshot(E_RUN, {"start": RUN}), snapshot(E_RUN, {"start": DONE, "end": RUN}),
        snapshot(E_DONE, {"start": DONE, "end": DONE})])
    break_watch_after: int | None = None
    final_status: int = E_DONE
    polls: int = 0
    submits: list[execution_pb2.SubmitExecutionRequest] = field(default_factory=list)
    credentials: list[catalog_pb2.PutCredentialRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def final(self, results: bool) -> execution_pb2.Execution:
        steps = {"start": DONE, "end": DONE if self.final_status == E_DONE else common_pb2.STEP_STATUS_FAILED}
        return snapshot(self.final_status, steps, results)


class Executions(execution_pb2_grpc.ExecutionServiceServicer):
    def __init__(self, fake: Fake) -> None:
        self.fake = fake

    def SubmitExecution(self, request: Any, context: Any) -> Any:
        self.fake.submits.append(request)
        if "invalid" in request.playbook_yaml:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "workflow[0].tool: field required")
        return execution_pb2.SubmitExecutionResponse(execution_id=EXEC_ID, shard_id=1, playbook_path="tests/fake",
                                                     playbook_version=1)

    def WatchExecution(self, request: Any, context: Any) -> Iterator[Any]:
        for i, ex in enumerate(self.fake.watch):
            if self.fake.break_watch_after is not None and i >= self.fake.break_watch_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "stream broke")
            yield execution_pb2.WatchExecutionResponse(execution=ex)

    def GetExecution(self, request: Any, context: Any) -> Any:
        if request.execution_id != EXEC_ID:
            context.abort(grpc.StatusCode.NOT_FOUND, f"execution {request.execution_id} not found")
        with self.fake.lock:
            self.fake.polls += 1
            polls = self.fake.polls
        if self.fake.final_status == E_RUN or (not request.include_results and polls < 3):
            return execution_pb2.GetExecutionResponse(execution=snapshot(E_RUN, {"start": RUN}))
        return execution_pb2.GetExecutionResponse(execution=self.fake.final(request.include_results))

    def CancelExecution(self, request: Any, context: Any) -> Any:
        return execution_pb2.CancelExecutionResponse(accepted=request.execution_id == EXEC_ID)

    def GetEvents(self, request: Any, context: Any) -> Any:
        events = [common_pb2.EventRecord(event_id=i, execution_id=EXEC_ID, shard_seq=100 + i,
                                         event_type="call.done", step=f"s{i}", command_id=f"c{i}",
                                         result=values.to_struct({"status": "ok", "context": {"i": i}}))
                  for i in range(1, 6)]
        page = [e for e in events if e.event_id > request.after_event_id][: request.page_size]
        return execution_pb2.GetEventsResponse(events=page)

    def GetTrace(self, request: Any, context: Any) -> Any:
        if request.execution_id != EXEC_ID or request.step not in ("pipe", "empty"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"step {request.step!r} of execution {request.execution_id} not found")
        if request.step == "empty":
            return execution_pb2.GetTraceResponse()
        entries = [execution_pb2.TraceEntry(ref_id=EXEC_ID + 2, parent_ref_id=EXEC_ID + 1, tier="s3",
                                            uri="s3://b/k2", size_bytes=20, task="total", command_id="c:pipe:1",
                                            step="pipe", sha256="ab"),
                   execution_pb2.TraceEntry(ref_id=EXEC_ID + 1, tier="db", uri="pg://result_payload/1",
                                            size_bytes=10, task="fetch", command_id="c:pipe:1", step="pipe")]
        entries[0].created_at.FromSeconds(1_700_000_000)
        return execution_pb2.GetTraceResponse(entries=entries, from_manifest=True)


class Catalog(catalog_pb2_grpc.CatalogServiceServicer):
    def RegisterPlaybook(self, request: Any, context: Any) -> Any:
        entry = catalog_pb2.CatalogEntry(catalog_id=1, path="tests/fake", version=3, kind="Playbook")
        return catalog_pb2.RegisterPlaybookResponse(entry=entry, created=True)

    def ListPlaybooks(self, request: Any, context: Any) -> Any:
        entries = [catalog_pb2.CatalogEntry(path="tests/a", version=1, kind="Playbook"),
                   catalog_pb2.CatalogEntry(path="tests/b", version=4, kind="Playbook")]
        if not request.page_token:
            return catalog_pb2.ListPlaybooksResponse(entries=entries[:1], next_page_token="p2")
        return catalog_pb2.ListPlaybooksResponse(entries=entries[1:])


class Credentials(catalog_pb2_grpc.CredentialServiceServicer):
    def __init__(self, fake: Fake) -> None:
        self.fake = fake

    def PutCredential(self, request: Any, context: Any) -> Any:
        self.fake.credentials.append(request)
        return catalog_pb2.PutCredentialResponse(name=request.name, created=True)

    def ListCredentials(self, request: Any, context: Any) -> Any:
        return catalog_pb2.ListCredentialsResponse(credentials=[catalog_pb2.CredentialInfo(name="pg", kind="postgres")])


@pytest.fixture
def api() -> Iterator[tuple[str, Fake]]:
    fake = Fake()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(Executions(fake), server)
    catalog_pb2_grpc.add_CatalogServiceServicer_to_server(Catalog(), server)
    catalog_pb2_grpc.add_CredentialServiceServicer_to_server(Credentials(fake), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", fake
    server.stop(0).wait()


@pytest.fixture
def playbook(tmp_path: Path) -> Path:
    path = tmp_path / "pb.yaml"
    path.write_text("metadata: {path: tests/fake}\nworkflow: [{step: start}]\n")
    return path


def test_run_json_prints_exactly_one_document(api: tuple[str, Fake], playbook: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    target, fake = api
    code = main(["--api", target, "run", str(playbook), "--json", "--payload", '{"x": 1}', "--timeout", "20",
                 "--idempotency-key", "k"])
    captured = capsys.readouterr()
    assert code == 0
    assert json.loads(captured.out) == {
        "execution_id": str(EXEC_ID), "status": "COMPLETED",
        "steps": {"start": {"status": "COMPLETED", "result": {"step": "start"}},
                  "end": {"status": "COMPLETED", "result": {"step": "end"}}},
        "error": None,
    }
    req = fake.submits[0]
    assert values.from_struct(req.payload) == {"x": 1}
    assert req.timeout_seconds == 20 and req.idempotency_key == "k" and "tests/fake" in req.playbook_yaml
    # live progress on stderr, in order
    err = captured.err.splitlines()
    assert err.index("  start  RUNNING") < err.index("  start  COMPLETED") < err.index("  end    COMPLETED")
    assert "execution COMPLETED" in err


def test_run_human_summary(api: tuple[str, Fake], playbook: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--api", api[0], "run", str(playbook)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"execution {EXEC_ID} COMPLETED")
    assert "result of end:" in out


def test_run_failed_exits_1(api: tuple[str, Fake], playbook: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, fake = api
    fake.final_status = common_pb2.EXECUTION_STATUS_FAILED
    fake.watch[-1] = snapshot(common_pb2.EXECUTION_STATUS_FAILED, {"start": DONE})
    assert main(["--api", target, "run", str(playbook), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "FAILED" and doc["error"] == "step end failed"
    assert doc["steps"]["end"]["status"] == "FAILED"


def test_run_falls_back_to_polling_when_the_stream_breaks(
        api: tuple[str, Fake], playbook: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, fake = api
    fake.break_watch_after = 1
    assert main(["--api", target, "run", str(playbook), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "COMPLETED"
    assert fake.polls >= 3


def test_run_invalid_playbook_exits_2(api: tuple[str, Fake], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("invalid: true\n")
    assert main(["--api", api[0], "run", str(bad), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: workflow[0].tool: field required" in captured.err


def test_run_client_timeout(api: tuple[str, Fake], playbook: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    target, fake = api
    fake.final_status = E_RUN
    fake.watch = [snapshot(E_RUN, {"start": RUN})]
    monkeypatch.setattr(client, "time", _FastClock())
    assert main(["--api", target, "run", str(playbook), "--json", "--timeout", "1"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["status"] == "RUNNING" and "timed out" in doc["error"]
    assert "did not finish within --timeout 1s" in captured.err


class _FastClock:
    """time for the client module: sleeps advance a fake monotonic clock instantly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 0.05
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_status_events_cancel(api: tuple[str, Fake], capsys: pytest.CaptureFixture[str]) -> None:
    target, _ = api
    assert main(["--api", target, "status", str(EXEC_ID), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["execution_id"] == str(EXEC_ID) and doc["playbook_path"] == "tests/fake"

    assert main(["--api", target, "status", "12"]) == 1
    assert "execution 12 not found" in capsys.readouterr().err

    assert main(["--api", target, "events", str(EXEC_ID)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[1].split() == ["101", "call.done", "s1", "c1", "ok", 'ctx={"i":1}']

    # paging: page_size 2 makes the client follow after_event_id
    with client.Api(target) as a:
        assert client.events(a, EXEC_ID, as_json=True, page_size=2) == 0
    assert [e["shard_seq"] for e in json.loads(capsys.readouterr().out)["events"]] == [101, 102, 103, 104, 105]

    assert main(["--api", target, "cancel", str(EXEC_ID)]) == 0
    assert "cancel requested" in capsys.readouterr().out
    assert main(["--api", target, "cancel", "5"]) == 1


def test_playbooks_and_credentials(api: tuple[str, Fake], playbook: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    target, fake = api
    assert main(["--api", target, "playbook", "register", str(playbook)]) == 0
    assert capsys.readouterr().out.strip() == "tests/fake version 3 registered"
    assert main(["--api", target, "playbook", "list"]) == 0
    out = capsys.readouterr().out
    assert "tests/a" in out and "tests/b" in out  # both pages

    # the secret comes from stdin or a file, never from argv
    monkeypatch.setattr("sys.stdin", io.StringIO("host=db password=s3cret\n"))
    assert main(["--api", target, "credential", "add", "pg", "--kind", "postgres"]) == 0
    assert values.from_struct(fake.credentials[-1].data) == {"dsn": "host=db password=s3cret"}
    secret = tmp_path / "tok.json"
    secret.write_text('{"token": "t0ken-value"}')
    assert main(["--api", target, "credential", "add", "tok", "--kind", "http_bearer", "--from-file", str(secret)]) == 0
    assert fake.credentials[-1].kind == "http_bearer"
    assert values.from_struct(fake.credentials[-1].data) == {"token": "t0ken-value"}
    monkeypatch.setattr("sys.stdin", io.StringIO("pa55word"))
    assert main(["--api", target, "credential", "add", "svc", "--kind", "http_basic", "--username", "bob"]) == 0
    assert values.from_struct(fake.credentials[-1].data) == {"password": "pa55word", "username": "bob"}
    capsys.readouterr()
    sent = len(fake.credentials)
    for argv in (["--dsn", "host=db password=s3cret"], ["--data", '{"token": "t"}'], ["s3cret"]):
        assert main(["--api", target, "credential", "add", "x", "--kind", "postgres", *argv]) == 2
        err = capsys.readouterr().err
        assert "not accepted on the command line" in err and "s3cret" not in err
    monkeypatch.setattr("sys.stdin", io.StringIO("[1]"))
    assert main(["--api", target, "credential", "add", "x", "--kind", "generic"]) == 0  # one value: {"value": "[1]"}
    monkeypatch.setattr("sys.stdin", io.StringIO('{"token": '))
    assert main(["--api", target, "credential", "add", "x", "--kind", "generic"]) == 2
    assert "not valid JSON (line 1" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["--api", target, "credential", "add", "x", "--kind", "postgres"]) == 2
    monkeypatch.setattr("sys.stdin", io.StringIO("pw"))
    assert main(["--api", target, "credential", "add", "x", "--kind", "http_basic"]) == 2  # no --username
    assert main(["--api", target, "credential", "add", "x", "--kind", "k", "--from-file", str(tmp_path / "no")]) == 2
    assert len(fake.credentials) == sent + 1
    assert main(["--api", target, "credential", "list", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == [{"name": "pg", "kind": "postgres", "updated_at": None}]


def test_trace(api: tuple[str, Fake], capsys: pytest.CaptureFixture[str]) -> None:
    target, _ = api
    assert main(["--api", target, "trace", str(EXEC_ID), "pipe", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["from_manifest"] is True and doc["step"] == "pipe"
    assert [e["ref_id"] for e in doc["entries"]] == [str(EXEC_ID + 2), str(EXEC_ID + 1)]  # ids as text
    assert doc["entries"][0]["parent_ref_id"] == str(EXEC_ID + 1) and doc["entries"][1]["parent_ref_id"] is None
    assert doc["entries"][0]["created_at"].startswith("2023-11-14T22:13:20")

    assert main(["--api", target, "trace", str(EXEC_ID), "pipe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["REF", "PARENT", "TIER", "SIZE", "TASK", "COMMAND", "CREATED", "URI"]
    assert lines[1].split()[:5] == [str(EXEC_ID + 2), str(EXEC_ID + 1), "s3", "20", "total"]
    assert lines[2].split()[:5] == [str(EXEC_ID + 1), "-", "db", "10", "fetch"]
    assert "manifest" in lines[-1]

    assert main(["--api", target, "trace", str(EXEC_ID), "empty"]) == 0
    assert "has no result reference" in capsys.readouterr().out
    assert main(["--api", target, "trace", str(EXEC_ID), "nope"]) == 1
    assert "step 'nope'" in capsys.readouterr().err
    assert main(["--api", target, "trace", "abc", "pipe"]) == 2
