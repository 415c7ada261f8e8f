"""A loop step's live progress in the read model (``noetl_flow.projection``): counted from
the accepted iteration results, reset when the loop starts again, idempotent on replay."""

from __future__ import annotations

from typing import Any

from noetl_common.vocab import EventType
from noetl_flow.projection import ExecutionView, fold


def ev(seq: int, kind: str, step: str | None = "each", meta: dict[str, Any] | None = None,
       result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"shard_seq": seq, "event_type": kind, "step": step, "meta": meta or {}, "result": result or {}}


def loop_events(total: int, failed: set[int], start: int = 1, visit: int = 1) -> list[dict[str, Any]]:
    out = [ev(start, EventType.STEP_ENTER, meta={"visit": visit, "loop_instance": f"each:{visit}", "mode": "parallel",
                                          "total": total})]
    for i in range(total):
        kind = EventType.CALL_ERROR if i in failed else EventType.CALL_DONE
        out.append(ev(start + 1 + i, kind, meta={"index": i},
                      result={"status": "error" if i in failed else "ok"}))
    return out


def test_iterations_are_counted_as_their_results_are_accepted() -> None:
    view = ExecutionView(execution_id=1, shard_id=0)
    events = loop_events(10, failed={3, 7})
    fold(view, events[:6])
    s = view.steps["each"]
    assert (s.loop_total, s.loop_done, s.loop_failed) == (10, 5, 1)
    fold(view, events)  # a replay of the prefix changes nothing, the rest is counted once
    assert (s.loop_total, s.loop_done, s.loop_failed) == (10, 10, 2)
    fold(view, [ev(20, EventType.LOOP_DONE, result={"status": "error"})])
    assert (s.status, s.loop_done) == ("FAILED", 10)


def test_a_loop_entered_again_counts_from_zero_and_plain_steps_are_not_loops() -> None:
    view = ExecutionView(execution_id=1, shard_id=0)
    fold(view, loop_events(3, failed=set()))
    fold(view, loop_events(5, failed={0}, start=100, visit=2)[:3])
    s = view.steps["each"]
    assert (s.loop_total, s.loop_done, s.loop_failed) == (5, 2, 1)
    fold(view, [ev(200, EventType.STEP_ENTER, step="plain", meta={"visit": 1})])
    assert view.steps["plain"].loop_total is None
    cursor = ExecutionView(execution_id=2, shard_id=0)
    fold(cursor, [ev(1, EventType.STEP_ENTER, meta={"visit": 1, "loop_instance": "each:1", "mode": "cursor", "total": 4})])
    assert cursor.steps["each"].loop_total == 0  # slots, not items: the total is not known up front


def test_a_redriven_iteration_is_counted_once() -> None:
    """A failed iteration redriven (dead letters): its failed result is taken back, so the
    loop's progress counts the re-run's result instead of both."""
    view = ExecutionView(execution_id=1, shard_id=0)
    fold(view, loop_events(4, failed={2}))
    fold(view, [ev(20, EventType.COMMAND_REDRIVEN, meta={"index": 2, "taken_back": True, "redrive": 1})])
    s = view.steps["each"]
    assert (s.loop_done, s.loop_failed) == (3, 0)
    fold(view, [ev(21, EventType.CALL_DONE, meta={"index": 2}, result={"status": "ok"})])
    assert (s.loop_total, s.loop_done, s.loop_failed) == (4, 4, 0)
    # an iteration whose claims expired had no result counted: nothing is taken back
    fold(view, [ev(22, EventType.COMMAND_REDRIVEN, meta={"index": 3, "taken_back": False, "redrive": 2})])
    assert (s.loop_done, s.loop_failed) == (4, 0)
