"""Inputs and outputs of the pure routing functions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .state import ExecState, StepRun


@dataclass(frozen=True)
class StartInput:
    execution_id: int
    shard_id: int
    catalog_id: int
    deadline_ms: int | None = None
    parent_execution_id: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class IterationOutcome:
    """One iteration's result within a batch command's result (loops.batch_size)."""

    index: int
    envelope: dict[str, Any]
    set_updates: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallResultInput:
    command_id: str
    attempt: int
    envelope: dict[str, Any]
    set_updates: dict[str, Any] = field(default_factory=dict)
    worker_id: str = ""
    # A batch of loop iterations: each one's outcome (``envelope`` then summarises them).
    iterations: tuple[IterationOutcome, ...] = ()


@dataclass
class NewEvent:
    event_type: str
    step: str | None = None
    command_id: str | None = None
    result: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class NewCommand:
    command_id: str
    step: str
    kind: str
    attempt: int
    context: dict[str, Any]
    timeout_sec: float = 0.0


@dataclass
class CommandUpdate:
    command_id: str
    status: str  # queued | done | failed | cancelled | dead
    attempt: int | None = None  # set when a re-issue bumps the attempt


@dataclass
class DeadLetter:
    """A command that exhausted its attempts: the engine records it (``noetl.dead_letter``)
    in the batch that accepts the failure."""

    command_id: str
    step: str
    attempts: int
    reason: str  # failed (its accepted result is call.error) | expired (claim leases ran out)
    error: dict[str, Any]
    worker_id: str = ""  # empty: the command row's (the worker that last claimed it)
    loop_instance: str | None = None
    loop_index: int | None = None


@dataclass
class Transition:
    state: ExecState
    events: list[NewEvent] = field(default_factory=list)
    commands: list[NewCommand] = field(default_factory=list)
    updates: list[CommandUpdate] = field(default_factory=list)
    # Commands to publish again after commit (re-issued): (command_id, attempt, kind).
    republish: list[tuple[str, int, str]] = field(default_factory=list)
    # Loop bookkeeping the engine writes in the same transaction:
    # collections to store once per loop instance (instance, items),
    loop_items: list[tuple[str, list[Any]]] = field(default_factory=list)
    # accepted iteration results (instance, index, status, ref_id),
    loop_results: list[tuple[str, int, str, int | None]] = field(default_factory=list)
    # loop.done envelopes whose reference needs a result_ref row (the engine fills ref_id).
    loop_refs: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    # a rerun's resumed loops (rerun.py): (original execution, original instance, new
    # instance): the engine copies the original's items and successful iteration results
    # (references) into the new instance, in the same transaction.
    loop_copies: list[tuple[int, str, str]] = field(default_factory=list)
    # failed iteration results a redrive takes back (instance, index): deleted from
    # noetl.loop_result so the re-issued iteration's result takes their place.
    loop_results_cleared: list[tuple[str, int]] = field(default_factory=list)
    # commands that exhausted their attempts (noetl.dead_letter rows).
    dead_letters: list[DeadLetter] = field(default_factory=list)
    # what a redrive input did with each dead letter: (dead_letter_id, new command id, None)
    # or (dead_letter_id, None, the refusal)
    redrive_outcomes: list[tuple[int, str | None, str | None]] = field(default_factory=list)
    # The results of completed steps as the commands of this transition snapshot them
    # (built once, shared until a step's result changes: a fan-out to n steps would
    # otherwise rebuild it n times, quadratic in one routing step).
    steps_snapshot: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def set_result(self, run: StepRun, envelope: dict[str, Any] | None) -> None:
        """Record a step's accepted result (or clear it when the step runs again)."""
        if run.result is not envelope:
            run.result = envelope
            self.steps_snapshot = None

    def emit(self, event_type: str, **kw: Any) -> NewEvent:
        ev = NewEvent(event_type, **kw)
        self.events.append(ev)
        return ev
