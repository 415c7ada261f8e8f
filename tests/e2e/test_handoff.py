"""Handoff (docs/ARCHITECTURE.md "Handoff"): the command a worker's result leads to is
committed already claimed by that worker and sent on its handoff subject, with no notice
and no claim call. Through all seven processes, with short leases:

* a chain's later steps are handed to the worker that ran the step before (claimed in
  the engine's own transaction: ``claimed_at = created_at``), the first step and a
  loop's iterations are claimed as before, and the values are right;
* a handoff lost on the way (a fault point in the worker drops it) is re-issued when its
  claim lease expires, runs once, and the execution completes with the right values.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos import HEADER, Db, stack_for
from harness import Runner, metric_sum

pytestmark = pytest.mark.e2e

CHAIN = HEADER.format(name="handoff_chain") + """workload:
  seed: 0
workflow:
  - step: start
    tool: {kind: python, input: {seed: "{{ seed }}"}, code: "result = {'v': seed}"}
    next: {arcs: [{step: b}]}
  - step: b
    tool: {kind: python, input: {v: "{{ start.v }}"}, code: "result = {'v': v + 1}"}
    next: {arcs: [{step: fan}]}
  - step: fan
    loop: {in: "{{ [1, 2, 3] }}", iterator: x, spec: {mode: parallel, max_in_flight: 3}}
    tool: {kind: python, input: {x: "{{ x }}", v: "{{ b.v }}"}, code: "result = {'w': v * x}"}
    next: {arcs: [{step: c}]}
  - step: c
    tool: {kind: python, input: {v: "{{ b.v }}"}, code: "result = {'v': v * 2}"}
"""


@pytest.fixture(scope="module")
def faults_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("handoff-faults") / "faults"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def runner(faults_file: Path) -> Iterator[Runner]:
    with stack_for("handoff", {}, {"NOETL_FAULTS_FILE": str(faults_file)}) as r:
        yield r


def commands(db: Db, execution_id: int) -> dict[str, list[dict[str, object]]]:
    rows = db.all("SELECT step, command_id, attempt, worker_id, status, claimed_at = created_at AS handed"
                  " FROM noetl.command WHERE execution_id = %s ORDER BY created_at, command_id", (execution_id,))
    out: dict[str, list[dict[str, object]]] = {}
    for r in rows:
        out.setdefault(str(r["step"]), []).append(dict(r))
    return out


def accepted_results(db: Db, execution_id: int, step: str) -> int:
    return int(db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s AND step = %s"
                        " AND event_type = 'call.done'", (execution_id, step)))


def test_the_next_step_is_handed_to_the_worker_that_ran_the_step_before(runner: Runner, db: Db) -> None:
    before = metric_sum(runner.state, "api", "noetl_engine_handoffs_total")
    out = runner.run(CHAIN, {"seed": 20})
    assert out.status == "COMPLETED", out.error
    assert out.result("c") == {"v": 42}
    assert [r["w"] for r in out.result("fan")["results"]] == [21, 42, 63]
    cmds = commands(db, out.execution_id)
    worker = cmds["start"][0]["worker_id"]
    # the first step has no worker before it: queued, noticed and claimed
    assert not cmds["start"][0]["handed"], cmds["start"]
    # b and c follow a worker's result: claimed in the engine's transaction, by that worker
    for step in ("b", "c"):
        (cmd,) = cmds[step]
        assert cmd["handed"] and cmd["worker_id"] == worker and cmd["status"] == "done", cmd
        assert cmd["attempt"] == 1
    # a loop's iterations read their items at claim: never handed
    assert cmds["fan"] and not any(c["handed"] for c in cmds["fan"]), cmds["fan"]
    assert metric_sum(runner.state, "api", "noetl_engine_handoffs_total") >= before + 2


def test_a_lost_handoff_is_reissued_when_its_claim_lease_expires(runner: Runner, db: Db, faults_file: Path) -> None:
    faults_file.write_text("worker.handoff b\n")  # the worker drops the next handoff of a step b
    try:
        out = runner.run(CHAIN, {"seed": 5}, timeout=60)
    finally:
        faults_file.write_text("")
    assert out.status == "COMPLETED", out.error
    assert out.result("c") == {"v": 12}
    assert [r["w"] for r in out.result("fan")["results"]] == [6, 12, 18]
    (b,) = commands(db, out.execution_id)["b"]
    # attempt 1 was handed off and lost; the reaper found its lease expired, the engine
    # re-issued it as attempt 2 (queued, claimed as usual), and it ran once
    assert b["attempt"] == 2 and b["status"] == "done", b
    assert accepted_results(db, out.execution_id, "b") == 1
    reissued = db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s AND step = 'b'"
                       " AND event_type = 'command.reissued'", (out.execution_id,))
    assert reissued == 1
