"""Rerun from the failed step (docs/ARCHITECTURE.md "Rerun"), pure: what Temporal calls a
reset, Argo a retry, DBOS a fork.

A rerun is a NEW execution (its own snowflake id and shard) linked to its original
(``rerun_of``), on the original's catalog version and payload. Its first transition is not
``Flow.start`` but ``Flow.rerun``, which seeds its state from the original's terminal engine
state (``noetl.engine_state``, durable; nothing is read from memory):

* **rerun steps** (``plan``): the step named by the caller (``from_step``), else the step
  whose failure failed the original (``ExecState.failed_step``) plus the steps the failure
  cancelled while they ran. They are entered again.
* **kept steps**: every step the original finished (done, or failed and routed by an
  error arc) that is neither a rerun step nor downstream of one (reachable from one and
  unable to reach back: steps on a cycle through a rerun step keep their last result, as
  the rerun step saw them). Their accepted result envelopes are copied: references, the
  payloads stay where the original stored them. A ``step.kept`` event per kept step puts
  them in the new execution's read model.
* ``ctx`` (what ``set`` and policies wrote) as the original left it; fan-in steps the
  original left armed stay armed (a ``from_step`` rerun drops them: what armed them may be
  discarded).
* **loops**: a rerun loop step (not named by ``from_step``, not a cursor loop) that the
  original entered keeps the original's successful iterations: its collection is the
  original's (copied, never re-rendered), their results are copied by reference into the
  new instance, and only the failed and never-run iterations are dispatched
  (``LoopRun.todo``). A loop named by ``from_step`` reruns whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from noetl_dsl import reachable_from

from . import loops
from .state import COMPLETED, STEP_CANCELLED, STEP_DONE, STEP_FAILED, ExecState, LoopRun

if TYPE_CHECKING:
    from .router import Flow

# ``event.name`` where a rerun step is entered again

# RerunRefused.reason values
RUNNING = "running"
UNKNOWN_STEP = "unknown_step"
NOT_REACHED = "not_reached"
NOTHING_FAILED = "nothing_failed"


class RerunRefused(Exception):
    """The original cannot be rerun as asked; ``reason`` says why (for the status code),
    the message names it for the caller."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class RerunPlan:
    """What a rerun of ``original`` does (a function of the original's terminal state)."""

    rerun_of: int
    steps: tuple[str, ...]  # entered again, in playbook order
    kept: tuple[str, ...]  # results kept by reference, in playbook order
    explicit: bool  # the caller named the step (from_step)
    # rerun loop steps that keep their original's successful iterations: step -> its LoopRun
    resume: dict[str, LoopRun] = field(default_factory=dict)
    armed: tuple[str, ...] = ()


def plan(flow: Flow, original: ExecState, from_step: str = "") -> RerunPlan:
    """The rerun of ``original`` from ``from_step`` (or from where it failed); RerunRefused
    when it cannot be."""
    eid = original.execution_id
    if not original.terminal:
        raise RerunRefused(RUNNING, f"execution {eid} is still {original.status}: a rerun starts from a"
                                    " finished execution (wait for it to end, or cancel it first)")
    order = {name: i for i, name in enumerate(flow.step_names)}
    if from_step:
        if from_step not in order:
            raise RerunRefused(UNKNOWN_STEP, f"step {from_step!r} is not a step of the playbook of execution {eid}"
                                             f" (its steps: {', '.join(flow.step_names)})")
        run = original.steps.get(from_step)
        if run is None or run.visits == 0:
            raise RerunRefused(NOT_REACHED, f"step {from_step!r} was never reached by execution {eid}: a rerun"
                                            " starts from a step the original entered")
        steps = [from_step]
    else:
        if original.status == COMPLETED:
            raise RerunRefused(NOTHING_FAILED, f"execution {eid} completed: nothing failed to rerun from (name"
                                               " the step to rerun from: from_step / --from)")
        chosen = {name for name, run in original.steps.items() if run.status == STEP_CANCELLED}
        if original.failed_step:
            chosen.add(original.failed_step)
        steps = sorted((s for s in chosen if s in order), key=order.__getitem__)
        if not steps:
            raise RerunRefused(NOTHING_FAILED, f"execution {eid} ended {original.status} without a failed or"
                                               f" interrupted step to rerun from ({original.error or 'no error'});"
                                               " name the step to rerun from (from_step / --from)")
    discarded = set(steps) | downstream(flow, steps)
    kept = tuple(sorted((name for name, run in original.steps.items()
                         if name in order and name not in discarded and run.status in (STEP_DONE, STEP_FAILED)
                         and run.visits > 0), key=order.__getitem__))
    resume: dict[str, LoopRun] = {}
    if not from_step:
        for name in steps:
            run = original.steps.get(name)
            if run is not None and run.loop is not None and run.loop.mode != loops.CURSOR_KIND \
                    and flow.pb.step(name).loop is not None and not loops.is_cursor(flow.pb.step(name)):
                resume[name] = run.loop
    armed = () if from_step else tuple(a for a in original.armed if a in order and a not in steps)
    return RerunPlan(eid, tuple(steps), kept, bool(from_step), resume, armed)


def downstream(flow: Flow, steps: list[str]) -> set[str]:
    """Steps reachable from ``steps`` that cannot reach back to any of them (what follows
    them, off any cycle through them)."""
    reachable: set[str] = set()
    for name in steps:
        reachable |= reachable_from(flow.pb, name)
    return {s for s in reachable if s not in steps and not any(flow.reach.any_reaches([s], r) for r in steps)}


def needs(flow: Flow, original: ExecState, p: RerunPlan, todo: dict[str, list[list[int]]]
          ) -> dict[str, dict[str, Any] | None]:
    """Results the engine resolves before ``Flow.rerun`` (the templates it renders at once):
    what a loop entered afresh renders its collection from, and the routing templates of a
    resumed loop with nothing left to run (it finishes at once; its value is the
    original's, every iteration of which succeeded). {step: reference}, read from the
    original's kept results."""
    names: set[str] = set()
    own: set[str] = set()
    for name in p.steps:
        step = flow.pb.step(name)
        if name in p.resume:
            if not todo.get(name):
                names |= flow.route_names(name)
                own.add(name)
        elif step.loop is not None:
            names |= loops.template_names(step)
    out: dict[str, dict[str, Any] | None] = {}
    for name in names:
        run = original.steps.get(name)
        if run is None or run.result is None or (name not in p.kept and name not in own):
            continue
        out[name] = run.result.get("reference")
    return out


def todo_ranges(total: int, ok: list[tuple[int, int]]) -> list[list[int]]:
    """The [start, end) ranges of ``range(total)`` outside the ``ok`` ranges (the original's
    successful iterations, as [start, end) ranges), for ``LoopRun.todo``: the next LAST."""
    ranges: list[list[int]] = []
    nxt = 0
    for start, end in sorted(ok):
        start, end = max(start, 0), min(end, total)
        if start > nxt:
            ranges.append([nxt, start])
        nxt = max(nxt, end)
    if nxt < total:
        ranges.append([nxt, total])
    ranges.reverse()
    return ranges
