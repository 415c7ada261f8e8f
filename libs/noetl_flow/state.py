"""The engine's compact, JSON-serialisable routing state for one execution.

Persisted in ``noetl.engine_state.state`` on every batch that touches the execution;
never holds payloads, only references and small scalars (``context``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from noetl_common.vocab import ENGINE_TERMINAL, EngineStatus, StepStatus

RUNNING = EngineStatus.RUNNING
COMPLETED = EngineStatus.COMPLETED
FAILED = EngineStatus.FAILED
CANCELLED = EngineStatus.CANCELLED
TERMINAL = ENGINE_TERMINAL

STEP_RUNNING = StepStatus.RUNNING
STEP_DONE = StepStatus.DONE
STEP_FAILED = StepStatus.FAILED
STEP_CANCELLED = StepStatus.CANCELLED


@dataclass
class LoopRun:
    """One entry into a loop step (a loop instance). O(in-flight): iteration results live
    in ``noetl.loop_result``, items in ``noetl.loop_item``; only counters are kept here.
    ``in_flight`` counts commands: a batch of iterations (loops.py) is one."""

    instance: str
    mode: str  # sequential | parallel | cursor
    iterator: str
    total: int  # collection size, or cursor slots
    max_in_flight: int
    next_index: int = 0
    in_flight: int = 0
    done: int = 0
    failed: int = 0
    # cursor loops: rows processed by all slots, and the rendered cursor spec
    rows: int = 0
    rows_failed: int = 0
    cursor: dict[str, Any] | None = None
    # A rerun's loop (rerun.py) dispatches only the iterations its original did not finish
    # successfully: [start, end) index ranges, the next one LAST (popped from the end).
    # O(failed ranges), not O(items); None for every other loop.
    todo: list[list[int]] | None = None
    # Wall ms per iteration its batches have taken (loops.observe_pace); None until the
    # first batch's result. Sizes batches (loops.batch_size), nothing else.
    iteration_ms: float | None = None

    @property
    def exhausted(self) -> bool:
        """Every iteration was dispatched."""
        return self.next_index >= self.total and not self.todo

    @property
    def finished(self) -> bool:
        return self.in_flight == 0 and self.exhausted

    def take(self, most: int = 1) -> tuple[int, int]:
        """The next iterations to dispatch, (first index, count): up to ``most`` consecutive
        indexes (call only when not ``exhausted``). Ranges given back (``todo``) go first:
        they are older than ``next_index``, and a sequential loop runs in index order."""
        if self.next_index < self.total and not self.todo:
            index = self.next_index
            count = min(most, self.total - index)
            self.next_index += count
            return index, count
        assert self.todo
        start, end = self.todo[-1]
        count = min(most, end - start)
        if start + count >= end:
            self.todo.pop()
        else:
            self.todo[-1] = [start + count, end]
        return start, count

    @property
    def undispatched(self) -> int:
        """Iterations not dispatched yet."""
        return max(0, self.total - self.next_index) + sum(end - start for start, end in self.todo or ())

    def stats(self) -> dict[str, int]:
        if self.mode == "cursor":
            return {"total": self.rows, "success": self.rows - self.rows_failed, "failed": self.rows_failed}
        return {"total": self.total, "success": self.done, "failed": self.failed}


@dataclass
class StepRun:
    status: str = STEP_RUNNING
    visits: int = 0
    command_id: str = ""
    attempt: int = 1
    # Envelope of the accepted result: {status, reference, parent_ref, context[, error]}.
    result: dict[str, Any] | None = None
    error: str | None = None
    loop: LoopRun | None = None


@dataclass
class Pending:
    step: str
    attempt: int = 1
    # Loop iteration index (collection loops) or slot (cursor loops); None for plain steps.
    index: int | None = None
    # Iterations the command runs: ``index`` .. ``index + count - 1`` (a batch, loops.py).
    count: int = 1


@dataclass
class ExecState:
    execution_id: int
    shard_id: int
    catalog_id: int
    status: str = RUNNING
    ctx: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, StepRun] = field(default_factory=dict)
    # In-flight commands: command_id -> Pending.
    pending: dict[str, Pending] = field(default_factory=dict)
    # Fan-in steps whose arc fired but which wait for other branches.
    armed: list[str] = field(default_factory=list)
    deadline_ms: int | None = None
    error: str | None = None
    parent_execution_id: int = 0
    # The step whose failure failed the execution (None: not a step's, e.g. a timeout).
    failed_step: str | None = None
    # The execution this one reruns (rerun.py); 0 for a submitted one.
    rerun_of: int = 0
    # What a failure caused by a command stopped, so a redrive can resume it (``redrive.py``):
    # {"step", "command_id", "instance", "pending": {command_id: Pending fields}, "armed"}.
    # None while running, and for failures no command caused (timeout, template, abort).
    suspended: dict[str, Any] | None = None
    # Redrives applied so far: events that are exactly-once per execution (its terminal
    # event, a loop's loop.done) carry it as meta.redrive once it is not 0.
    redrives: int = 0

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_json(self) -> dict[str, Any]:
        """The JSON form (a hand-written ``asdict``: it runs once per touched execution per
        engine batch). Result envelopes are shared, not copied: serialise before mutating."""
        out = dict(self.__dict__)
        out["steps"] = {name: {**run.__dict__, "loop": dict(run.loop.__dict__) if run.loop else None}
                        for name, run in self.steps.items()}
        out["pending"] = {cid: dict(p.__dict__) for cid, p in self.pending.items()}
        out["armed"] = list(self.armed)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExecState:
        data = dict(data)
        steps = {}
        for k, v in data.pop("steps", {}).items():
            v = dict(v)
            loop = v.pop("loop", None)
            steps[k] = StepRun(loop=LoopRun(**loop) if loop else None, **v)
        pending = {k: Pending(**v) for k, v in data.pop("pending", {}).items()}
        return cls(steps=steps, pending=pending, **data)

    def active_steps(self) -> set[str]:
        return {p.step for p in self.pending.values()}
