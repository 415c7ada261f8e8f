"""Formatting of executions and events (pure: protobuf in, text/dicts out)."""

from __future__ import annotations

import io
import json

import pytest

from noetl_cli import output
from noetl_client import values
from noetl_proto.v1 import common_pb2, execution_pb2, shard_manager_pb2


def make_execution(status: int = common_pb2.EXECUTION_STATUS_COMPLETED, error: str = "") -> execution_pb2.Execution:
    ex = execution_pb2.Execution(execution_id=7340032123456789012, shard_id=3, playbook_path="tests/hello",
                                 playbook_version=2, status=status, error=error)  # type: ignore[arg-type]
    ex.created_at.FromSeconds(1_700_000_000)
    ex.started_at.FromSeconds(1_700_000_000)
    ex.ended_at.FromMilliseconds(1_700_000_001_500)
    ex.steps.add(name="start", status=common_pb2.STEP_STATUS_COMPLETED, result=values.to_value({"greeting": "hi", "n": 2}))
    ex.steps.add(name="fetch", status=common_pb2.STEP_STATUS_FAILED, error="boom")
    ex.steps.add(name="end", status=common_pb2.STEP_STATUS_SKIPPED, result=values.to_value("not json"))
    return ex


def test_execution_json_shape() -> None:
    doc = output.execution_json(make_execution())
    assert doc == {
        "execution_id": "7340032123456789012",
        "status": "COMPLETED",
        "steps": {
            "start": {"status": "COMPLETED", "result": {"greeting": "hi", "n": 2}},
            "fetch": {"status": "FAILED", "result": None},
            "end": {"status": "SKIPPED", "result": "not json"},
        },
        "error": None,
    }
    assert list(doc) == ["execution_id", "status", "steps", "error"]
    json.dumps(doc)  # serialisable as is


def test_execution_json_failed_with_error() -> None:
    doc = output.execution_json(make_execution(common_pb2.EXECUTION_STATUS_FAILED, "step fetch failed"))
    assert doc["status"] == "FAILED" and doc["error"] == "step fetch failed"
    doc = output.execution_json(make_execution(common_pb2.EXECUTION_STATUS_CANCELLED))
    assert doc["status"] == "CANCELLED" and doc["error"] is None


def test_print_json_writes_one_document(capsys) -> None:  # type: ignore[no-untyped-def]
    output.print_json(output.execution_json(make_execution()))
    out = capsys.readouterr().out
    assert json.loads(out)["execution_id"] == "7340032123456789012"


def test_detail_json_adds_fields() -> None:
    doc = output.execution_detail_json(make_execution())
    assert doc["playbook_path"] == "tests/hello" and doc["playbook_version"] == 2
    assert doc["steps"]["fetch"]["error"] == "boom"
    assert doc["ended_at"].startswith("2023-11-14T22:13:21.500")


def test_status_names() -> None:
    assert output.execution_status(common_pb2.EXECUTION_STATUS_RUNNING) == "RUNNING"
    assert output.step_status(common_pb2.STEP_STATUS_PENDING) == "PENDING"
    assert output.execution_status(99) == "STATUS_99"
    assert output.is_terminal(make_execution())
    assert not output.is_terminal(make_execution(common_pb2.EXECUTION_STATUS_RUNNING))


def test_summary() -> None:
    text = output.execution_summary(make_execution(common_pb2.EXECUTION_STATUS_FAILED, "step fetch failed"))
    lines = text.splitlines()
    assert lines[0] == "execution 7340032123456789012 FAILED (tests/hello v2, 1.50s)"
    assert "error: step fetch failed" in lines
    assert "  fetch  FAILED  (boom)" in lines
    assert "result of start:" in lines and '    "greeting": "hi",' in lines


def test_summary_truncates_big_results() -> None:
    ex = execution_pb2.Execution(execution_id=1, status=common_pb2.EXECUTION_STATUS_COMPLETED)
    ex.steps.add(name="big", status=common_pb2.STEP_STATUS_COMPLETED, result=values.to_value("x" * 10_000))
    assert "more characters; use --json" in output.execution_summary(ex)


def test_progress_lines() -> None:
    ex = make_execution()
    assert output.progress_lines({}, ex) == ["  start  COMPLETED", "  fetch  FAILED", "  end    SKIPPED"]
    assert output.progress_lines({"start": "COMPLETED", "fetch": "RUNNING", "end": "SKIPPED"}, ex) == [
        "  fetch  FAILED"]
    assert output.progress_lines(output.step_states(ex), ex) == []


def test_event_line_and_json() -> None:
    ev = common_pb2.EventRecord(
        event_id=11, execution_id=1, shard_id=2, shard_seq=42, event_type="call.done", step="start",
        command_id="c-1", meta=values.to_struct({"epoch_id": 3}),
        result=values.to_struct({"status": "ok", "reference": {"ref_id": 7, "type": "db", "uri": "pg://x/7"},
                                 "context": {"n": 2}}))
    line = output.event_line(ev)
    assert line.split()[:4] == ["42", "call.done", "start", "c-1"]
    assert line.endswith('ok ref=db:7 ctx={"n":2}')
    doc = output.event_json(ev)
    assert doc["shard_seq"] == 42 and doc["meta"] == {"epoch_id": 3} and doc["result"]["status"] == "ok"
    bare = common_pb2.EventRecord(shard_seq=1, event_type="playbook.started")
    assert output.event_line(bare).split() == ["1", "playbook.started", "-", "-"]
    rows = output.table([output.event_row(ev), output.event_row(bare)], header=output.EVENT_HEADER).splitlines()
    assert rows[0].split() == ["SEQ", "TYPE", "STEP", "COMMAND", "RESULT"]
    assert rows[1].index("call.done") == rows[2].index("playbook.started")


def test_table() -> None:
    assert output.table([("a", 1), ("bbb", 22)], header=("K", "V")) == "K    V\na    1\nbbb  22"
    assert output.table([]) == ""


def test_shard_ranges() -> None:
    assert output.shard_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert output.shard_ranges([3]) == "3" and output.shard_ranges([]) == "-"


def test_cluster_view_flags_shards_without_a_live_owner() -> None:
    now = 1_800_000_000 * 10**9
    resp = shard_manager_pb2.DescribeResponse(leader_instance="sm-0", leader_epoch=4)
    resp.members.add(runtime_id=1, role="api", instance="api-0", alive=True, pid=10)
    resp.members.add(runtime_id=2, role="api", instance="api-1", alive=False, pid=11)
    for shard, owner, lease_s in ((0, 1, 30), (1, 1, 30), (2, 2, 30), (3, 0, 0), (4, 1, -5)):
        s = resp.shards.add(role="api", shard_id=shard, owner_runtime_id=owner, epoch=shard + 1,
                            owner_instance={1: "api-0", 2: "api-1"}.get(owner, ""))
        if lease_s:
            s.leased_until.FromNanoseconds(now + lease_s * 10**9)
    view = output.cluster_view(resp, now_ns=now)
    assert view["leader"] == {"instance": "sm-0", "epoch": 4}
    assert [(m["instance"], m["alive"], m["shards"]) for m in view["members"]] == [
        ("api-0", True, [0, 1]), ("api-1", False, [])]
    assert [(u["shard_id"], u["why"]) for u in view["unsettled"]] == [
        (2, "owner api-1 not alive"), (3, "no owner"), (4, "lease expired")]
    text = output.cluster_text(view)
    assert text.splitlines()[0] == "leader: sm-0 (epoch 4)"
    assert "not held by a live member: api shards 2-4" in text


def test_summary_shows_a_python_error_with_its_type_and_traceback() -> None:
    from noetl_flow.projection import _message

    text = _message({"status": "error", "error": {
        "code": "TOOL_ERROR", "message": "division by zero", "exception_type": "ZeroDivisionError",
        "traceback": 'Traceback (most recent call last):\n  File "<task>", line 1\nZeroDivisionError: division by zero\n'}})
    assert text is not None and text.startswith("ZeroDivisionError: division by zero\nTraceback")
    ex = execution_pb2.Execution(execution_id=1, status=common_pb2.EXECUTION_STATUS_FAILED)
    ex.steps.add(name="calc", status=common_pb2.STEP_STATUS_FAILED, error=text)
    lines = output.execution_summary(ex).splitlines()
    assert "  calc  FAILED  (ZeroDivisionError: division by zero)" in lines
    assert '        File "<task>", line 1' in lines
    assert _message({"error": {"code": "HTTP_ERROR", "message": "GET x: HTTP 503"}}) == "GET x: HTTP 503"


def running_loop(done: int, failed: int = 0, total: int = 1000) -> execution_pb2.Execution:
    ex = execution_pb2.Execution(execution_id=1, status=common_pb2.EXECUTION_STATUS_RUNNING)
    ex.steps.add(name="start", status=common_pb2.STEP_STATUS_COMPLETED)
    step = ex.steps.add(name="each_item", status=common_pb2.STEP_STATUS_RUNNING, visits=1)
    step.loop.CopyFrom(execution_pb2.LoopProgress(total=total, done=done, failed=failed))
    return ex


def test_loop_progress_is_shown_at_most_once_a_second_with_its_rate() -> None:
    meter = output.LoopMeter(interval=1.0)
    assert meter.lines(running_loop(0), now=100.0) == ["  each_item  0/1000"]
    assert meter.lines(running_loop(50), now=100.4) == []  # within the interval
    assert meter.lines(running_loop(300, failed=2), now=101.0) == ["  each_item  300/1000 (2 failed, 300/s)"]
    assert meter.lines(running_loop(300, failed=2), now=105.0) == []  # nothing new
    assert meter.lines(running_loop(302, failed=2), now=105.1, force=True) == [
        "  each_item  302/1000 (2 failed, 59/s)"]
    cursor = output.loop_progress_text(execution_pb2.LoopProgress(total=0, done=7))
    assert cursor == "7"  # a cursor loop: no total known up front


def test_summary_and_json_carry_a_loops_progress_and_colour_only_when_asked() -> None:
    ex = running_loop(10, failed=1, total=20)
    summary = output.execution_summary(ex)
    assert "each_item  RUNNING  10/20 (1 failed)" in summary and "\033[" not in summary
    assert "\033[33mRUNNING\033[0m" in output.execution_summary(ex, colour=True)
    assert output.execution_json(ex)["steps"]["each_item"]["loop"] == {"total": 20, "done": 10, "failed": 1}
    assert "loop" not in output.execution_json(ex)["steps"]["start"]


def test_colour_follows_the_terminal_and_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert output.colour_enabled(Tty()) and not output.colour_enabled(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not output.colour_enabled(Tty())


def test_the_clients_light_view_of_the_stack_names_the_launchers_files() -> None:
    """stackprobe reads the local stack's CA without importing stackcerts (cryptography):
    the paths must stay the same."""
    from noetl_cli import stackcerts, stackprobe

    assert stackprobe.CA_FILE == (stackcerts.DIR, stackcerts.CA)
