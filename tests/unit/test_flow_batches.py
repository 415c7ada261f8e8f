"""Batches of loop iterations as a pure function of inputs (noetl_flow.loops.batch_size):
a collection loop's command runs several consecutive iterations (a sequential loop's one
command at a time, in index order); every index is dispatched
exactly once, at most ``max_in_flight`` commands run, batches shrink as the loop ends,
each iteration keeps its own result (in index order), failure, dead letter and ``set``;
a batch's result is accepted once; an expired batch runs again whole."""

from __future__ import annotations

from typing import Any

import pytest

from noetl_common.vocab import command_id, iteration_command_id, loop_span
from noetl_dsl import parse_playbook
from noetl_flow import CallResultInput, ExecState, Flow, IterationOutcome, RedriveItem, StartInput, refusal
from noetl_flow.loops import BATCH_SHARE, batch_size, observe_pace
from noetl_flow.state import LoopRun

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: b, path: b}\n"


def playbook(mode: str = "parallel", width: int = 4, kind: str = "python", arcs: str = "[{step: end}]") -> str:
    tool = ("{kind: playbook, path: child}" if kind == "playbook" else "{kind: python, code: \"result = n * 2\"}")
    return HEADER + f"""
workload: {{numbers: 100}}
workflow:
  - step: start
    tool: {{kind: noop}}
    next: {{arcs: [{{step: each}}]}}
  - step: each
    loop: {{in: "{{{{ numbers }}}}", iterator: n, spec: {{mode: {mode}, max_in_flight: {width}}}}}
    tool: {tool}
    next: {{arcs: {arcs}}}
  - step: end
    tool: {{kind: noop}}
"""


def ok(ref: int) -> dict[str, Any]:
    return {"status": "ok", "reference": {"ref_id": ref, "type": "db", "uri": f"pg://result_payload/{ref}"},
            "parent_ref": None, "context": {}}


def err(message: str = "boom") -> dict[str, Any]:
    return {"status": "error", "reference": None, "parent_ref": None, "context": {},
            "error": {"code": "TOOL_ERROR", "message": message}}


SUMMARY = {"status": "ok", "reference": None, "parent_ref": None, "context": {}}


class Run:
    def __init__(self, flow: Flow, numbers: int = 100) -> None:
        self.flow = flow
        self.workload = {"numbers": numbers}
        self.log: list[Any] = []
        self._keep(flow.start(StartInput(7, 0, 1), self.workload))
        self.finish_plain("7:start:1")

    def _keep(self, t: Any) -> Any:
        self.state = ExecState.from_json(t.state.to_json())  # what the engine persists and loads
        self.log.append(t)
        return t

    def finish_plain(self, cid: str) -> Any:
        return self._keep(self.flow.on_result(self.state, CallResultInput(cid, 1, ok(1), {}, "w1"), self.workload, {}))

    def spans(self) -> dict[str, tuple[int, int]]:
        return {c: (p.index or 0, p.count) for c, p in self.state.pending.items() if p.step == "each"}

    def answer(self, cid: str, outcomes: list[IterationOutcome] | None = None, *,
               fail: frozenset[int] = frozenset(), attempt: int = 1, pace_ms: float | None = None) -> Any:
        p = self.state.pending[cid]
        assert p.index is not None
        if outcomes is None:
            outcomes = [IterationOutcome(i, err(f"boom {i}") if i in fail else ok(1000 + i), {"ctx": {"last": i}})
                        for i in range(p.index, p.index + p.count)]
        summary = {**SUMMARY, "status": "error" if any(o.envelope["status"] == "error" for o in outcomes) else "ok"}
        if pace_ms is not None:  # what the worker reports of a batch: the iterations it ran, its wall time
            summary["context"] = {"count": len(outcomes), "failed": 0, "ms": pace_ms * len(outcomes)}
        res = CallResultInput(cid, attempt, summary, {}, "w1", tuple(outcomes) if p.count > 1 else ())
        if p.count == 1:  # a single iteration answers with its own envelope
            res = CallResultInput(cid, attempt, outcomes[0].envelope, outcomes[0].set_updates, "w1")
        return self._keep(self.flow.on_result(self.state, res, self.workload, {}))

    def events(self, kind: str) -> list[Any]:
        return [e for t in self.log for e in t.events if e.event_type == kind]

    def drain(self, fail: frozenset[int] = frozenset(), most: int = 4,
              pace_ms: float | None = None) -> list[tuple[int, int]]:
        """Answer the lowest pending batch until the loop is done; the spans answered."""
        seen = []
        while spans := self.spans():
            assert len(spans) <= most  # max_in_flight bounds commands (each runs its iterations in turn)
            cid = min(spans, key=lambda c: spans[c][0])
            seen.append(spans[cid])
            self.answer(cid, fail=fail, pace_ms=pace_ms)
        return seen


def test_every_index_is_dispatched_once_in_shrinking_batches_within_max_in_flight() -> None:
    r = Run(Flow(parse_playbook(playbook()), loop_batch=8))
    first = r.spans()
    assert len(first) == 4
    for cid, (index, count) in first.items():
        assert cid == command_id(7, "each", 1, index, count) and loop_span(cid) == (index, count)
    spans = r.drain()
    covered = sorted(i for index, count in spans for i in range(index, index + count))
    assert covered == list(range(100))
    sizes = [count for _, count in spans]
    assert max(sizes) == 8 and sizes[-1] == 1 and len(spans) < 40  # ~100 single commands without batches
    # per-iteration results, in index order overall; one event per batch; loop.done once
    results = [r for t in r.log for r in t.loop_results]
    assert sorted(i for _, i, _, _ in results) == list(range(100))
    assert all(status == "ok" and ref == 1000 + i for _, i, status, ref in results)
    done = [e for e in r.events("call.done") if e.step == "each"]
    assert len(done) == len(spans) and all(e.meta.get("count", 1) == c for e, (_, c) in zip(done, spans, strict=True))
    loop_done = r.events("loop.done")
    assert len(loop_done) == 1 and loop_done[0].result["context"] == {"total": 100, "success": 100, "failed": 0}
    assert r.state.ctx["last"] == spans[-1][0]  # each iteration's `set`, applied in index order


def test_the_batch_size_follows_what_is_left_per_lane() -> None:
    lr = LoopRun(instance="x:1", mode="parallel", iterator="n", total=1000, max_in_flight=16)
    assert batch_size(lr, "python", 32) == 32  # ceil(1000 / (2 * 16))
    assert batch_size(lr, "python", 1) == 1
    lr.next_index = 900
    assert batch_size(lr, "python", 32) == -(-100 // (BATCH_SHARE * 16))
    lr.next_index = 999
    assert batch_size(lr, "python", 32) == 1
    # a sequential loop has one lane: half of what is left, at most `most`
    assert batch_size(LoopRun(instance="x:1", mode="sequential", iterator="n", total=1000, max_in_flight=1),
                      "python", 32) == 32
    assert batch_size(LoopRun(instance="x:1", mode="sequential", iterator="n", total=1000, max_in_flight=1,
                              next_index=994), "python", 32) == 3
    assert batch_size(LoopRun(instance="x:1", mode="parallel", iterator="n", total=1000, max_in_flight=16),
                      "playbook", 32) == 1


def test_batches_of_fast_iterations_stay_large_to_the_loops_end() -> None:
    """Once results show how long iterations take, batches shrink no further than the
    iterations that run in loop_batch_ms: fast ones keep sharing commands to the end
    (each command costs more than the imbalance it would save), slow ones still end one per
    command. Every index still runs once, in index order."""
    fast = Run(Flow(parse_playbook(playbook()), loop_batch=8, loop_batch_ms=100))
    spans = fast.drain(pace_ms=2.0)  # 50 iterations fit in 100 ms: every batch is `most` (8)
    assert sorted(i for index, count in spans for i in range(index, index + count)) == list(range(100))
    sizes = [count for _, count in spans]
    assert sizes == [8] * 12 + [4] and fast.state.steps["each"].loop.iteration_ms == 2.0
    # without a pace (a worker that does not report one) or with the floor off: guided self-scheduling alone
    for flow, pace in ((Flow(parse_playbook(playbook()), loop_batch=8, loop_batch_ms=100), None),
                       (Flow(parse_playbook(playbook()), loop_batch=8, loop_batch_ms=0), 2.0)):
        plain = [count for _, count in Run(flow).drain(pace_ms=pace)]
        assert plain[-1] == 1 and len(plain) > 20
    slow = [count for _, count in Run(Flow(parse_playbook(playbook()), loop_batch=8, loop_batch_ms=100))
            .drain(pace_ms=40.0)]  # 2 fit in 100 ms
    assert min(slow[:-1]) == 2 and len(slow) > len(sizes)  # the last takes what is left
    done = Run(Flow(parse_playbook(playbook()), loop_batch=8, loop_batch_ms=100))
    done.drain(pace_ms=2.0)
    assert len(done.events("loop.done")) == 1


def test_the_pace_is_a_moving_average_of_what_batches_report_and_ignores_nonsense() -> None:
    lr = LoopRun(instance="x:1", mode="parallel", iterator="n", total=1000, max_in_flight=16, next_index=990)
    assert batch_size(lr, "python", 32, 100) == 1  # no pace yet: guided self-scheduling
    observe_pace(lr, {"count": 10, "failed": 0, "ms": 40.0})
    assert lr.iteration_ms == 4.0 and batch_size(lr, "python", 32, 100) == 25
    observe_pace(lr, {"count": 4, "ms": 8.0})  # newest batch weighs half
    assert lr.iteration_ms == 3.0 and batch_size(lr, "python", 32, 100) == 32
    assert batch_size(lr, "python", 32, 0) == 1  # the floor off
    for nonsense in (None, {}, {"count": 0, "ms": 1}, {"count": 3}, {"count": "x", "ms": 1}, {"count": 2, "ms": -1},
                     {"count": 2, "ms": float("nan")}, {"count": 2, "ms": float("inf")}, {"count": 2, "ms": "1e400"},
                     ["count", 2]):
        observe_pace(lr, nonsense)  # type: ignore[arg-type]
        assert lr.iteration_ms == 3.0
    observe_pace(lr, {"count": 1, "ms": 0})
    assert batch_size(lr, "python", 32, 100) == 32  # a pace of 0 ms: as many as a batch may hold
    lr.iteration_ms = 0.0
    assert batch_size(lr, "python", 32, 100) == 32
    assert batch_size(lr, "playbook", 32, 100) == 1  # sub-playbooks stay one per command whatever the pace


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_sub_playbooks_run_one_iteration_per_command(mode: str) -> None:
    r = Run(Flow(parse_playbook(playbook(mode=mode, kind="playbook")), loop_batch=32))
    assert all(count == 1 for _, count in r.spans().values())
    assert all(loop_span(c) is None for c in r.spans())


def test_a_sequential_loop_runs_in_batches_one_at_a_time_in_index_order() -> None:
    """One command at a time, each a batch of the next indexes; a batch the worker's budget
    cut short gives its rest back, and the rest runs next, before any later index."""
    r = Run(Flow(parse_playbook(playbook(mode="sequential")), loop_batch=8), numbers=40)
    seen: list[int] = []
    cut = True
    while spans := r.spans():
        assert len(spans) == 1  # one at a time
        (cid, (index, count)), = spans.items()
        assert index == len(seen)  # the next index, never a later one
        ran = 2 if cut and count > 2 else count  # the first batch stops after two iterations
        cut = False
        r.answer(cid, [IterationOutcome(i, ok(1000 + i), {"ctx": {"last": i}}) for i in range(index, index + ran)])
        seen.extend(range(index, index + ran))
    assert seen == list(range(40))
    assert r.state.ctx["last"] == 39
    assert [e.result["context"] for e in r.events("loop.done")] == [{"total": 40, "success": 40, "failed": 0}]
    assert max(c for e in r.events("call.done") if e.step == "each" for c in [e.meta.get("count", 1)]) == 8


def test_a_failed_iteration_in_a_batch_is_its_own_dead_letter_and_fails_the_loop() -> None:
    r = Run(Flow(parse_playbook(playbook()), loop_batch=8), numbers=20)
    spans = r.spans()
    cid = next(c for c, (index, count) in spans.items() if index == 0)
    t = r.answer(cid, fail=frozenset({1, 2}))
    event = [e for e in t.events if e.event_type == "call.error"]
    assert len(event) == 1 and event[0].meta["count"] == spans[cid][1] and event[0].meta["failed"] == 2
    assert [e["index"] for e in event[0].meta["errors"]] == [1, 2]
    assert [(d.command_id, d.loop_index, d.reason, d.error["message"]) for d in t.dead_letters] == [
        (iteration_command_id(cid, 1), 1, "failed", "boom 1"), (iteration_command_id(cid, 2), 2, "failed", "boom 2")]
    assert [(i, s) for _, i, s, _ in t.loop_results] == [(0, "ok"), (1, "error"), (2, "error")]
    assert [(u.command_id, u.status) for u in t.updates if u.command_id == cid] == [(cid, "failed")]
    r.drain()
    assert r.state.status == "failed"  # no loop.failed arc: the execution fails
    done = r.events("loop.done")
    assert done[0].result["context"] == {"total": 20, "success": 18, "failed": 2}


def test_a_batch_result_missing_iterations_fails_them_with_its_error_and_is_accepted_once() -> None:
    r = Run(Flow(parse_playbook(playbook()), loop_batch=8), numbers=20)
    cid, (index, count) = min(r.spans().items(), key=lambda kv: kv[1][0])
    res = CallResultInput(cid, 1, err("an earlier result is gone"), {}, "w1")
    t = r._keep(r.flow.on_result(r.state, res, r.workload, {}))
    assert [(i, s) for _, i, s, _ in t.loop_results] == [(i, "error") for i in range(index, index + count)]
    assert {d.error["message"] for d in t.dead_letters} == {"an earlier result is gone"}
    again = r._keep(r.flow.on_result(r.state, res, r.workload, {}))
    assert [e.event_type for e in again.events] == ["call.duplicate"] and not again.loop_results


def test_an_expired_batch_is_reissued_whole_then_dead_lettered_and_redriven_whole() -> None:
    r = Run(Flow(parse_playbook(playbook()), loop_batch=8), numbers=20)
    cid, (index, count) = min(r.spans().items(), key=lambda kv: kv[1][0])
    t = r._keep(r.flow.on_expired(r.state, cid, 1, 2, "claim lease expired"))
    assert [(u.command_id, u.attempt) for u in t.updates] == [(cid, 2)] and r.state.pending[cid].count == count
    t = r._keep(r.flow.on_expired(r.state, cid, 2, 2, "claim lease expired"))
    assert r.state.status == "failed"
    dead = t.dead_letters[0]
    assert (dead.command_id, dead.loop_index, dead.reason) == (cid, index, "expired")
    item = RedriveItem(5, dead.command_id, dead.step, dead.reason, dead.loop_instance, dead.loop_index)
    assert refusal(r.state, item) is None
    t = r._keep(r.flow.on_redrive(r.state, [item], 10**13))
    again = t.redrive_outcomes[0][1]
    assert again == f"{cid}~r1" and r.state.status == "running"
    assert (r.state.pending[again].index, r.state.pending[again].count) == (index, count)
    assert t.commands[0].context["loop"]["count"] == count
    r.drain()
    assert list(r.state.pending) == ["7:end:1"]
    assert r.events("loop.done")[0].result["context"] == {"total": 20, "success": 20, "failed": 0}


def test_a_failed_iteration_of_a_batch_is_redriven_alone() -> None:
    flow = Flow(parse_playbook(playbook(arcs="[{step: end, when: \"{{ event.name == 'loop.failed' }}\"}]")),
                loop_batch=8)
    r = Run(flow, numbers=20)
    cid = next(c for c, (index, _) in r.spans().items() if index == 0)
    t = r.answer(cid, fail=frozenset({2}))
    dead = t.dead_letters[0]
    item = RedriveItem(9, dead.command_id, dead.step, dead.reason, dead.loop_instance, dead.loop_index)
    t = r._keep(r.flow.on_redrive(r.state, [item], 10**13))  # the loop still runs: the iteration runs again
    single = t.redrive_outcomes[0][1]
    assert single == f"{iteration_command_id(cid, 2)}~r1" and loop_span(single) is None
    assert (r.state.pending[single].index, r.state.pending[single].count) == (2, 1)
    assert t.loop_results_cleared == [("each:1", 2)]
    r.drain(most=5)  # a redriven iteration runs beside the loop's own
    assert r.events("loop.done")[-1].result["context"] == {"total": 20, "success": 20, "failed": 0}


def test_iterations_a_batch_did_not_get_to_go_back_to_the_loop_and_run_once() -> None:
    """The worker stops a batch when its time budget runs out (runner.execute_command): its
    result answers for the iterations it ran; the rest are dispatched again."""
    r = Run(Flow(parse_playbook(playbook()), loop_batch=8), numbers=40)
    seen: list[int] = []
    while spans := r.spans():
        cid = min(spans, key=lambda c: spans[c][0])
        index, count = spans[cid]
        ran = 1 if count > 1 else count  # slow iterations: one per batch before the budget runs out
        outcomes = [IterationOutcome(i, ok(1000 + i)) for i in range(index, index + ran)]
        t = r.answer(cid, outcomes)
        seen.extend(range(index, index + ran))
        event = next(e for e in t.events if e.step == "each" and e.event_type == "call.done")
        if count > 1:
            assert event.meta["count"] == 1 and event.meta["returned"] == count - 1
    assert sorted(seen) == list(range(40))  # each iteration ran (was answered for) exactly once
    results = sorted(i for t in r.log for _, i, _, _ in t.loop_results)
    assert results == list(range(40))
    assert [e.result["context"] for e in r.events("loop.done")] == [{"total": 40, "success": 40, "failed": 0}]
    assert list(r.state.pending) == ["7:end:1"]
