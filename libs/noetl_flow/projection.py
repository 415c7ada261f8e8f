"""Folding events into the read models (``noetl.execution``, ``noetl.execution_step``).

Pure and idempotent: an event at or below the view's ``last_shard_seq`` is skipped,
so re-delivering any prefix of the log leaves the views unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from noetl_common.vocab import EventType, ExecutionStatus

PENDING, RUNNING, COMPLETED, FAILED, CANCELLED = (ExecutionStatus.PENDING, ExecutionStatus.RUNNING,
                                                  ExecutionStatus.COMPLETED, ExecutionStatus.FAILED,
                                                  ExecutionStatus.CANCELLED)


@dataclass
class StepView:
    step: str
    status: str = PENDING
    visits: int = 0
    attempts: int = 0
    result_ref_id: int | None = None
    error: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    # a loop step's progress: items (0 = not known up front, a cursor loop; None = not a
    # loop), accepted iteration results, and the failed ones among them
    loop_total: int | None = None
    loop_done: int = 0
    loop_failed: int = 0
    dirty: bool = False


@dataclass
class ExecutionView:
    execution_id: int
    shard_id: int
    status: str = PENDING
    catalog_id: int | None = None
    playbook_path: str | None = None
    playbook_version: int | None = None
    parent_execution_id: int | None = None
    rerun_of: int | None = None
    error: str | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    last_shard_seq: int = 0
    steps: dict[str, StepView] = field(default_factory=dict)

    def step(self, name: str) -> StepView:
        view = self.steps.get(name)
        if view is None:
            view = self.steps[name] = StepView(name)
        view.dirty = True
        return view


def fold(view: ExecutionView, events: Iterable[Mapping[str, Any]]) -> int:
    """Apply events (ordered by shard_seq) to ``view``; returns how many were applied."""
    applied = 0
    for ev in events:
        seq = int(ev["shard_seq"])
        if seq <= view.last_shard_seq:
            continue
        _apply(view, ev)
        view.last_shard_seq = seq
        applied += 1
    return applied


def _apply(view: ExecutionView, ev: Mapping[str, Any]) -> None:
    kind = ev["event_type"]
    at = ev.get("created_at")
    meta = ev.get("meta") or {}
    result = ev.get("result") or {}
    name = ev.get("step")
    if kind == EventType.PLAYBOOK_STARTED:
        view.status = RUNNING
        view.started_at = at
        view.catalog_id = meta.get("catalog_id", view.catalog_id)
        view.playbook_path = meta.get("path", view.playbook_path)
        view.playbook_version = meta.get("version", view.playbook_version)
        view.parent_execution_id = meta.get("parent_execution_id") or view.parent_execution_id
        view.rerun_of = meta.get("rerun_of") or view.rerun_of
        if meta.get("requested_at") and view.created_at is None:
            view.created_at = _ts(meta["requested_at"])
    elif kind == EventType.STEP_ENTER and name:
        s = view.step(name)
        s.status = RUNNING
        s.visits = int(meta.get("visit", s.visits + 1))
        s.attempts = int(meta.get("attempt", 1))
        s.started_at = at
        s.ended_at = None
        s.error = None
        s.result_ref_id = None
        if meta.get("loop_instance") is not None:  # a loop starts: its progress from zero
            s.loop_total = int(meta.get("total") or 0) if meta.get("mode") != "cursor" else 0
            s.loop_done = s.loop_failed = 0
        else:
            s.loop_total = None
    elif kind in (EventType.CALL_DONE, EventType.CALL_ERROR) and name and meta.get("index") is not None:
        # a loop iteration's accepted result (the loop step completes on loop.done)
        s = view.step(name)
        if meta.get("count") is not None:  # a batch of iterations (one event), its failed ones counted
            s.loop_done += int(meta["count"])
            s.loop_failed += int(meta.get("failed") or 0)
        else:
            s.loop_done += 1
            if kind == EventType.CALL_ERROR or result.get("status") == "error":
                s.loop_failed += 1
    elif kind in (EventType.CALL_DONE, EventType.CALL_ERROR, EventType.LOOP_DONE) and name:
        s = view.step(name)
        s.status = FAILED if kind == EventType.CALL_ERROR or result.get("status") == "error" else COMPLETED
        ref = result.get("reference") or {}
        s.result_ref_id = ref.get("ref_id")
        s.error = _message(result) if s.status == FAILED else None
        s.ended_at = at
    elif kind == EventType.STEP_KEPT and name:  # a rerun's step whose original result it keeps
        s = view.step(name)
        s.status = FAILED if meta.get("status") == "failed" else COMPLETED
        s.visits = int(meta.get("visit") or 0)
        s.attempts = 0
        s.result_ref_id = (result.get("reference") or {}).get("ref_id")
        s.error = _message(result) if s.status == FAILED else None
        s.started_at = s.ended_at = at
    elif kind == EventType.COMMAND_REISSUED and name:
        s = view.step(name)
        s.attempts = int(meta.get("attempt", s.attempts + 1))
    elif kind == EventType.COMMAND_DEAD_LETTERED and name:
        s = view.step(name)
        s.status = FAILED
        s.error = _message(result)
        s.ended_at = at
    elif kind == EventType.COMMAND_REDRIVEN and name:
        # a dead letter re-issued: the execution runs again (if it had failed), the step
        # runs its command again, and the steps the failure had cancelled resume
        view.status = RUNNING
        view.error = None
        view.ended_at = None
        s = view.step(name)
        s.status = RUNNING
        s.attempts = 1
        s.error = None
        s.result_ref_id = None
        s.ended_at = None
        if meta.get("taken_back") and s.loop_total is not None:
            # the iteration's failed result no longer counts: its re-run's will
            s.loop_done = max(0, s.loop_done - 1)
            s.loop_failed = max(0, s.loop_failed - 1)
        for other in meta.get("resumed") or ():
            o = view.step(other)
            o.status = RUNNING
            o.ended_at = None
    elif kind in (EventType.PLAYBOOK_COMPLETED, EventType.PLAYBOOK_FAILED, EventType.PLAYBOOK_CANCELLED):
        view.status = {EventType.PLAYBOOK_COMPLETED: COMPLETED, EventType.PLAYBOOK_FAILED: FAILED, EventType.PLAYBOOK_CANCELLED: CANCELLED}[kind]
        view.error = _message(result) if result else None
        view.ended_at = at
        for s in view.steps.values():
            if s.status in (RUNNING, PENDING):
                s.status = CANCELLED
                s.ended_at = at
                s.dirty = True


def _message(result: Mapping[str, Any]) -> str | None:
    """The error text of a read model: the message, prefixed by the exception class when
    the error carries one (a python task's), followed by its traceback when it has one."""
    err = result.get("error") or {}
    if not isinstance(err, Mapping):
        return str(err)
    message = err.get("message")
    exception_type = err.get("exception_type")
    if exception_type and isinstance(message, str) and not message.startswith(f"{exception_type}:"):
        message = f"{exception_type}: {message}"
    traceback = err.get("traceback")
    if traceback and isinstance(message, str):
        message = f"{message}\n{traceback.rstrip()}"
    return message


def _ts(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        return datetime.fromisoformat(value)
    return None
