"""Worker pools and priorities with the roles as processes: two workers, ``worker-0``
serving the ``default`` and ``batch`` pools with one slot, ``worker-1`` serving ``gpu``
(and backfilling ``default``) with the label ``accelerator=a100``.

- a step placed in pool gpu runs only on worker-1; a step requiring the label (in the
  default pool, whose notices both workers read) only on worker-1 too (worker-0's claims
  are refused NOT_QUALIFIED); the rest on either;
- with worker-1 stopped, a gpu step waits visibly (``StepState.waiting``, ``noetl-rt
  status``, the reaper's ``noetl_commands_unschedulable{pool="gpu"}``) and runs once it is back;
- with 200 low-priority sleeps queued for the one slot of pool batch, a high-priority
  submission's command is taken before most of them (FIFO would take it last).
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator

import pytest
from chaos import HEADER, Db, stack_for
from harness import Runner
from waiting import until_sync

from noetl_proto.v1 import execution_pb2

pytestmark = pytest.mark.e2e

GPU_WORKER, CPU_WORKER = "worker-1", "worker-0"


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    replica_env = {
        CPU_WORKER: {"NOETL_WORKER_POOL": "default,batch", "NOETL_WORKER_CONCURRENCY": "1"},
        GPU_WORKER: {"NOETL_WORKER_POOL": "gpu,default", "NOETL_WORKER_LABELS": "accelerator=a100",
                     "NOETL_WORKER_CONCURRENCY": "4"},
    }
    with stack_for("pools", {"worker": 2}, replica_env=replica_env) as r:
        yield r


def workers_of(db: Db, execution_id: int, step: str) -> set[str]:
    return {r["worker_id"] for r in db.all(
        "SELECT worker_id FROM noetl.command WHERE execution_id = %s AND step = %s", (execution_id, step))}


def unschedulable(runner: Runner, pool: str) -> float:
    """``noetl_commands_unschedulable{pool=...}`` summed over the reaper's shards."""
    total = 0.0
    for proc in runner.state.processes("reaper"):
        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("noetl_commands_unschedulable{") and f'pool="{pool}"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


def step_state(runner: Runner, execution_id: int, step: str) -> execution_pb2.StepState | None:
    ex = runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(execution_id=execution_id),
                                            timeout=10).execution
    return next((s for s in ex.steps if s.name == step), None)


PLACED = HEADER.format(name="placed") + """
workflow:
  - step: start
    tool: {kind: noop}
    next: {spec: {mode: inclusive}, arcs: [{step: gpu_work}, {step: labelled}, {step: anywhere}]}
  - step: gpu_work
    spec: {pool: gpu}
    loop: {in: "{{ range(6) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 6}}
    tool: {kind: python, code: "import time\\ntime.sleep(0.2)\\nresult = 1"}
    next: {arcs: [{step: done}]}
  - step: labelled
    spec: {requires: {accelerator: a100}}
    loop: {in: "{{ range(3) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 3}}
    tool: {kind: python, code: "result = 2"}
    next: {arcs: [{step: done}]}
  - step: anywhere
    loop: {in: "{{ range(12) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 12}}
    tool: {kind: python, code: "import time\\ntime.sleep(0.2)\\nresult = 3"}
    next: {arcs: [{step: done}]}
  - step: done
    tool: {kind: noop}
"""


def test_placed_steps_run_only_on_workers_that_qualify(runner: Runner, db: Db) -> None:
    out = runner.run(PLACED, timeout=120)
    assert out.status == "COMPLETED", out.error
    eid = out.execution_id
    assert workers_of(db, eid, "gpu_work") == {GPU_WORKER}
    assert workers_of(db, eid, "labelled") == {GPU_WORKER}
    assert workers_of(db, eid, "anywhere") <= {GPU_WORKER, CPU_WORKER}
    rows = db.all("SELECT step, pool, requires, priority FROM noetl.command WHERE execution_id = %s"
                  " AND step IN ('gpu_work', 'labelled', 'anywhere')", (eid,))
    assert {(r["step"], r["pool"], json.dumps(r["requires"]), r["priority"]) for r in rows} == {
        ("gpu_work", "gpu", "null", "normal"), ("labelled", "default", '{"accelerator": "a100"}', "normal"),
        ("anywhere", "default", "null", "normal")}


GPU_ONLY = HEADER.format(name="gpu_only") + """
workflow:
  - step: start
    spec: {pool: gpu}
    tool: {kind: python, code: "result = 'ran on gpu'"}
"""


def test_a_gpu_step_with_no_gpu_worker_is_visible_and_runs_once_one_is_back(runner: Runner, db: Db) -> None:
    state = runner.state
    state.stop("worker", 1)  # the orderly way: it leaves the membership
    try:
        eid = runner.submit(GPU_ONLY).execution_id
        waiting = until_sync(lambda: (s := step_state(runner, eid, "start")) is not None and s.waiting, timeout=30,
                             what="the step to say why it waits")
        assert waiting == "no live worker in pool gpu (running python tasks)"
        until_sync(lambda: unschedulable(runner, "gpu") >= 1,
                   timeout=30, what="noetl_commands_unschedulable{pool=gpu}")
        status = runner.cli("status", str(eid))
        assert "waiting: no live worker in pool gpu" in status.stdout, status.stdout
        assert db.value("SELECT status FROM noetl.command WHERE execution_id = %s", (eid,)) == "queued"
    finally:
        state.restart("worker", 1)
    out = runner.wait(eid, 60)
    assert out.status == "COMPLETED" and out.result("start") == "ran on gpu", out
    assert workers_of(db, eid, "start") == {GPU_WORKER}
    until_sync(lambda: unschedulable(runner, "gpu") == 0, timeout=30, what="the gauge back to 0")


BACKLOG = HEADER.format(name="backlog") + """
workflow:
  - step: start
    spec: {pool: batch}
    loop: {in: "{{ range(200) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 200}}
    tool: {kind: python, code: "import time\\ntime.sleep(0.05)\\nresult = 1"}
"""

URGENT = HEADER.format(name="urgent") + """
workflow:
  - step: start
    spec: {pool: batch}
    tool: {kind: python, code: "result = 'urgent'"}
"""


def test_a_high_priority_command_is_taken_before_a_queued_low_priority_backlog(runner: Runner, db: Db) -> None:
    submit = runner.api.executions.SubmitExecution
    low = submit(execution_pb2.SubmitExecutionRequest(playbook_yaml=BACKLOG, priority=execution_pb2.PRIORITY_LOW),
                 timeout=30).execution_id
    # the backlog is queued and the one slot of pool batch is working through it
    until_sync(lambda: db.value("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND status = 'queued'",
                                (low,)) >= 150 and
               db.value("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND worker_id IS NOT NULL",
                        (low,)) >= 1, timeout=60, what="200 low-priority commands queued and the first taken")
    high = submit(execution_pb2.SubmitExecutionRequest(playbook_yaml=URGENT, priority=execution_pb2.PRIORITY_HIGH),
                  timeout=30).execution_id
    assert runner.wait(high, 60).status == "COMPLETED"
    assert runner.wait(low, 120).status == "COMPLETED"
    taken = db.value("SELECT claimed_at FROM noetl.command WHERE execution_id = %s", (high,))
    after = db.value("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND claimed_at > %s", (low, taken))
    before = db.value("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND claimed_at < %s", (low, taken))
    assert db.value("SELECT priority FROM noetl.command WHERE execution_id = %s", (high,)) == "high"
    assert {r["priority"] for r in db.all("SELECT priority FROM noetl.command WHERE execution_id = %s", (low,))} \
        == {"low"}
    # FIFO would have taken it after all 200; with priorities it went ahead of every low one
    # still queued when it was issued (the one slot finishes the low task it is running)
    issued = db.value("SELECT created_at FROM noetl.command WHERE execution_id = %s", (high,))
    between = db.value("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND claimed_at > %s"
                       " AND claimed_at < %s", (low, issued, taken))
    assert between <= 1, f"{between} low-priority commands were taken after the high one was issued, before it"
    assert after >= 100, f"the high-priority command was taken after {before} low ones, before {after}"
    assert workers_of(db, high, "start") == {CPU_WORKER}


def test_a_bad_priority_or_pool_is_refused_at_submit(runner: Runner) -> None:
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        runner.submit(HEADER.format(name="bad") + "workflow:\n  - step: start\n    spec: {pool: 'Not A Pool'}\n"
                      "    tool: {kind: noop}\n")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(r"workflow\[0\]\.spec\.pool", err.value.details() or "")
