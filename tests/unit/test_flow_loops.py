"""Loops as a pure function of inputs: dispatch width, ordering, exactly-once loop.done,
O(in-flight) state, re-entry as a new instance, cursor slots."""

from __future__ import annotations

import functools
from typing import Any

from noetl_dsl import parse_playbook
from noetl_flow import CallResultInput, ExecState, StartInput
from noetl_flow import Flow as BatchingFlow

# One iteration per command: these tests pin the per-iteration protocol (batches of
# iterations: test_flow_batches.py).
Flow = functools.partial(BatchingFlow, loop_batch=1)

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: l, path: l}\n"


def ok(ref: int, context: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"status": "ok", "reference": {"ref_id": ref, "type": "db", "uri": f"pg://result_payload/{ref}"},
            "parent_ref": None, "context": context or {}}


def err() -> dict[str, Any]:
    return {"status": "error", "reference": None, "parent_ref": None, "context": {},
            "error": {"code": "TOOL_ERROR", "message": "boom"}}


def loop_playbook(mode: str, width: int | str | None = None, items: str = "{{ numbers }}", extra: str = "") -> Flow:
    spec = f"mode: {mode}" + (f", max_in_flight: {width}" if width else "")
    return Flow(parse_playbook(HEADER + f"""
workload: {{numbers: [1, 2, 3, 4, 5]}}
workflow:
  - step: start
    tool: {{kind: noop}}
    next: {{arcs: [{{step: each}}]}}
  - step: each
    loop:
      in: "{items}"
      iterator: n
      spec: {{{spec}}}
    tool: {{kind: python, code: "result = n * 2"}}
    next:
      arcs:
        - step: end
          when: "{{{{ event.name == 'loop.done' }}}}"
{extra}
  - step: end
    tool: {{kind: noop}}
"""))


class Run:
    def __init__(self, flow: Flow, workload: dict[str, Any] | None = None) -> None:
        self.flow = flow
        self.workload = workload or {"numbers": [1, 2, 3, 4, 5]}
        t = flow.start(StartInput(7, 0, 1), self.workload)
        self.state: ExecState = t.state
        self.log = [t]

    def pending(self, step: str) -> list[str]:
        return sorted((c for c, p in self.state.pending.items() if p.step == step),
                      key=lambda c: int(c.rsplit(":", 1)[1]) if c.count(":") == 3 else 0)

    def finish(self, command_id: str, envelope: dict[str, Any], ctx: dict[str, Any] | None = None) -> Any:
        t = self.flow.on_result(self.state, CallResultInput(command_id, 1, envelope, {"ctx": ctx or {}}),
                                self.workload, {})
        self.state = t.state
        self.log.append(t)
        return t

    def events(self, kind: str) -> list[Any]:
        return [e for t in self.log for e in t.events if e.event_type == kind]


def test_sequential_loop_dispatches_one_at_a_time_in_order_and_routes_on_loop_done() -> None:
    r = Run(loop_playbook("sequential"))
    r.finish(r.pending("start")[0], ok(1))
    assert len(r.log[-1].loop_items) == 1 and r.log[-1].loop_items[0] == ("each:1", [1, 2, 3, 4, 5])
    for i in range(5):
        assert r.pending("each") == [f"7:each:1:{i}"]
        t = r.finish(f"7:each:1:{i}", ok(100 + i))
        assert t.loop_results == [("each:1", i, "ok", 100 + i)]
    done = r.events("loop.done")
    assert len(done) == 1 and done[0].result["context"] == {"total": 5, "success": 5, "failed": 0}
    assert done[0].result["reference"]["type"] == "loop"
    assert r.pending("end"), "arcs route once the loop is done"
    # one event per iteration (call.done), plus step.enter + loop.done per loop
    assert len([e for e in r.events("call.done") if e.meta.get("index") is not None]) == 5


def test_parallel_loop_keeps_max_in_flight_and_refills() -> None:
    r = Run(loop_playbook("parallel", 2))
    r.finish(r.pending("start")[0], ok(1))
    assert r.pending("each") == ["7:each:1:0", "7:each:1:1"]
    r.finish("7:each:1:1", ok(11))
    assert r.pending("each") == ["7:each:1:0", "7:each:1:2"]
    for cid in ["7:each:1:0", "7:each:1:2", "7:each:1:3", "7:each:1:4"]:
        if cid not in r.pending("each"):
            continue
        r.finish(cid, ok(10))
    while r.pending("each"):
        r.finish(r.pending("each")[0], ok(10))
    assert len(r.events("loop.done")) == 1
    lr = r.state.steps["each"].loop
    assert lr is not None and lr.done == 5 and lr.in_flight == 0


def test_state_is_o_in_flight_not_o_collection() -> None:
    items = list(range(10_000))
    r = Run(loop_playbook("parallel", 4), {"numbers": items})
    r.finish(r.pending("start")[0], ok(1))
    for _ in range(100):
        r.finish(r.pending("each")[0], ok(5))
    size = len(repr(r.state.to_json()))
    assert size < 5_000, size  # counters + 4 pending, never the items or results
    assert len(r.state.pending) == 4


def test_duplicate_iteration_result_is_ignored_and_loop_done_is_once() -> None:
    r = Run(loop_playbook("parallel", 5))
    r.finish(r.pending("start")[0], ok(1))
    ids = r.pending("each")
    for cid in ids:
        r.finish(cid, ok(3))
    again = r.finish(ids[0], ok(4))
    assert [e.event_type for e in again.events] == ["call.duplicate"]
    assert len(r.events("loop.done")) == 1


def test_failed_iteration_fails_the_loop_step_after_all_ran() -> None:
    r = Run(loop_playbook("parallel", 5))
    r.finish(r.pending("start")[0], ok(1))
    ids = r.pending("each")
    r.finish(ids[0], err())
    for cid in ids[1:]:
        r.finish(cid, ok(3))
    done = r.events("loop.done")[0]
    assert done.result["status"] == "error" and "1 of 5 iteration(s) failed" in done.result["error"]["message"]
    assert r.state.status == "failed" and "each" in (r.state.error or "")


def test_empty_collection_completes_the_loop_at_once() -> None:
    r = Run(loop_playbook("sequential"), {"numbers": []})
    r.finish(r.pending("start")[0], ok(1))
    assert len(r.events("loop.done")) == 1 and r.pending("end")


def test_reentering_a_loop_step_starts_a_new_instance() -> None:
    flow = Flow(parse_playbook(HEADER + """
workload: {numbers: [1, 2]}
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: each}]}
  - step: each
    loop: {in: "{{ numbers }}", iterator: n, spec: {mode: parallel}}
    tool: {kind: noop}
    next:
      arcs:
        - step: each
          when: "{{ ctx.rounds | default(0) < 1 }}"
          set: {ctx.rounds: "{{ (ctx.rounds | default(0)) + 1 }}"}
        - step: end
  - step: end
    tool: {kind: noop}
"""))
    r = Run(flow, {"numbers": [1, 2]})
    r.finish(r.pending("start")[0], ok(1))
    for cid in r.pending("each"):
        r.finish(cid, ok(2))
    assert sorted(r.pending("each")) == ["7:each:2:0", "7:each:2:1"]
    for cid in r.pending("each"):
        r.finish(cid, ok(2))
    assert [e.meta["loop_instance"] for e in r.events("loop.done")] == ["each:1", "each:2"]
    assert r.pending("end")


def test_sequential_iterations_see_ctx_set_by_the_previous_one() -> None:
    r = Run(loop_playbook("sequential"))
    r.finish(r.pending("start")[0], ok(1))
    r.finish("7:each:1:0", ok(1), ctx={"acc": [1]})
    cmd = next(c for c in r.log[-1].commands if c.command_id == "7:each:1:1")
    assert cmd.context["ctx"] == {"acc": [1]} and cmd.context["loop"]["index"] == 1


def test_bad_collection_fails_naming_the_step() -> None:
    r = Run(loop_playbook("sequential", items="{{ 42.5 }}"))
    r.finish(r.pending("start")[0], ok(1))
    assert r.state.status == "failed" and "loop.in of step 'each'" in (r.state.error or "")


def test_cursor_loop_dispatches_slots_with_the_claim_rendered_once() -> None:
    flow = Flow(parse_playbook(HEADER + """
workload: {batch: 7}
workflow:
  - step: drain
    loop:
      cursor:
        kind: postgres
        auth: pg_local
        claim: "UPDATE q SET s = 'claimed' WHERE batch = {{ batch }} RETURNING id"
      iterator: row
      spec: {mode: cursor, max_in_flight: 3}
    tool: {kind: noop}
"""))
    r = Run(flow, {"batch": 7})
    cmds = r.log[0].commands
    assert [c.kind for c in cmds] == ["cursor"] * 3
    assert cmds[0].context["cursor"]["claim"] == "UPDATE q SET s = 'claimed' WHERE batch = 7 RETURNING id"
    # a slot whose worker was lost is re-issued as a cursor slot again
    slot = r.pending("drain")[0]
    t = flow.on_expired(r.state, slot, 1, 3, "worker lost")
    assert t.republish == [(slot, 2, "cursor")]
    r.state = t.state
    for i, cid in enumerate(r.pending("drain")):
        r.finish(cid, ok(50 + i, {"processed": 10 + i, "failed": 0}))
    done = r.events("loop.done")
    assert len(done) == 1 and done[0].result["context"] == {"total": 33, "success": 33, "failed": 0}
    assert r.state.status == "completed"


def test_a_collection_over_the_limit_fails_the_step_before_any_item_is_copied() -> None:
    """NOETL_LIMIT_LOOP_ITEMS: a list, a mapping, a JSON string or a count above it fails
    the loop step naming the limit (an int is never expanded into a range first)."""
    for items, workload in (("{{ numbers }}", {"numbers": list(range(6))}), ("{{ numbers }}", {"numbers": 10**9}),
                            ("{{ numbers | tojson }}", {"numbers": list(range(6))}),
                            ("{{ numbers }}", {"numbers": {str(i): i for i in range(6)}})):
        flow = loop_playbook("parallel", items=items)
        flow.max_loop_items = 5
        r = Run(flow, workload)
        r.finish(r.pending("start")[0], ok(1))
        assert r.state.status == "failed", items
        assert "has " in (r.state.error or "") and "limit NOETL_LIMIT_LOOP_ITEMS=5" in (r.state.error or ""), r.state.error
        assert not r.log[-1].loop_items
    r = Run(loop_playbook("parallel"))  # the default limit lets 5 items through
    r.finish(r.pending("start")[0], ok(1))
    assert r.log[-1].loop_items == [("each:1", [1, 2, 3, 4, 5])]


def test_max_in_flight_template_is_rendered_when_the_loop_starts() -> None:
    """The PFT flow: `max_in_flight: '{{ workload.pft_batch_concurrency | int }}'`."""
    flow = loop_playbook("parallel", "'{{ workload.width | int }}'")
    run = Run(flow, {"numbers": [1, 2, 3, 4, 5], "width": "3"})
    run.finish(run.pending("start")[0], ok(1))
    assert len(run.pending("each")) == 3
    assert run.state.steps["each"].loop.max_in_flight == 3


def test_max_in_flight_template_rendering_to_no_positive_integer_fails_the_step() -> None:
    flow = loop_playbook("parallel", "'{{ workload.width }}'")
    for bad in (0, "many", None):
        run = Run(flow, {"numbers": [1, 2, 3], "width": bad})
        run.finish(run.pending("start")[0], ok(1))
        assert run.state.status == "failed"
        assert "max_in_flight of step 'each' rendered to" in (run.state.error or "")


def test_max_in_flight_literal_forms() -> None:
    assert loop_playbook("parallel", 4).pb.step("each").loop.max_in_flight == 4
    assert loop_playbook("parallel", "'4'").pb.step("each").loop.max_in_flight == 4
    for bad in ("0", "'x'", "2.5", "true"):
        try:
            loop_playbook("parallel", bad)
        except Exception as exc:  # PlaybookInvalid naming the field
            assert "max_in_flight" in str(exc)
        else:
            raise AssertionError(f"max_in_flight {bad} was accepted")
