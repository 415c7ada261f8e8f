"""Redriving dead letters (docs/ARCHITECTURE.md "Dead letters (as built)"), pure.

A dead letter is a command that exhausted its attempts (``DeadLetter`` in a transition;
the engine stores it). Redriving it issues the command once more, under a new command id
(``<id>~r<n>``: the first terminal result per command id is the accepted one, and the
dead one already has its result), with a fresh attempt budget, into the same execution:

* a plain step's command: the step runs again as if entered for the first time (the
  render context is built from the state now) and routes its arcs when it is done;
* a failed loop iteration: the iteration runs again (its failed result is taken out of
  the loop's ordered results); the loop finishes when its last iteration is in, and
  routes once more (``loop.done`` of the new generation).

If the execution failed because of that command (``ExecState.suspended`` names it: the
command, or the loop whose failed iterations failed it), it goes back to running: the
commands the failure cancelled are queued again (attempt + 1) and the fan-in barriers it
cleared are armed again. ``refusal`` says why a dead letter cannot be redriven; the api
asks it before it commits a request, and the engine again when it applies one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from noetl_common.vocab import CommandStatus, EventType, loop_span

from . import loops
from .state import CANCELLED, COMPLETED, FAILED, RUNNING, STEP_RUNNING, ExecState, Pending
from .transitions import CommandUpdate, Transition

if TYPE_CHECKING:
    from .router import Flow

DEAD = "dead"
REDRIVEN = "redriven"
EXPIRED = "expired"
_SUFFIX = re.compile(r"~r\d+$")


@dataclass(frozen=True)
class RedriveItem:
    """A dead letter to redrive, as the engine read it from ``noetl.dead_letter``."""

    dead_letter_id: int
    command_id: str
    step: str
    reason: str  # failed | expired
    loop_instance: str | None = None
    loop_index: int | None = None
    status: str = DEAD
    redrive_command_id: str | None = None


def redrive_command_id(command_id: str, generation: int) -> str:
    """The id of a redriven command: the dead one's, less any earlier redrive suffix, plus
    ``~r<generation>`` (unique per execution: the generation counts its redrives)."""
    return f"{_SUFFIX.sub('', command_id)}~r{generation}"


def refusal(state: ExecState | None, item: RedriveItem) -> str | None:
    """Why ``item`` cannot be redriven now, or None when it can."""
    if item.status != DEAD:
        return (f"dead letter {item.dead_letter_id} was already redriven"
                + (f" (as command {item.redrive_command_id})" if item.redrive_command_id else ""))
    if state is None:
        return "the execution has no engine state (it never started)"
    eid = state.execution_id
    if state.parent_execution_id:
        return (f"execution {eid} is a sub-playbook of execution {state.parent_execution_id}, whose step already"
                " took its failure: redrive the parent's dead letter instead")
    if state.status == CANCELLED:
        return f"execution {eid} was cancelled"
    if state.status == COMPLETED:
        return (f"execution {eid} completed: the playbook handled this failure (a call.error or loop.failed arc)"
                " or the step ran again")
    run = state.steps.get(item.step)
    if run is None:
        return f"step {item.step!r} never ran in execution {eid}"
    suspended = state.suspended or {}
    if item.loop_index is None:
        if run.command_id != item.command_id:
            return f"step {item.step!r} ran again after this failure (its command is now {run.command_id or 'none'})"
        if state.status == FAILED:
            if suspended.get("command_id") != item.command_id:
                return f"execution {eid} failed because of something else: {state.error}"
            return None
        return (f"execution {eid} is running: the playbook handled this failure (a call.error arc) or it was"
                " redriven already")
    lr = run.loop
    if lr is None or lr.instance != item.loop_instance:
        return f"loop {item.loop_instance} of step {item.step!r} is over: the step was entered again since"
    if lr.mode == loops.CURSOR_KIND:
        return f"step {item.step!r} is a cursor loop: its slots cannot be redriven one by one"
    if state.status == FAILED:
        if item.reason == EXPIRED:
            cause_ok = suspended.get("command_id") == item.command_id
        else:
            cause_ok = suspended.get("step") == item.step and suspended.get("instance") == lr.instance
        if not cause_ok:
            return f"execution {eid} failed because of something else: {state.error}"
        return None
    if item.reason != EXPIRED and run.status == STEP_RUNNING:
        return None  # the loop is still running: the iteration runs again before it finishes
    return (f"execution {eid} is running and loop {lr.instance} of step {item.step!r} is over: the playbook"
            " handled its failure (a loop.failed arc)")


def apply(flow: Flow, t: Transition, items: list[RedriveItem], deadline_ms: int | None) -> None:
    """Redrive ``items`` (of one execution) into ``t``; each gets an outcome in
    ``t.redrive_outcomes``: (dead letter id, the new command id, None) or (id, None, why not)."""
    st = t.state
    accepted: list[RedriveItem] = []
    for item in items:
        why = refusal(st, item)
        if why is None and any(a.command_id == item.command_id for a in accepted):
            why = f"dead letter {item.dead_letter_id} is redriven by this request already"
        if why is not None:
            t.redrive_outcomes.append((item.dead_letter_id, None, why))
        else:
            accepted.append(item)
    if not accepted:
        return
    st.redrives += 1
    generation = st.redrives
    resumed: set[str] = set()
    if st.status == FAILED:
        suspended = st.suspended or {}
        st.status = RUNNING
        st.error = None
        st.suspended = None
        if deadline_ms is not None:
            st.deadline_ms = deadline_ms
        for command_id, fields in (suspended.get("pending") or {}).items():
            pending = Pending(**fields)
            pending.attempt += 1
            st.pending[command_id] = pending
            run = st.steps[pending.step]
            run.status = STEP_RUNNING
            t.updates.append(CommandUpdate(command_id, CommandStatus.QUEUED, attempt=pending.attempt))
            t.republish.append((command_id, pending.attempt, loops.command_kind(flow, pending.step, run)))
            resumed.add(pending.step)
        for target in suspended.get("armed") or ():
            if target not in st.armed:
                st.armed.append(target)
    event = {"name": EventType.COMMAND_REDRIVEN, "step": None}
    for item in accepted:
        run = st.steps[item.step]
        command_id = redrive_command_id(item.command_id, generation)
        run.status = STEP_RUNNING
        run.error = None
        t.set_result(run, None)
        kind = loops.command_kind(flow, item.step, run)
        if item.loop_index is None:
            run.attempt = 1
            run.command_id = command_id
            flow.dispatch(t, item.step, command_id, kind, {**event, "step": item.step}, extra=None)
        else:
            lr = run.loop
            assert lr is not None and item.loop_index is not None
            if item.reason != EXPIRED:  # an expired iteration never left the loop's in-flight count
                lr.failed -= 1
                lr.in_flight += 1
                t.loop_results_cleared.append((lr.instance, item.loop_index))
            # an expired batch (loops.batch_size) runs again whole; a failed iteration alone
            span = loop_span(item.command_id) if item.reason == EXPIRED else None
            count = span[1] if span is not None else 1
            flow.dispatch(t, item.step, command_id, kind, {**event, "step": item.step},
                          {"loop": loops.loop_context(lr, item.loop_index, count)},
                          index=item.loop_index, count=count)
        meta: dict[str, object] = {"dead_letter_id": item.dead_letter_id, "redriven_command": item.command_id,
                                   "redrive": generation, "resumed": sorted(resumed)}
        if item.loop_index is not None:
            meta["index"] = item.loop_index
            # its failed result was taken back (an expired iteration never had one)
            meta["taken_back"] = item.reason != EXPIRED
        t.emit(EventType.COMMAND_REDRIVEN, step=item.step, command_id=command_id, meta=meta)
        t.redrive_outcomes.append((item.dead_letter_id, command_id, None))
