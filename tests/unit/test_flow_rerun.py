"""Rerun from the failed step as a pure function (noetl_flow.rerun): the plan (which steps
run again, which keep their results, refusals), the seeded state (kept references, ctx,
re-armed fan-ins) and a resumed loop dispatching only what its original did not finish."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from noetl_dsl import parse_playbook
from noetl_flow import CallResultInput, ExecState, RerunRefused, StartInput, rerun
from noetl_flow import Flow as BatchingFlow

# One iteration per command: these tests pin the per-iteration protocol (batches of
# iterations: test_flow_batches.py).
Flow = functools.partial(BatchingFlow, loop_batch=1)

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: r, path: r}\n"
LINEAR = Flow(parse_playbook(HEADER + """
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    set: {ctx.a: 1}
    next: {arcs: [{step: two}]}
  - step: two
    tool: {kind: python, code: "result = 2"}
    next: {arcs: [{step: three}]}
  - step: three
    tool: {kind: python, code: "result = 3"}
    next: {arcs: [{step: four}]}
  - step: four
    tool: {kind: python, code: "result = 4"}
"""))
LOOP = Flow(parse_playbook(HEADER + """
workload: {numbers: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: each}]}
  - step: each
    loop: {in: "{{ numbers }}", iterator: n, spec: {mode: parallel, max_in_flight: 4}}
    tool: {kind: python, code: "result = n"}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop}
"""))


def ok(ref: int) -> dict[str, Any]:
    return {"status": "ok", "reference": {"ref_id": ref, "type": "db", "uri": f"pg://result_payload/{ref}"},
            "parent_ref": None, "context": {}}


def err() -> dict[str, Any]:
    return {"status": "error", "reference": None, "parent_ref": None, "context": {},
            "error": {"code": "TOOL_ERROR", "message": "boom"}}


def drive(flow: Flow, outcomes: dict[str, dict[str, Any]], eid: int = 1,
          workload: dict[str, Any] | None = None) -> ExecState:
    """Run ``flow`` answering each pending command by its step (or ``step:index``) until it ends."""
    workload = workload or {}
    state = flow.start(StartInput(eid, 0, 1), workload).state
    while not state.terminal:
        cid, pending = next(iter(state.pending.items()))
        key = pending.step if pending.index is None else f"{pending.step}:{pending.index}"
        envelope = outcomes.get(key) or outcomes.get(pending.step) or ok(100 + len(cid))
        state = flow.on_result(state, CallResultInput(cid, 1, envelope), workload, {}).state
    return state


def test_a_rerun_starts_at_the_failed_step_keeping_the_earlier_results_by_reference() -> None:
    original = drive(LINEAR, {"start": ok(11), "two": ok(12), "three": err()})
    assert original.status == "failed" and original.failed_step == "three"
    plan = rerun.plan(LINEAR, original)
    assert plan.steps == ("three",) and plan.kept == ("start", "two") and not plan.resume
    t = LINEAR.rerun(StartInput(2, 0, 1), original, plan, {}, {}, {})
    st = t.state
    assert st.rerun_of == 1 and st.ctx == {"a": 1}
    assert [c.command_id for c in t.commands] == ["2:three:1"]
    kept = [e for e in t.events if e.event_type == "step.kept"]
    assert [(e.step, e.result["reference"]["ref_id"]) for e in kept] == [("start", 11), ("two", 12)]
    # the command's render snapshot carries the kept references (workers resolve them)
    assert t.commands[0].context["steps"]["start"]["reference"]["ref_id"] == 11
    # completes once the rerun step and what follows succeed
    st = LINEAR.on_result(st, CallResultInput("2:three:1", 1, ok(13)), {}, {}).state
    st = LINEAR.on_result(st, CallResultInput("2:four:1", 1, ok(14)), {}, {}).state
    assert st.status == "completed"


def test_from_step_discards_that_step_and_what_follows() -> None:
    original = drive(LINEAR, {})
    assert original.status == "completed"
    with pytest.raises(RerunRefused) as refused:
        rerun.plan(LINEAR, original)
    assert refused.value.reason == rerun.NOTHING_FAILED and "completed" in str(refused.value)
    plan = rerun.plan(LINEAR, original, "two")
    assert plan.steps == ("two",) and plan.kept == ("start",)


def test_refusals_name_why() -> None:
    failed = drive(LINEAR, {"two": err()})
    with pytest.raises(RerunRefused) as unknown:
        rerun.plan(LINEAR, failed, "nope")
    assert unknown.value.reason == rerun.UNKNOWN_STEP and "'nope' is not a step" in str(unknown.value)
    with pytest.raises(RerunRefused) as unreached:
        rerun.plan(LINEAR, failed, "four")
    assert unreached.value.reason == rerun.NOT_REACHED and "never reached" in str(unreached.value)
    running = LINEAR.start(StartInput(3, 0, 1), {}).state
    with pytest.raises(RerunRefused) as still:
        rerun.plan(LINEAR, running)
    assert still.value.reason == rerun.RUNNING and "still running" in str(still.value)


def test_a_failed_loop_reruns_only_its_failed_iterations() -> None:
    workload = {"numbers": list(range(10))}
    original = drive(LOOP, {"each:3": err(), "each:7": err()}, workload=workload)
    assert original.status == "failed" and original.failed_step == "each"
    plan = rerun.plan(LOOP, original)
    assert plan.steps == ("each",) and plan.kept == ("start",) and set(plan.resume) == {"each"}
    ok_ranges = [(0, 3), (4, 7), (8, 10)]
    todo = rerun.todo_ranges(10, ok_ranges)
    assert todo == [[7, 8], [3, 4]]
    t = LOOP.rerun(StartInput(2, 0, 1), original, plan, workload, {}, {"each": (8, todo)})
    assert t.loop_copies == [(1, "each:1", "each:1")] and t.loop_items == []
    assert sorted(c.command_id for c in t.commands) == ["2:each:1:3", "2:each:1:7"]
    st = t.state
    st = LOOP.on_result(st, CallResultInput("2:each:1:3", 1, ok(3)), workload, {}).state
    t2 = LOOP.on_result(st, CallResultInput("2:each:1:7", 1, ok(7)), workload, {})
    done = [e for e in t2.events if e.event_type == "loop.done"]
    assert done and done[0].result["context"] == {"total": 10, "success": 10, "failed": 0}
    assert [c.step for c in t2.commands] == ["end"]


def test_todo_ranges_are_the_complement_of_the_successful_ones() -> None:
    assert rerun.todo_ranges(5, []) == [[0, 5]]
    assert rerun.todo_ranges(5, [(0, 5)]) == []
    assert rerun.todo_ranges(1000, [(0, 10), (11, 999)]) == [[999, 1000], [10, 11]]
