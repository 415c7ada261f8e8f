"""Routing as a pure function: feed inputs, check the events and commands it decides."""

from __future__ import annotations

from typing import Any

import pytest
from conformance_data import playbook

from noetl_dsl import parse_playbook
from noetl_flow import CallResultInput, ExecState, Flow, StartInput, Transition

WORKLOAD: dict[str, Any] = {}


def flow_for(rel: str) -> Flow:
    return Flow(parse_playbook(playbook(rel).read_text()))


def ok(value: dict[str, Any] | None = None, ref: int = 1) -> dict[str, Any]:
    return {"status": "ok", "reference": {"ref_id": ref, "type": "db", "uri": f"pg://result_payload/{ref}"},
            "parent_ref": None, "context": value or {}}


def err(message: str) -> dict[str, Any]:
    return {"status": "error", "reference": None, "parent_ref": None, "context": {},
            "error": {"code": "TOOL_ERROR", "message": message}}


class Driver:
    """Feeds a flow like the engine would, keeping the produced commands."""

    def __init__(self, flow: Flow, workload: dict[str, Any] | None = None) -> None:
        self.flow = flow
        self.workload = workload or {}
        t = flow.start(StartInput(1, 0, 1, deadline_ms=10_000), self.workload)
        self.state: ExecState = t.state
        self.log: list[Transition] = [t]

    @property
    def last(self) -> Transition:
        return self.log[-1]

    def command(self, step: str) -> str:
        ids = [c for c, p in self.state.pending.items() if p.step == step]
        assert ids, f"no pending command for {step}: {self.state.pending}"
        return ids[-1]

    def finish(self, step: str, envelope: dict[str, Any], values: dict[str, Any] | None = None,
               ctx: dict[str, Any] | None = None) -> Transition:
        res = CallResultInput(self.command(step), 1, envelope, {"ctx": ctx or {}})
        t = self.flow.on_result(self.state, res, self.workload, values or {})
        self.state = t.state
        self.log.append(t)
        return t

    def entered(self) -> list[str]:
        return [c.step for t in self.log for c in t.commands]

    def events(self) -> list[str]:
        return [e.event_type for t in self.log for e in t.events]


def test_linear_hello_world() -> None:
    d = Driver(flow_for("hello_world/hello_world.yaml"))
    assert d.last.events[0].event_type == "playbook.started"
    assert [c.step for c in d.last.commands] == ["start"]
    d.finish("start", ok())
    d.finish("test_step", ok())
    t = d.finish("end", ok())
    assert d.entered() == ["start", "test_step", "end"]
    assert t.events[-1].event_type == "playbook.completed"
    assert d.state.status == "completed"
    # two events per step: step.enter + call.done
    assert d.events().count("step.enter") == 3 and d.events().count("call.done") == 3


def test_exclusive_arcs_pick_first_true_and_inclusive_fans_out_then_fans_in() -> None:
    d = Driver(flow_for("control_flow_workbook/control_flow_workbook.yaml"), {"temperature_c": 30})
    d.finish("start", ok())
    d.finish("eval_flag", ok(), values={"eval_flag": {"is_hot": True, "message": "hot"}})
    assert d.last.commands[0].step == "hot_path"
    t = d.finish("hot_path", ok())
    assert sorted(c.step for c in t.commands) == ["hot_task_a", "hot_task_b"]
    t = d.finish("hot_task_a", ok())
    assert t.commands == [] and d.state.armed == ["end"], "end waits for hot_task_b"
    t = d.finish("hot_task_b", ok())
    assert [c.step for c in t.commands] == ["end"]
    d.finish("end", ok())
    assert d.state.status == "completed"
    assert d.entered().count("end") == 1


def test_cold_branch() -> None:
    d = Driver(flow_for("control_flow_workbook/control_flow_workbook.yaml"), {"temperature_c": 10})
    d.finish("start", ok())
    d.finish("eval_flag", ok(), values={"eval_flag": {"is_hot": False, "message": "cold"}})
    d.finish("cold_path", ok())
    d.finish("cold_task", ok())
    d.finish("end", ok())
    assert d.entered() == ["start", "eval_flag", "cold_path", "cold_task", "end"]
    assert d.state.status == "completed"


def test_fan_in_barrier_dispatches_reduce_once_after_both_branches() -> None:
    d = Driver(flow_for("fanout_reduce/fanout_reduce_phase6.yaml"))
    t = d.finish("start", ok())
    assert sorted(c.step for c in t.commands) == ["enrich_customer", "normalize_customer"]
    assert d.finish("enrich_customer", ok()).commands == []
    t = d.finish("normalize_customer", ok())
    assert [c.step for c in t.commands] == ["reduce_customer"]
    t = d.finish("reduce_customer", ok())
    assert t.events[-1].event_type == "playbook.completed"
    assert d.entered().count("reduce_customer") == 1


def test_implicit_end() -> None:
    d = Driver(flow_for("root_scripts/test_implicit_end_routing.yaml"))
    d.finish("start", ok())
    t = d.finish("step1", ok())
    assert [c.step for c in t.commands] == ["end"]
    d.finish("end", ok())
    assert d.state.status == "completed"


def test_arc_set_renders_native_values_into_ctx_and_commands_carry_the_snapshot() -> None:
    d = Driver(flow_for("test_args_passing.yaml"), {"initial_value": 100})
    t = d.finish("start", ok())
    assert d.state.ctx == {"test_var": 100, "computed": 200}
    assert t.commands[0].context["ctx"] == {"test_var": 100, "computed": 200}


def test_step_set_reads_own_result_then_arcs_see_updated_ctx() -> None:
    text = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: s, path: s}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    set:
      ctx.more: "{{ start.more }}"
    next:
      arcs:
        - step: again
          when: "{{ ctx.more == true }}"
        - step: done
          when: "{{ ctx.more != true }}"
  - step: again
    tool: {kind: noop}
  - step: done
    tool: {kind: noop}
"""
    d = Driver(Flow(parse_playbook(text)))
    t = d.finish("start", ok(), values={"start": {"more": False}})
    assert [c.step for c in t.commands] == ["done"]


OWN_OUTPUT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: o, path: o}
workflow:
  - step: start
    tool: {kind: postgres, auth: pg, query: "select 1"}
    set:
      ctx.remaining: "{{ output.data.rows[0].remaining_count }}"
      ctx.status: "{{ output.status }}"
    next:
      arcs:
        - step: recover
          when: "{{ output.status == 'error' and output.error.code == 'SQL_ERROR' }}"
        - step: again
          when: "{{ (output.data.rows[0].remaining_count | int) > 0 }}"
          set: {ctx.arc_saw: "{{ output.data.row_count }}"}
        - step: done
          when: "{{ (output.data.rows[0].remaining_count | int) == 0 }}"
  - step: again
    tool: {kind: noop}
  - step: recover
    tool: {kind: noop}
  - step: done
    tool: {kind: noop}
"""


def test_step_set_and_arcs_read_the_steps_own_result_as_output() -> None:
    """The PFT flow's steps: `set` and arcs read `output.data.rows[0]...` (upstream)."""
    d = Driver(Flow(parse_playbook(OWN_OUTPUT)))
    res = CallResultInput(d.command("start"), 1, ok(ref=7))
    assert d.flow.needs(d.state, res) == {"start": {"ref_id": 7, "type": "db", "uri": "pg://result_payload/7"}}
    value = {"rows": [{"remaining_count": 3}], "row_count": 1}
    t = d.finish("start", ok(ref=7), values={"start": value})
    assert [c.step for c in t.commands] == ["again"]
    assert d.state.ctx == {"remaining": 3, "status": "ok", "arc_saw": 1}


def test_step_set_reads_upstreams_result_vars_and_job() -> None:
    """Upstream's Python reference also names the step's result `result`, the workload
    `vars` and the execution `job.uuid`."""
    text = OWN_OUTPUT.replace('ctx.status: "{{ output.status }}"',
                              'ctx.status: "{{ output.status }}"\n      ctx.r: "{{ result.rows[0].remaining_count }}"'
                              '\n      ctx.v: "{{ vars.limit }}"\n      ctx.j: "{{ job.uuid }}"')
    d = Driver(Flow(parse_playbook(text)), {"limit": 5})
    d.finish("start", ok(ref=7), values={"start": {"rows": [{"remaining_count": 0}], "row_count": 1}})
    assert (d.state.ctx["r"], d.state.ctx["v"], d.state.ctx["j"]) == (0, 5, 1)


def test_a_failed_steps_arcs_read_output_status_and_error() -> None:
    d = Driver(Flow(parse_playbook(OWN_OUTPUT)))
    failed = err("relation does not exist")
    failed["error"]["code"] = "SQL_ERROR"
    t = d.finish("start", failed)
    assert [c.step for c in t.commands] == ["recover"]
    assert "remaining" not in d.state.ctx, "a failed step's own set is not applied"


def test_a_step_named_output_keeps_its_name() -> None:
    d = Driver(Flow(parse_playbook(OWN_OUTPUT.replace("step: done", "step: output"))))
    res = CallResultInput(d.command("start"), 1, ok(ref=7))
    assert "start" not in d.flow.needs(d.state, res), "`output` is the step named output here"


def test_policy_ctx_updates_from_worker_are_applied() -> None:
    d = Driver(flow_for("vars_test/test_vars_simple.yaml"))
    d.finish("start", ok())
    t = d.finish("set_var", ok(), ctx={"test_counter": 42, "set_message": "Variable set successfully"})
    assert t.commands[0].step == "get_var"
    assert t.commands[0].context["ctx"]["test_counter"] == 42


def test_step_failure_without_error_arc_fails_execution_naming_the_step() -> None:
    d = Driver(flow_for("broken_sql.yaml"), {"pg_auth": "pg_local"})
    d.finish("start", ok())
    t = d.finish("verify_pg_data", err('syntax error at or near "FROM"'))
    assert [e.event_type for e in t.events] == ["call.error", "playbook.failed"]
    assert d.state.status == "failed"
    assert "verify_pg_data" in (d.state.error or "") and "syntax error" in (d.state.error or "")


def test_error_arc_routes_failure() -> None:
    text = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: e, path: e}
workflow:
  - step: start
    tool: {kind: python, code: "raise Exception('x')"}
    next:
      arcs:
        - step: recover
          when: "{{ event.name == 'call.error' }}"
        - step: normal
  - step: recover
    tool: {kind: noop}
  - step: normal
    tool: {kind: noop}
"""
    d = Driver(Flow(parse_playbook(text)))
    t = d.finish("start", err("x"))
    assert [c.step for c in t.commands] == ["recover"]
    d.finish("recover", ok())
    assert d.state.status == "completed"


def test_duplicate_result_is_recorded_and_ignored() -> None:
    d = Driver(flow_for("simple_python.yaml"))
    cid = d.command("start")
    d.finish("start", ok())
    again = d.flow.on_result(d.state, CallResultInput(cid, 2, ok(ref=9)), {}, {})
    assert [e.event_type for e in again.events] == ["call.duplicate"]
    assert again.commands == [] and again.updates == []
    assert again.state.steps["start"].result == ok()


def test_template_error_in_arc_fails_with_template_named() -> None:
    text = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: t, path: t}
workflow:
  - step: start
    tool: {kind: noop}
    next:
      arcs:
        - step: end
          when: "{{ nope > 1 }}"
  - step: end
    tool: {kind: noop}
"""
    d = Driver(Flow(parse_playbook(text)))
    d.finish("start", ok())
    assert d.state.status == "failed"
    assert "nope" in (d.state.error or "") and "{{ nope > 1 }}" in (d.state.error or "")


def test_cancel_and_timeout_cancel_pending_commands() -> None:
    d = Driver(flow_for("simple_python.yaml"))
    t = d.flow.on_cancel(d.state, "user asked")
    assert t.state.status == "cancelled" and [u.status for u in t.updates] == ["cancelled"]
    assert t.events[-1].event_type == "playbook.cancelled"
    early = d.flow.on_timeout(d.state, 5_000)
    assert early.events == [] and early.state.status == "running"
    late = d.flow.on_timeout(d.state, 10_001)
    assert late.state.status == "failed" and "timed out" in (late.state.error or "")


def test_expired_command_is_reissued_then_dead_lettered() -> None:
    d = Driver(flow_for("simple_python.yaml"))
    cid = d.command("start")
    t = d.flow.on_expired(d.state, cid, 1, 2, "worker lost")
    assert t.republish == [(cid, 2, "python")] and t.state.pending[cid].attempt == 2
    stale = d.flow.on_expired(t.state, cid, 1, 2, "worker lost")
    assert stale.events == [], "an expiry of an older attempt is ignored"
    dead = d.flow.on_expired(t.state, cid, 2, 2, "worker lost")
    assert [e.event_type for e in dead.events] == ["command.dead_lettered", "playbook.failed"]
    assert "start" in (dead.state.error or "") and "dead-lettered" in (dead.state.error or "")


def test_needs_lists_only_steps_templates_read() -> None:
    d = Driver(flow_for("control_flow_workbook/control_flow_workbook.yaml"), {"temperature_c": 30})
    d.finish("start", ok())
    res = CallResultInput(d.command("eval_flag"), 1, ok(ref=5))
    assert d.flow.needs(d.state, res) == {"eval_flag": {"ref_id": 5, "type": "db", "uri": "pg://result_payload/5"}}


def test_state_roundtrips_through_json() -> None:
    d = Driver(flow_for("fanout_reduce/fanout_reduce_phase6.yaml"))
    d.finish("start", ok())
    d.finish("enrich_customer", ok())
    again = ExecState.from_json(d.state.to_json())
    assert again == d.state


@pytest.mark.parametrize("rel", ["hello_world/hello_world.yaml", "test_start_with_action.yaml",
                                 "test_end_with_action.yaml", "vars_test/test_vars_simple.yaml"])
def test_linear_playbooks_complete_when_every_step_succeeds(rel: str) -> None:
    d = Driver(flow_for(rel), {"test_value": "hello", "cleanup_required": True, "message": "m"})
    for _ in range(20):
        if d.state.terminal:
            break
        step = next(iter(d.state.pending.values())).step
        d.finish(step, ok(), values={n: {"data": {"executed": True, "temp_table": "t"}} for n in d.flow.step_names})
    assert d.state.status == "completed"


def test_a_failed_step_routes_only_through_arcs_that_read_the_failure() -> None:
    """Upstream stops a run at a failed task: an arc whose `when` is about the results of
    a step that succeeded (here true on a failure too: the rows are undefined) must not
    carry a failure onwards; arcs reading `event`, `error` or `output.status` can."""
    text = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: e, path: e}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next:
      arcs:
        - step: empty
          when: "{{ not start.rows }}"
        - step: caught
          when: "{{ output.status == 'error' }}"
  - step: empty
    tool: {kind: noop}
  - step: caught
    tool: {kind: noop}
"""
    d = Driver(Flow(parse_playbook(text)))
    t = d.finish("start", err("boom"))
    assert [c.step for c in t.commands] == ["caught"]
    d = Driver(Flow(parse_playbook(text.replace("output.status == 'error'", "start.rows is none"))))
    t = d.finish("start", err("boom"))
    assert t.commands == [] and d.state.status == "failed" and "boom" in (d.state.error or "")
    # on success the first arc still fires as written
    d = Driver(Flow(parse_playbook(text)))
    t = d.finish("start", ok(), values={"start": {"rows": []}})
    assert [c.step for c in t.commands] == ["empty"]
