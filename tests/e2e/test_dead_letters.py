"""Dead letters with the roles as processes (issue 15's acceptance): a command that fails
all its attempts appears in ``dlq list`` (error, attempts, the worker that held it); after
the cause is fixed, ``redrive`` completes the execution.

The tasks fail until a marker file exists (the worker runs on this machine): the test
creates the marker (the fix), then redrives through the CLI. A loop where 3 of 50
iterations fail is redriven iteration by iteration and completes with its 50 results in
order. Redriving twice, an unknown id, a failure the playbook handled, and a caller who
may not redrive are refused, naming why."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import Runner, execute, metric_sum
from waiting import until_sync

from noetl_cli.client import Api
from noetl_proto.v1 import common_pb2, deadletter_pb2, deadletter_pb2_grpc, execution_pb2

pytestmark = pytest.mark.e2e

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: dlq, path: tests/dlq/%s}\n"

STEP = HEADER % "step" + """
workflow:
  - step: start
    tool:
      kind: python
      input: {marker: "{{ marker }}"}
      code: |
        import os
        if not os.path.exists(marker):
            raise RuntimeError("the marker " + marker + " is missing")
        result = {"fixed": True}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: python, input: {v: "{{ start.fixed }}"}, code: "result = {'after': v}"}
"""

BAD = (7, 23, 41)
LOOP = HEADER % "loop" + """
workload: {count: 50}
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: each}]}
  - step: each
    loop: {in: "{{ count }}", iterator: n, spec: {mode: parallel, max_in_flight: 8}}
    tool:
      kind: python
      input: {n: "{{ n }}", marker: "{{ marker }}"}
      code: |
        import os
        if int(n) in (7, 23, 41) and not os.path.exists(marker):
            raise ValueError("item %s needs the marker" % n)
        result = int(n) * 10
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop}
"""

HANDLED = HEADER % "handled" + """
workflow:
  - step: start
    tool: {kind: python, code: "raise KeyError('always')"}
    next:
      arcs:
        - step: recover
          when: "{{ event.name == 'call.error' }}"
  - step: recover
    tool: {kind: noop}
"""


def marker() -> Path:
    path = Path(tempfile.mkdtemp(prefix="noetl-dlq-")) / "fixed"
    assert not path.exists()
    return path


def dlq(runner: Runner, *args: str) -> Any:
    proc = runner.cli("dlq", *args)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return json.loads(proc.stdout) if "--json" in args else proc.stdout


def status(runner: Runner, execution_id: int) -> str:
    ex = runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(execution_id=execution_id),
                                            timeout=10).execution
    return common_pb2.ExecutionStatus.Name(ex.status).removeprefix("EXECUTION_STATUS_")


def test_a_failed_command_is_listed_and_a_redrive_after_the_fix_completes_the_execution(runner: Runner) -> None:
    fix = marker()
    out = runner.run(STEP, {"marker": str(fix)})
    assert out.status == "FAILED", out.error
    [dl] = dlq(runner, "list", "--execution", str(out.execution_id), "--json")
    assert (dl["step"], dl["attempts"], dl["reason"], dl["status"], dl["loop_index"]) == ("start", 1, "failed",
                                                                                          "dead", None)
    assert dl["command_id"] == f"{out.execution_id}:start:1" and dl["playbook_path"] == "tests/dlq/step"
    assert dl["error"]["exception_type"] == "RuntimeError" and str(fix) in dl["error"]["message"]
    assert "Traceback" in dl["error"]["traceback"]
    worker = runner.sql("SELECT worker_id FROM noetl.command WHERE command_id = %s", (dl["command_id"],))[0][0]
    assert worker and dl["worker_id"] == worker
    shown = dlq(runner, "show", str(dl["dead_letter_id"]), "--json")
    assert shown["redrivable"] is True and shown["error"] == dl["error"]
    text = dlq(runner, "show", str(dl["dead_letter_id"]))
    assert "RuntimeError: the marker" in text and worker in text and "redrivable  yes" in text
    assert str(dl["dead_letter_id"]) in dlq(runner, "list", "--status", "dead")

    fix.touch()  # the cause is fixed
    proc = runner.cli("dlq", "redrive", str(dl["dead_letter_id"]), "--wait", "--timeout", "60")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "redrive committed" in proc.stdout and f"execution {out.execution_id}: COMPLETED" in proc.stdout
    until_sync(lambda: status(runner, out.execution_id) == "COMPLETED",
               timeout=30, what="the read model to say COMPLETED")
    done = runner.wait(out.execution_id)
    assert done.result("start") == {"fixed": True} and done.result("end") == {"after": True}
    assert not done.error
    [after] = dlq(runner, "list", "--execution", str(out.execution_id), "--json")
    assert after["status"] == "redriven" and after["redrive_command_id"] == f"{dl['command_id']}~r1"
    assert after["redriven_by"] and after["redriven_at"]
    events = [e.event_type for e in runner.events(out.execution_id)]
    assert events.count("command.redriven") == 1 and events[-1] == "playbook.completed"
    assert events.index("playbook.failed") < events.index("command.redriven")

    # twice: refused, naming why; an unknown id: not found
    proc = runner.cli("dlq", "redrive", str(dl["dead_letter_id"]))
    assert proc.returncode != 0 and "already redriven" in proc.stderr, proc.stderr
    proc = runner.cli("dlq", "redrive", "987654321")
    assert proc.returncode != 0 and "dead letter 987654321 not found" in proc.stderr, proc.stderr
    proc = runner.cli("dlq", "show", "987654321")
    assert proc.returncode != 0 and "not found" in proc.stderr, proc.stderr
    assert metric_sum(runner.state, "api", "noetl_dead_letters_total") >= 1
    assert metric_sum(runner.state, "api", "noetl_dead_letter_redrives_total") >= 1


def test_failed_loop_iterations_are_redriven_and_the_loop_completes_with_every_result_in_order(
        runner: Runner) -> None:
    fix = marker()
    out = runner.run(LOOP, {"marker": str(fix)}, timeout=120)
    assert out.status == "FAILED" and "3 of 50 iteration(s) failed" in out.error, out.error
    rows = dlq(runner, "list", "--execution", str(out.execution_id), "--json")
    assert sorted(r["loop_index"] for r in rows) == list(BAD)
    assert all(r["step"] == "each" and r["loop_instance"] == "each:1" and r["worker_id"] for r in rows)
    assert all("needs the marker" in r["error"]["message"] for r in rows)

    fix.touch()
    ids = [str(r["dead_letter_id"]) for r in sorted(rows, key=lambda r: r["loop_index"])]
    proc = runner.cli("dlq", "redrive", *ids, "--wait", "--timeout", "120")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert f"execution {out.execution_id}: COMPLETED" in proc.stdout
    until_sync(lambda: status(runner, out.execution_id) == "COMPLETED",
               timeout=30, what="the read model to say COMPLETED")
    each = runner.wait(out.execution_id).result("each")
    assert each["results"] == [n * 10 for n in range(50)]
    assert each["stats"] == {"total": 50, "success": 50, "failed": 0}
    assert all(r["status"] == "redriven" for r in dlq(runner, "list", "--execution", str(out.execution_id),
                                                          "--json"))
    # one accepted result per iteration; the failed ones were taken back
    assert runner.sql("SELECT count(*), count(*) FILTER (WHERE status = 'ok') FROM noetl.loop_result"
                      " WHERE execution_id = %s", (out.execution_id,))[0] == (50, 50)


def test_a_failure_the_playbook_handled_and_a_caller_who_may_not_redrive_are_refused(runner: Runner) -> None:
    out = runner.run(HANDLED)
    assert out.status == "COMPLETED", out.error
    [dl] = dlq(runner, "list", "--execution", str(out.execution_id), "--json")
    assert dl["error"]["exception_type"] == "KeyError"
    shown = dlq(runner, "show", str(dl["dead_letter_id"]), "--json")
    assert shown["redrivable"] is False and "completed" in shown["not_redrivable_reason"]
    proc = runner.cli("dlq", "redrive", str(dl["dead_letter_id"]))
    assert proc.returncode != 0, proc.stdout
    assert "cannot be redriven" in proc.stderr and "handled this failure" in proc.stderr, proc.stderr
    assert not runner.sql("SELECT 1 FROM noetl.redrive_request WHERE dead_letter_id = %s", (dl["dead_letter_id"],))

    worker = Api(runner.state.api, token=runner.state.tokens["worker"], ca_file=runner.state.ca_file)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            deadletter_pb2_grpc.DeadLetterServiceStub(worker.channel).RedriveDeadLetter(
                deadletter_pb2.RedriveDeadLetterRequest(dead_letter_id=dl["dead_letter_id"]), timeout=10)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        worker.close()
    proc = runner.cli("dlq", "list", "--limit", "0")
    assert proc.returncode == 2 and "--limit must be positive" in proc.stderr


def test_a_redrive_whose_nudge_was_lost_is_applied_by_the_sweep(runner: Runner) -> None:
    """The request row is what counts: committed without a NATS nudge (as if it was lost),
    the shard's engine finds it on its sweep and applies it."""
    fix = marker()
    out = runner.run(STEP, {"marker": str(fix)})
    assert out.status == "FAILED", out.error
    [dl] = dlq(runner, "list", "--execution", str(out.execution_id), "--json")
    fix.touch()
    execute(runner, "INSERT INTO noetl.redrive_request (dead_letter_id, execution_id, shard_id, requested_by)"
            " VALUES (%s, %s, %s, 'test')", (dl["dead_letter_id"], dl["execution_id"], dl["shard_id"]))
    until_sync(lambda: status(runner, out.execution_id) == "COMPLETED",
               timeout=60, what="the swept redrive to complete it")
    [after] = dlq(runner, "list", "--execution", str(out.execution_id), "--json")
    assert (after["status"], after["redriven_by"]) == ("redriven", "test")
    assert not runner.sql("SELECT 1 FROM noetl.redrive_request WHERE dead_letter_id = %s", (dl["dead_letter_id"],))
