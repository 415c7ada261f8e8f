"""Rerun from the failed step through the seven roles as processes (issue 15's acceptance).

* A 3-step playbook whose python tasks each append a line to a file (their side effects,
  counted) fails at step 3 until a marker exists. ``noetl-rt rerun`` after creating the
  marker completes without running steps 1-2 again (each ran once in all, step 3 twice),
  and step 3 reads step 1's result (kept by reference) as the original produced it. The
  new execution is linked (``rerun_of``), shows the kept steps' results, and a retried
  RerunExecution with the same key is the same execution.
* ``from_step``: reruns that step and what follows, keeping what came before.
* A 1,000-item loop where 10 items fail (decided by the item, fixed by a marker): the
  rerun runs only those 10 tasks, and the loop's collected result has all 1,000 in order.
* Refusals name why: an unknown execution, an unknown step, a step never reached, a
  running execution, a completed one with no step named.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import Runner, cancel, rpc_code
from waiting import until_sync

from noetl_proto.v1 import common_pb2, execution_pb2

pytestmark = pytest.mark.e2e

THREE_STEPS = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rerun_three, path: tests/rerun/three_steps}
workload: {dir: /nonexistent}
workflow:
  - step: start
    tool:
      kind: python
      input: {dir: "{{ workload.dir }}"}
      code: |
        import uuid
        with open(dir + "/log", "a") as fh:
            fh.write("start\\n")
        result = {"token": uuid.uuid4().hex}
    next: {arcs: [{step: two}]}
  - step: two
    tool:
      kind: python
      input: {dir: "{{ workload.dir }}"}
      code: |
        with open(dir + "/log", "a") as fh:
            fh.write("two\\n")
        result = {"two": 2}
    next: {arcs: [{step: three}]}
  - step: three
    tool:
      kind: python
      input: {dir: "{{ workload.dir }}", token: "{{ start.token }}"}
      code: |
        import os
        with open(dir + "/log", "a") as fh:
            fh.write("three\\n")
        if not os.path.exists(dir + "/marker"):
            raise RuntimeError("marker missing")
        result = {"token_of_start": token}
"""

LOOP = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rerun_loop, path: tests/rerun/loop}
workload: {dir: /nonexistent, count: 1000}
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: each}]}
  - step: each
    loop:
      in: "{{ workload.count }}"
      iterator: n
      spec: {mode: parallel, max_in_flight: 32}
    tool:
      kind: python
      input: {dir: "{{ workload.dir }}", n: "{{ n }}"}
      code: |
        import os
        n = int(n)
        with open(dir + "/log", "a") as fh:
            fh.write(str(n) + "\\n")
        if n % 100 == 7 and not os.path.exists(dir + "/marker"):
            raise RuntimeError("item " + str(n) + " needs the marker")
        result = {"n": n, "square": n * n}
"""

NEVER_REACHED = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rerun_unreached, path: tests/rerun/unreached}
workflow:
  - step: start
    tool: {kind: python, code: "raise RuntimeError('always')"}
    next: {arcs: [{step: after}]}
  - step: after
    tool: {kind: noop}
"""

SLOW = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rerun_slow, path: tests/rerun/slow}
workflow:
  - step: start
    tool: {kind: python, code: "import time\\ntime.sleep(60)\\nresult = 1"}
"""


def lines(directory: Path) -> list[str]:
    log = directory / "log"
    return log.read_text().splitlines() if log.exists() else []


def counts(directory: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in lines(directory):
        out[line] = out.get(line, 0) + 1
    return out


def rerun(runner: Runner, execution_id: int, from_step: str = "", key: str = "") -> Any:
    return runner.api.executions.RerunExecution(execution_pb2.RerunExecutionRequest(
        execution_id=execution_id, from_step=from_step, idempotency_key=key), timeout=30)


def execution(runner: Runner, execution_id: int) -> execution_pb2.Execution:
    return runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(
        execution_id=execution_id, include_results=True), timeout=10).execution


def commands_by_step(runner: Runner, execution_id: int) -> dict[str, int]:
    rows = runner.sql("SELECT step, count(*) FROM noetl.command WHERE execution_id = %s GROUP BY step",
                      (execution_id,))
    return {str(s): int(n) for s, n in rows}


def refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_a_three_step_playbook_failing_at_step_three_reruns_from_step_three(runner: Runner, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    payload = {"dir": str(tmp_path)}
    original = runner.run(THREE_STEPS, payload)
    assert original.status == "FAILED", original.error
    assert original.steps["three"]["status"] == "FAILED" and "marker missing" in original.steps["three"]["error"]
    assert counts(tmp_path) == {"start": 1, "two": 1, "three": 1}
    token = original.result("start")["token"]

    (tmp_path / "marker").write_text("fixed")
    proc = runner.cli("rerun", str(original.execution_id), "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(proc.stdout)
    new_id = int(doc["execution_id"])
    assert doc["status"] == "COMPLETED" and doc["rerun_of"] == str(original.execution_id)
    assert new_id != original.execution_id
    assert f"reruns {original.execution_id} from three (keeps start, two)" in proc.stderr

    # side effects: steps 1-2 ran once in all, step 3 twice
    assert counts(tmp_path) == {"start": 1, "two": 1, "three": 2}
    # step 3 of the rerun read step 1's result (kept by reference) as the original produced it
    assert doc["steps"]["three"]["result"] == {"token_of_start": token}
    assert doc["steps"]["start"] == {"status": "COMPLETED", "result": {"token": token}}
    assert doc["steps"]["two"] == {"status": "COMPLETED", "result": {"two": 2}}

    ex = execution(runner, new_id)
    assert ex.rerun_of == original.execution_id and ex.status == common_pb2.EXECUTION_STATUS_COMPLETED
    # nothing was issued for the kept steps; their references are the original's
    assert commands_by_step(runner, new_id) == {"three": 1}
    kept = {s.name: s.result_ref.ref_id for s in ex.steps if s.name in ("start", "two")}
    rows = runner.sql("SELECT step, result_ref_id FROM noetl.execution_step WHERE execution_id = %s"
                      " AND step IN ('start', 'two')", (original.execution_id,))
    assert kept == {str(s): int(r) for s, r in rows}
    kinds = [e.event_type for e in runner.events(new_id)]
    assert kinds.count("step.kept") == 2 and kinds[0] == "playbook.started" and kinds[-1] == "playbook.completed"

    # the original is untouched
    assert execution(runner, original.execution_id).status == common_pb2.EXECUTION_STATUS_FAILED


def test_a_retried_rerun_with_the_same_key_is_the_same_execution(runner: Runner, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    original = runner.run(THREE_STEPS, {"dir": str(tmp_path)})
    assert original.status == "FAILED"
    key = f"k-{uuid.uuid4()}"
    first = rerun(runner, original.execution_id, key=key)
    second = rerun(runner, original.execution_id, key=key)
    assert second.execution_id == first.execution_id and second.deduplicated and not first.deduplicated
    assert list(first.rerun_steps) == ["three"] and list(first.kept_steps) == ["start", "two"]
    # the request was committed before the call answered
    assert runner.sql("SELECT rerun_of FROM noetl.execution_request WHERE execution_id = %s",
                      (first.execution_id,)) == [(original.execution_id,)]
    again = runner.wait(first.execution_id)
    assert again.status == "FAILED" and "marker missing" in again.error  # no marker: fails the same way
    assert counts(tmp_path) == {"start": 1, "two": 1, "three": 2}
    assert runner.sql("SELECT count(*) FROM noetl.execution_request WHERE rerun_of = %s",
                      (original.execution_id,)) == [(1,)]


def test_from_step_reruns_that_step_and_what_follows(runner: Runner, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    (tmp_path / "marker").write_text("fixed")
    original = runner.run(THREE_STEPS, {"dir": str(tmp_path)})
    assert original.status == "COMPLETED"
    token = original.result("start")["token"]
    resp = rerun(runner, original.execution_id, from_step="two")
    assert list(resp.rerun_steps) == ["two"] and list(resp.kept_steps) == ["start"]
    out = runner.wait(resp.execution_id)
    assert out.status == "COMPLETED", out.error
    assert counts(tmp_path) == {"start": 1, "two": 2, "three": 2}
    assert out.result("three") == {"token_of_start": token}
    assert commands_by_step(runner, resp.execution_id) == {"two": 1, "three": 1}


def test_refusals_name_why(runner: Runner, tmp_path: Path) -> None:
    err = refused(lambda: rerun(runner, 123456789))
    assert rpc_code(err) == grpc.StatusCode.NOT_FOUND and "123456789 not found" in err.details()

    unreached = runner.run(NEVER_REACHED)
    assert unreached.status == "FAILED"
    err = refused(lambda: rerun(runner, unreached.execution_id, from_step="nope"))
    assert rpc_code(err) == grpc.StatusCode.INVALID_ARGUMENT
    assert "from_step: step 'nope' is not a step of the playbook" in err.details() and "start, after" in err.details()
    err = refused(lambda: rerun(runner, unreached.execution_id, from_step="after"))
    assert rpc_code(err) == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 'after' was never reached" in err.details()

    tmp_path.chmod(0o777)
    (tmp_path / "marker").write_text("fixed")
    done = runner.run(THREE_STEPS, {"dir": str(tmp_path)})
    assert done.status == "COMPLETED"
    err = refused(lambda: rerun(runner, done.execution_id))
    assert rpc_code(err) == grpc.StatusCode.FAILED_PRECONDITION
    assert "completed: nothing failed to rerun from" in err.details()

    slow = runner.submit(SLOW).execution_id
    until_sync(lambda: execution(runner, slow).status == common_pb2.EXECUTION_STATUS_RUNNING,
               timeout=30, what="slow running")
    err = refused(lambda: rerun(runner, slow))
    assert rpc_code(err) == grpc.StatusCode.FAILED_PRECONDITION and "is still running" in err.details()
    assert cancel(runner, slow)
    assert runner.wait(slow).status == "CANCELLED"
    # the CLI says so too (exit 1, the reason on stderr)
    proc = runner.cli("rerun", str(done.execution_id))
    assert proc.returncode == 1 and "cannot rerun" in proc.stderr and "completed" in proc.stderr
    proc = runner.cli("rerun", str(unreached.execution_id), "--from", "nope")
    assert proc.returncode == 2 and "'nope' is not a step" in proc.stderr


def test_a_thousand_item_loop_with_ten_failed_iterations_reruns_only_those_ten(runner: Runner,
                                                                            tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    original = runner.run(LOOP, {"dir": str(tmp_path)}, timeout=300)
    assert original.status == "FAILED" and "10 of 1000 iteration(s) failed" in original.error, original.error
    assert len(lines(tmp_path)) == 1000

    (tmp_path / "marker").write_text("fixed")
    started = time.monotonic()
    resp = rerun(runner, original.execution_id)
    assert list(resp.rerun_steps) == ["each"] and list(resp.kept_steps) == ["start"]
    out = runner.wait(resp.execution_id, timeout=120)
    assert out.status == "COMPLETED", out.error
    # only the 10 failed iterations ran again
    assert commands_by_step(runner, resp.execution_id) == {"each": 10}
    ran_again = lines(tmp_path)[1000:]
    assert sorted(int(n) for n in ran_again) == [n for n in range(1000) if n % 100 == 7]
    # the loop's collected result: all 1,000, in order
    value = out.result("each")
    assert value["stats"] == {"total": 1000, "success": 1000, "failed": 0}
    assert value["results"] == [{"n": n, "square": n * n} for n in range(1000)]
    assert time.monotonic() - started < 120
