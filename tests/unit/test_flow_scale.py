"""Routing and validation are linear in the number of steps: 10,000-step playbooks of
several shapes parse, validate, pass the submit-time checks, build a Flow and route.
A transitive closure (what Flow used to build) needs minutes and gigabytes at this
size, so a quadratic regression shows up as a timeout; no wall-clock is asserted.

Also: the lazy reachability that the fan-in barrier asks agrees with a brute-force
closure on random graphs, cycles included."""

from __future__ import annotations

import functools
import random
from typing import Any

from noetl_api.static_checks import check_templates, credential_refs, playbook_refs
from noetl_common.config import LimitSettings
from noetl_dsl import Playbook, load_playbook, merged_workload, parse_playbook, reachable_from, successors
from noetl_flow import CallResultInput, ExecState, StartInput, Transition
from noetl_flow import Flow as BatchingFlow
from noetl_flow.reach import Reachability

# One iteration per command: these tests pin the per-iteration protocol (batches of
# iterations: test_flow_batches.py).
Flow = functools.partial(BatchingFlow, loop_batch=1)

N = 10_000
HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: big}\nworkload: {n: 1}\nworkflow:\n"
OK = {"status": "ok", "reference": {"ref_id": 1, "type": "db", "uri": "pg://result_payload/1"},
      "parent_ref": None, "context": {}}


class Driver:
    """Feeds a flow the way the engine does (state folded in place)."""

    def __init__(self, playbook: Playbook, workload: dict[str, Any]) -> None:
        self.flow = Flow(playbook, copy_state=False)
        self.workload = workload
        t = self.flow.start(StartInput(1, 0, 1), workload)
        self.state: ExecState = t.state
        self.last: Transition = t
        self.entered = [c.step for c in t.commands]

    def finish(self, step: str) -> Transition:
        command = next(c for c, p in self.state.pending.items() if p.step == step)
        t = self.flow.on_result(self.state, CallResultInput(command, 1, OK), self.workload, {})
        self.state, self.last = t.state, t
        self.entered += [c.step for c in t.commands]
        return t

    def finish_next(self) -> str:
        step = next(iter(self.state.pending.values())).step
        self.finish(step)
        return step


def submit_checks(pb: Playbook) -> None:
    """What the api runs on a submission before anything is written."""
    workload = merged_workload(pb, {})
    check_templates(pb, workload)
    assert credential_refs(pb, workload) == []
    assert playbook_refs(pb) == []


def doc(steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "big"},
            "workload": {"n": 1}, "workflow": steps}


def test_a_10000_step_chain_parses_validates_and_routes() -> None:
    text = HEADER + "".join(f"- step: s{i}\n  tool: {{kind: noop}}\n  next: s{i + 1}\n" for i in range(N - 1))
    text += f"- step: s{N - 1}\n  tool: {{kind: noop}}\n"
    pb = parse_playbook(text)
    submit_checks(pb)
    d = Driver(pb, {"n": 1})
    assert d.entered == ["s0"]
    for i in range(50):
        assert d.finish_next() == f"s{i}"
    assert d.entered[-1] == "s50" and [p.step for p in d.state.pending.values()] == ["s50"]


def test_a_10000_wide_fan_out_into_one_fan_in() -> None:
    branches = N - 2
    steps: list[dict[str, Any]] = [{"step": "start", "tool": {"kind": "noop"},
                                    "next": {"spec": {"mode": "inclusive"},
                                             "arcs": [{"step": f"b{i}"} for i in range(branches)]}}]
    steps += [{"step": f"b{i}", "tool": {"kind": "noop"}, "next": "join"} for i in range(branches)]
    steps.append({"step": "join", "tool": {"kind": "noop"}})
    pb = load_playbook(doc(steps))
    submit_checks(pb)
    d = Driver(pb, {"n": 1})
    d.finish("start")
    assert len(d.state.pending) == branches
    for _ in range(branches - 1):
        d.finish_next()
        assert d.last.commands == []
    assert d.state.armed == ["join"]
    d.finish_next()
    assert [c.step for c in d.last.commands] == ["join"]
    d.finish("join")
    assert d.state.status == "completed" and d.entered.count("join") == 1


def test_a_10000_step_ladder_of_conditional_arcs() -> None:
    # Every step may jump to the last one (a fan-in of 9,999 predecessors) or go on.
    steps = [{"step": f"s{i}", "tool": {"kind": "noop"},
              "next": {"arcs": [{"step": f"s{N - 1}", "when": "{{ ctx.skip | default(false) }}"},
                                {"step": f"s{i + 1}", "when": "{{ workload.n > 0 }}",
                                 "set": {"ctx.last": i}}]}}
             for i in range(N - 2)]
    steps.append({"step": f"s{N - 2}", "tool": {"kind": "noop"}, "next": f"s{N - 1}"})
    steps.append({"step": f"s{N - 1}", "tool": {"kind": "noop"}})
    pb = load_playbook(doc(steps))
    submit_checks(pb)
    d = Driver(pb, {"n": 1})
    for i in range(30):
        assert d.finish_next() == f"s{i}"
    assert d.state.ctx == {"last": 29} and d.state.armed == []
    # The jump arms the fan-in; nothing else is running, so it is entered at once.
    d.state.ctx["skip"] = True
    d.finish_next()
    assert d.last.commands[-1].step == f"s{N - 1}"


def test_a_10000_step_cycle_routes_round_and_round() -> None:
    text = HEADER + "".join(f"- step: s{i}\n  tool: {{kind: noop}}\n  next: s{(i + 1) % N}\n" for i in range(N))
    pb = parse_playbook(text)
    submit_checks(pb)
    flow = Flow(pb)
    assert flow.reach.reaches("s0", "s0") and flow.reach.any_reaches(["s5000"], "s4999")
    d = Driver(pb, {"n": 1})
    for i in range(40):
        assert d.finish_next() == f"s{i}"


def test_10000_steps_within_yaml_limits_parse_linearly() -> None:
    # The largest document the default limits admit: ~100 bytes and 10 YAML nodes a step.
    text = HEADER + "".join(f"- {{step: s{i}, tool: {{kind: noop}}, next: [s{i + 1}, s{N - 1}]}}\n"
                            for i in range(N - 1)) + f"- {{step: s{N - 1}, tool: {{kind: noop}}}}\n"
    limits = LimitSettings.model_construct()
    assert len(text) < limits.playbook_bytes
    pb = parse_playbook(text, limits=limits)
    assert len(pb.workflow) == N
    assert Flow(pb).joins == {f"s{N - 1}"}


def brute_closure(succ: dict[str, set[str]]) -> dict[str, set[str]]:
    out = {}
    for name in succ:
        seen: set[str] = set()
        todo = list(succ[name])
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo.extend(succ[x])
        out[name] = seen
    return out


def test_lazy_reachability_agrees_with_the_closure_on_random_graphs() -> None:
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(1, 14)
        names = [f"n{i}" for i in range(n)]
        succ = {a: {b for b in names if rng.random() < rng.choice((0.05, 0.15, 0.3))} for a in names}
        closure = brute_closure(succ)
        reach = Reachability(succ)
        for target in names:
            for a in names:
                assert reach.reaches(a, target) == (target in closure[a]), (succ, a, target)
            sources = rng.sample(names, rng.randint(0, n))
            expected = any(target in closure[a] for a in sources if a != target)
            assert reach.any_reaches(sources, target) == expected, (succ, sources, target)
    assert not Reachability({"a": set()}).any_reaches(["zz"], "a")
    assert not Reachability({"a": set()}).any_reaches(["a"], "zz")


def test_reachable_from_matches_flow_reachability_on_conformance_shapes() -> None:
    text = HEADER + """\
- {step: start, tool: {kind: noop}, next: {spec: {mode: inclusive}, arcs: [{step: a}, {step: b}]}}
- {step: a, tool: {kind: noop}, next: [c]}
- {step: b, tool: {kind: noop}, next: [{step: b, when: "{{ ctx.again }}"}, {step: c}]}
- {step: c, tool: {kind: noop}}
- {step: end, tool: {kind: noop}}
"""
    pb = parse_playbook(text)
    flow = Flow(pb)
    for src in pb.step_names:
        for dst in pb.step_names:
            assert flow.reach.reaches(src, dst) == (dst in reachable_from(pb, src)), (src, dst)
    assert successors(pb)["c"] == {"end"}
