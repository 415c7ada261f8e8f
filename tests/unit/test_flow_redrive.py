"""Dead letters and redrives as pure functions of the state (noetl_flow/redrive.py)."""

from __future__ import annotations

import functools
from typing import Any

from noetl_dsl import parse_playbook
from noetl_flow import CallResultInput, ExecState, RedriveItem, StartInput, refusal
from noetl_flow import Flow as BatchingFlow

# One iteration per command: these tests pin the per-iteration protocol (batches of
# iterations: test_flow_batches.py).
Flow = functools.partial(BatchingFlow, loop_batch=1)

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: r, path: r}\n"


def ok(ref: int) -> dict[str, Any]:
    return {"status": "ok", "reference": {"ref_id": ref, "type": "db", "uri": f"pg://result_payload/{ref}"},
            "parent_ref": None, "context": {}}


def err(message: str = "boom") -> dict[str, Any]:
    return {"status": "error", "reference": None, "parent_ref": None, "context": {},
            "error": {"code": "TOOL_ERROR", "message": message, "exception_type": "ValueError"}}


PLAIN = Flow(parse_playbook(HEADER + """
workflow:
  - step: start
    tool: {kind: noop}
    next: {spec: {mode: inclusive}, arcs: [{step: flaky}, {step: slow}]}
  - step: flaky
    tool: {kind: python, code: "result = 1"}
    next: {arcs: [{step: end}]}
  - step: slow
    tool: {kind: python, code: "result = 2"}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop}
"""))

CAUGHT = Flow(parse_playbook(HEADER + """
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next:
      arcs:
        - step: recover
          when: "{{ event.name == 'call.error' }}"
  - step: recover
    tool: {kind: noop}
"""))

LOOP = Flow(parse_playbook(HEADER + """
workload: {numbers: [0, 1, 2, 3, 4]}
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: each}]}
  - step: each
    loop: {in: "{{ numbers }}", iterator: n, spec: {mode: parallel, max_in_flight: 5}}
    tool: {kind: python, code: "result = n"}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop}
"""))


class Run:
    def __init__(self, flow: Flow, workload: dict[str, Any] | None = None) -> None:
        self.flow = flow
        self.workload = workload or {"numbers": [0, 1, 2, 3, 4]}
        t = flow.start(StartInput(7, 0, 1), self.workload)
        self.state: ExecState = t.state
        self.log = [t]

    def pending(self, step: str) -> list[str]:
        return sorted(c for c, p in self.state.pending.items() if p.step == step)

    def finish(self, command_id: str, envelope: dict[str, Any]) -> Any:
        t = self.flow.on_result(self.state, CallResultInput(command_id, 1, envelope, {}, "w1"), self.workload, {})
        return self._keep(t)

    def redrive(self, *items: RedriveItem) -> Any:
        return self._keep(self.flow.on_redrive(self.state, list(items), 123_000))

    def _keep(self, t: Any) -> Any:
        self.state = ExecState.from_json(t.state.to_json())  # what the engine persists and loads
        self.log.append(t)
        return t

    def events(self, kind: str) -> list[Any]:
        return [e for t in self.log for e in t.events if e.event_type == kind]


def item(t: Any, dl_id: int, n: int = 0) -> RedriveItem:
    d = t.dead_letters[n]
    return RedriveItem(dl_id, d.command_id, d.step, d.reason, d.loop_instance, d.loop_index)


def test_a_failed_step_is_a_dead_letter_and_a_redrive_resumes_the_execution_and_its_cancelled_branch() -> None:
    r = Run(PLAIN)
    r.finish("7:start:1", ok(1))
    assert r.pending("flaky") == ["7:flaky:1"] and r.pending("slow") == ["7:slow:1"]
    t = r.finish("7:flaky:1", err())
    assert r.state.status == "failed"
    assert [(d.command_id, d.step, d.attempts, d.reason, d.worker_id, d.loop_index) for d in t.dead_letters] == [
        ("7:flaky:1", "flaky", 1, "failed", "w1", None)]
    assert t.dead_letters[0].error["exception_type"] == "ValueError"
    assert [(u.command_id, u.status) for u in t.updates] == [("7:flaky:1", "failed"), ("7:slow:1", "cancelled")]
    dl = item(t, 11)
    assert refusal(r.state, dl) is None

    t = r.redrive(dl)
    assert t.redrive_outcomes == [(11, "7:flaky:1~r1", None)]
    assert r.state.status == "running" and r.state.deadline_ms == 123_000 and r.state.redrives == 1
    # the slow branch the failure cancelled is queued again, one attempt later
    assert [(u.command_id, u.status, u.attempt) for u in t.updates] == [("7:slow:1", "queued", 2)]
    assert t.republish == [("7:slow:1", 2, "python")]
    assert [c.command_id for c in t.commands] == ["7:flaky:1~r1"] and t.commands[0].attempt == 1
    [ev] = t.events
    assert (ev.event_type, ev.step, ev.command_id, ev.meta["resumed"]) == ("command.redriven", "flaky",
                                                                         "7:flaky:1~r1", ["slow"])
    # a second redrive of the same dead letter is refused, naming why
    assert "its command is now 7:flaky:1~r1" in (refusal(r.state, dl) or "")
    assert "already redriven" in (refusal(r.state, RedriveItem(11, "7:flaky:1", "flaky", "failed",
                                                               status="redriven")) or "")

    r.finish("7:flaky:1~r1", ok(2))
    r.finish("7:slow:1", ok(3))
    r.finish(r.pending("end")[0], ok(4))
    assert r.state.status == "completed"
    [done] = r.events("playbook.completed")
    assert done.meta == {"redrive": 1}


def test_a_redriven_command_that_fails_again_is_a_new_dead_letter_and_the_terminal_event_a_new_generation() -> None:
    r = Run(PLAIN)
    r.finish("7:start:1", ok(1))
    t = r.finish("7:flaky:1", err())
    r.redrive(item(t, 1))
    t = r.finish("7:flaky:1~r1", err("again"))
    assert r.state.status == "failed" and t.dead_letters[0].command_id == "7:flaky:1~r1"
    assert [e.meta for e in r.events("playbook.failed")] == [{}, {"redrive": 1}]
    # the old dead letter names a command the step no longer runs
    assert "ran again" in (refusal(r.state, item(r.log[2], 1)) or "")
    t = r.redrive(item(t, 2))
    assert t.redrive_outcomes == [(2, "7:flaky:1~r2", None)]


def test_a_failure_the_playbook_handled_is_a_dead_letter_that_cannot_be_redriven() -> None:
    r = Run(CAUGHT)
    t = r.finish("7:start:1", err())
    assert len(t.dead_letters) == 1
    r.finish(r.pending("recover")[0], ok(1))
    assert r.state.status == "completed"
    why = refusal(r.state, item(t, 5))
    assert why is not None and "completed" in why and "call.error" in why
    t2 = r.redrive(item(t, 5))
    assert t2.redrive_outcomes == [(5, None, why)] and not t2.events and not t2.commands


def test_cancelled_and_sub_playbook_executions_refuse() -> None:
    r = Run(PLAIN)
    r.finish("7:start:1", ok(1))
    t = r.finish("7:flaky:1", err())
    parent = ExecState.from_json({**r.state.to_json(), "parent_execution_id": 3})
    assert "sub-playbook of execution 3" in (refusal(parent, item(t, 1)) or "")
    cancelled = ExecState.from_json({**r.state.to_json(), "status": "cancelled"})
    assert refusal(cancelled, item(t, 1)) == "execution 7 was cancelled"
    assert refusal(None, item(t, 1)) is not None


def test_a_command_dead_lettered_by_expired_claims_is_redriven() -> None:
    r = Run(PLAIN)
    r.finish("7:start:1", ok(1))
    for attempt in (1, 2):
        r._keep(r.flow.on_expired(r.state, "7:flaky:1", attempt, 3, "claim lease expired"))
    t = r._keep(r.flow.on_expired(r.state, "7:flaky:1", 3, 3, "claim lease expired"))
    assert r.state.status == "failed"
    [d] = t.dead_letters
    assert (d.reason, d.attempts, d.error["code"]) == ("expired", 3, "DEAD_LETTERED")
    t = r.redrive(item(t, 9))
    assert t.redrive_outcomes == [(9, "7:flaky:1~r1", None)] and r.state.status == "running"
    r.finish("7:flaky:1~r1", ok(2))
    r.finish("7:slow:1", ok(3))
    r.finish(r.pending("end")[0], ok(4))
    assert r.state.status == "completed"


def test_failed_loop_iterations_are_redriven_one_by_one_and_the_loop_completes() -> None:
    r = Run(LOOP)
    r.finish("7:start:1", ok(1))
    dead = []
    for i in range(5):
        t = r.finish(f"7:each:1:{i}", err() if i in (1, 3, 4) else ok(10 + i))
        dead += [RedriveItem(100 + i, d.command_id, d.step, d.reason, d.loop_instance, d.loop_index)
                 for d in t.dead_letters]
    assert [(d.loop_instance, d.loop_index) for d in dead] == [("each:1", 1), ("each:1", 3), ("each:1", 4)]
    assert r.state.status == "failed" and r.state.suspended is not None
    assert r.state.suspended["instance"] == "each:1"
    assert all(refusal(r.state, d) is None for d in dead)

    # one iteration: the loop reopens with it in flight
    t = r.redrive(dead[0])
    assert t.redrive_outcomes == [(101, "7:each:1:1~r1", None)] and t.loop_results_cleared == [("each:1", 1)]
    assert t.commands[0].context["loop"] == {"instance": "each:1", "index": 1, "iterator": "n", "mode": "parallel"}
    assert r.state.status == "running" and r.state.steps["each"].status == "running"
    # while it runs, the others may be redriven into the open loop
    assert refusal(r.state, dead[1]) is None
    t = r.redrive(dead[1])
    assert t.redrive_outcomes == [(103, "7:each:1:3~r2", None)]
    r.finish("7:each:1:1~r1", ok(21))
    t = r.finish("7:each:1:3~r2", ok(23))
    # the loop finished again with one failed iteration: the execution fails again
    assert r.state.status == "failed"
    assert [e.meta["redrive"] for e in r.events("loop.done")[1:]] == [2]
    t = r.redrive(dead[2])
    assert t.redrive_outcomes == [(104, "7:each:1:4~r3", None)]
    t = r.finish("7:each:1:4~r3", ok(24))
    [last] = [e for e in t.events if e.event_type == "loop.done"]
    assert last.result["status"] == "ok" and last.meta["redrive"] == 3
    assert last.result["context"] == {"total": 5, "success": 5, "failed": 0}
    r.finish(r.pending("end")[0], ok(5))
    assert r.state.status == "completed"
    assert [e.meta for e in r.events("playbook.completed")] == [{"redrive": 3}]


def test_a_loop_whose_step_was_entered_again_refuses_its_old_iterations() -> None:
    r = Run(LOOP)
    r.finish("7:start:1", ok(1))
    for i in range(5):
        t = r.finish(f"7:each:1:{i}", err() if i == 2 else ok(i))
    old = RedriveItem(1, "7:each:1:2", "each", "failed", "each:0", 2)
    assert "is over" in (refusal(r.state, old) or "")
    assert refusal(r.state, item(r.log[4], 1)) is None
    assert t is not None
