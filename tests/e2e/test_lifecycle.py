"""Submission semantics: idempotency keys, catalog pinning, timeouts, cancel, events."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from harness import Runner
from waiting import until_sync

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
    until_sync(lambda: runner.sql("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND status = 'claimed'",
                                  (sub.execution_id,))[0][0], timeout=20, what="the command claimed")
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


def test_cli_runs_a_registered_playbook_detached_then_watches_and_lists_it(runner: Runner, tmp_path: Path) -> None:
    """`noetl-rt playbook register`, `run --path P@N --detach`, `watch ID`, `list`: the
    catalog-driven flow a user takes from the command line, through the real stack."""
    path = f"tests/lifecycle/cli_{time.time_ns()}"
    body = ("workflow:\n  - step: start\n    tool: {kind: python, input: {n: '{{ n }}'}, code: 'result = n + VERSION'}\n")
    for version in (1, 2):
        file = tmp_path / f"v{version}.yaml"
        file.write_text(f"apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: cli\n  path: {path}\n"
                        f"workload: {{n: 1}}\n" + body.replace("VERSION", str(version)))
        proc = runner.cli("playbook", "register", str(file))
        assert proc.returncode == 0 and f"{path} version {version} registered" in proc.stdout, proc.stderr

    # detached: the id on stdout at once; the pinned version 1 runs
    proc = runner.cli("run", "--path", f"{path}@1", "--payload", '{"n": 20}', "--detach")
    assert proc.returncode == 0, proc.stderr
    first = int(proc.stdout.strip())
    assert f"execution {first} submitted: {path} v1" in proc.stderr
    proc = runner.cli("watch", str(first), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["execution_id"] == str(first) and doc["status"] == "COMPLETED"
    assert doc["steps"]["start"]["result"] == 21

    # the latest version, followed to the end by `run` itself
    proc = runner.cli("run", "--path", path, "--payload", '{"n": 20}', "--json")
    assert proc.returncode == 0, proc.stderr
    second = json.loads(proc.stdout)
    assert second["status"] == "COMPLETED" and second["steps"]["start"]["result"] == 22

    # a failing run, detached then watched: watch exits 1 and shows the error
    proc = runner.cli("run", "--path", path, "--payload", '{"n": "x"}', "--detach", "--json")
    assert proc.returncode == 0, proc.stderr
    third = json.loads(proc.stdout)
    assert third["playbook_version"] == 2 and not third["deduplicated"]
    proc = runner.cli("watch", third["execution_id"])
    assert proc.returncode == 1 and "FAILED" in proc.stdout, (proc.stdout, proc.stderr)

    # list: newest first, filtered by path and status, limited
    proc = runner.cli("list", "--path", path, "--json")
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert [e["execution_id"] for e in listed] == [third["execution_id"], second["execution_id"], str(first)]
    assert [(e["status"], e["playbook_version"]) for e in listed] == [("FAILED", 2), ("COMPLETED", 2),
                                                                      ("COMPLETED", 1)]
    assert listed[0]["error"] and listed[1]["error"] is None and listed[1]["ended_at"]
    proc = runner.cli("list", "--path", path, "--status", "completed", "--limit", "1", "--json")
    assert [e["execution_id"] for e in json.loads(proc.stdout)] == [second["execution_id"]]
    proc = runner.cli("list", "--path", path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[0].split() == ["ID", "STATUS", "PLAYBOOK", "CREATED", "DURATION", "ERROR"]
    assert len(lines) == 4 and lines[1].startswith(third["execution_id"]) and "FAILED" in lines[1]
    proc = runner.cli("list", "--path", f"{path}-none")
    assert proc.returncode == 0 and proc.stdout.strip() == "no executions"

    # unknown things: a clear message, no execution created
    proc = runner.cli("run", "--path", f"{path}@9", "--detach")
    assert proc.returncode == 2 and "not found" in proc.stderr and "version 9" in proc.stderr, proc.stderr
    proc = runner.cli("watch", "12345")
    assert proc.returncode == 1 and "12345" in proc.stderr and "not found" in proc.stderr, proc.stderr
    assert runner.sql("SELECT count(*) FROM noetl.execution_request r JOIN noetl.catalog c"
                      " ON c.catalog_id = r.catalog_id WHERE c.path = %s", (path,))[0][0] == 3
