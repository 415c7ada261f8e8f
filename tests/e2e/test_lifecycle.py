"""Submission semantics: idempotency keys, catalog pinning, timeouts, cancel, events."""

from __future__ import annotations

import time

import pytest
from harness import Runner

from noetl_proto.v1 import catalog_pb2, execution_pb2

pytestmark = pytest.mark.e2e

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: life\n  path: tests/lifecycle/{name}\n"


def playbook(name: str, body: str) -> str:
    return HEADER.format(name=name) + body


def test_retried_submit_with_the_same_key_returns_the_same_execution(runner: Runner) -> None:
    text = playbook("idem", "workflow:\n  - step: start\n    tool: {kind: noop}\n")
    key = f"idem-{time.time_ns()}"
    first = runner.submit(text, key=key)
    second = runner.submit(text, key=key)
    assert second.execution_id == first.execution_id and second.deduplicated and not first.deduplicated
    assert runner.sql("SELECT count(*) FROM noetl.execution_request WHERE idempotency_key = %s", (key,))[0][0] == 1
    assert runner.wait(first.execution_id).status == "COMPLETED"


def test_version_is_pinned_at_submit(runner: Runner) -> None:
    v1 = playbook("pin", "workflow:\n  - step: start\n    tool: {kind: python, code: 'result = 1'}\n")
    v2 = playbook("pin", "workflow:\n  - step: start\n    tool: {kind: python, code: 'result = 2'}\n")
    a = runner.submit(v1)
    b = runner.submit(v2)
    assert b.playbook_version == a.playbook_version + 1
    ref = runner.api.executions.SubmitExecution(execution_pb2.SubmitExecutionRequest(
        ref=execution_pb2.PlaybookRef(path="tests/lifecycle/pin", version=a.playbook_version)), timeout=30)
    assert runner.wait(a.execution_id).result("start") == 1
    assert runner.wait(b.execution_id).result("start") == 2
    assert runner.wait(ref.execution_id).result("start") == 1
    got = runner.api.catalog.GetPlaybook(catalog_pb2.GetPlaybookRequest(path="tests/lifecycle/pin"), timeout=10)
    assert got.entry.version == b.playbook_version


def test_execution_timeout_fails_the_execution(runner: Runner) -> None:
    text = playbook("slow", "workflow:\n  - step: start\n    tool: {kind: python, code: \"import time\\ntime.sleep(30)\"}\n")
    sub = runner.submit(text, timeout=1.0)
    out = runner.wait(sub.execution_id, timeout=30)
    assert out.status == "FAILED" and "timed out" in out.error


def test_step_timeout_stops_the_task(runner: Runner) -> None:
    text = playbook("steptimeout", "workflow:\n  - step: start\n    tool:\n      kind: python\n      timeout: 0.5\n"
                    "      code: \"import time\\ntime.sleep(30)\"\n")
    started = time.monotonic()
    out = runner.run(text, timeout=30)
    assert out.status == "FAILED"
    assert "timeout" in out.steps["start"]["error"].lower()
    assert time.monotonic() - started < 20


def test_cancel_stops_a_running_execution(runner: Runner) -> None:
    text = playbook("cancel", "workflow:\n  - step: start\n    tool: {kind: python, code: \"import time\\ntime.sleep(60)\"}\n")
    sub = runner.submit(text)
    deadline = time.monotonic() + 20
    while runner.sql("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND status = 'claimed'",
                     (sub.execution_id,))[0][0] == 0:
        assert time.monotonic() < deadline, "command never claimed"
        time.sleep(0.05)
    resp = runner.api.executions.CancelExecution(execution_pb2.CancelExecutionRequest(
        execution_id=sub.execution_id, reason="test"), timeout=10)
    assert resp.accepted
    out = runner.wait(sub.execution_id, timeout=30)
    assert out.status == "CANCELLED"
    assert out.steps["start"]["status"] == "CANCELLED"


def test_events_are_append_only_with_gap_free_shard_sequence(runner: Runner) -> None:
    out = runner.run(playbook("events", "workflow:\n  - step: a\n    tool: {kind: noop}\n"
                              "    next: {arcs: [{step: b}]}\n  - step: b\n    tool: {kind: noop}\n"))
    events = runner.events(out.execution_id)
    types = [e.event_type for e in events]
    assert types == ["playbook.started", "step.enter", "call.done", "step.enter", "call.done", "playbook.completed"]
    seqs = [e.shard_seq for e in events]
    assert seqs == sorted(seqs)
    shard = events[0].shard_id
    rows = runner.sql("SELECT shard_seq FROM noetl.event WHERE shard_id = %s ORDER BY shard_seq", (shard,))
    all_seqs = [r[0] for r in rows]
    assert all_seqs == list(range(all_seqs[0], all_seqs[0] + len(all_seqs))), "gap-free per shard"
    # no triggers anywhere in the schema
    assert runner.sql("SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                      " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'noetl'"
                      " AND NOT t.tgisinternal")[0][0] == 0
