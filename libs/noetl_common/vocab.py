"""The runtime's words, spelled once: statuses, event types, stop reasons, command ids and
the NATS Msg-Ids of every message JetStream deduplicates.

Everything else imports these; tests/unit/test_vocab.py pins each spelling (they are
stored in Postgres and in JetStream's duplicate window, so a rename is a migration) and
scans the source so that no status or event type is written out anywhere else.
A ``StrEnum`` member is its string (``CommandStatus.QUEUED == "queued"``) and formats as
it inside SQL text.
"""

from __future__ import annotations

import re
from enum import StrEnum

__all__ = [
    "ENGINE_TERMINAL",
    "PUBLIC_TERMINAL",
    "CommandStatus",
    "DeadLetterStatus",
    "EngineStatus",
    "EventType",
    "ExecutionStatus",
    "MemberStatus",
    "ResultStatus",
    "StepStatus",
    "StepViewStatus",
    "StopReason",
    "barrier_msg_id",
    "cancel_msg_id",
    "command_id",
    "execution_of_command",
    "expired_msg_id",
    "iteration_command_id",
    "loop_span",
    "notice_msg_id",
    "redrive_msg_id",
    "republish_msg_id",
    "result_msg_id",
    "submit_msg_id",
]


class ExecutionStatus(StrEnum):
    """An execution's status as the read model and the API have it (``common.ExecutionStatus``)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def proto_name(self) -> str:
        return f"EXECUTION_STATUS_{self.value}"


PUBLIC_TERMINAL = frozenset({ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED})


class EngineStatus(StrEnum):
    """An execution's status in the engine's own state (``noetl.engine_state``)."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def public(self) -> ExecutionStatus:
        return ExecutionStatus(self.value.upper())


ENGINE_TERMINAL = frozenset({EngineStatus.COMPLETED, EngineStatus.FAILED, EngineStatus.CANCELLED})


class StepStatus(StrEnum):
    """A step's status in the engine's state."""

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StepViewStatus(StrEnum):
    """A step's status in the read model and the API (``common.StepStatus``)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    CANCELLED = "CANCELLED"

    @property
    def proto_name(self) -> str:
        return f"STEP_STATUS_{self.value}"


class CommandStatus(StrEnum):
    """``noetl.command.status`` (its CHECK constraint lists the same)."""

    QUEUED = "queued"
    CLAIMED = "claimed"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD = "dead"


class ResultStatus(StrEnum):
    """A result envelope's status, and an iteration's in ``noetl.loop_result``."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


class DeadLetterStatus(StrEnum):
    DEAD = "dead"
    REDRIVEN = "redriven"


class MemberStatus(StrEnum):
    """``noetl.runtime.status``."""

    ALIVE = "alive"
    LEFT = "left"
    DEAD = "dead"


class EventType(StrEnum):
    """``noetl.event.event_type``: every kind of event the engine appends."""

    PLAYBOOK_STARTED = "playbook.started"
    PLAYBOOK_COMPLETED = "playbook.completed"
    PLAYBOOK_FAILED = "playbook.failed"
    PLAYBOOK_CANCELLED = "playbook.cancelled"
    PLAYBOOK_RERUN = "playbook.rerun"
    STEP_ENTER = "step.enter"
    STEP_KEPT = "step.kept"
    CALL_DONE = "call.done"
    CALL_ERROR = "call.error"
    CALL_DUPLICATE = "call.duplicate"
    COMMAND_REISSUED = "command.reissued"
    COMMAND_DEAD_LETTERED = "command.dead_lettered"
    COMMAND_REDRIVEN = "command.redriven"
    LOOP_NEXT = "loop.next"
    LOOP_DONE = "loop.done"
    LOOP_FAILED = "loop.failed"
    CHECKPOINT_COMMITTED = "checkpoint.committed"


class StopReason(StrEnum):
    """Why ``RenewLease`` tells a worker to stop (``RenewLeaseResponse.stop_reason``): a
    cancelled command (the worker also cancels its sub-playbooks), or one it no longer
    holds (any other reason text: the command's state is named)."""

    CANCELLED = "cancelled"
    NOT_FOUND = "command not found"


# ---------------------------------------------------------------- command ids

def command_id(execution_id: int, step: str, visit: int, index: int | None = None, count: int = 1) -> str:
    """A command's id: ``{execution}:{step}:{visit}`` (``:{index}`` for a loop iteration,
    ``:{index}+{count}`` for a batch of ``count`` iterations from ``index`` on).
    Deterministic, so a replayed batch issues the same ids (``ON CONFLICT DO NOTHING``)."""
    base = f"{execution_id}:{step}:{visit}"
    if index is None:
        return base
    return f"{base}:{index}+{count}" if count > 1 else f"{base}:{index}"


_SPAN = re.compile(r":(\d+)\+(\d+)(~r\d+)?$")


def loop_span(command_id: str) -> tuple[int, int] | None:
    """(first index, count) of a command that runs a batch of loop iterations (an id
    ``command_id(..., index, count)`` made, or its redrive ``...~r<n>``); None otherwise."""
    m = _SPAN.search(command_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


def iteration_command_id(batch_command_id: str, index: int) -> str:
    """The id one iteration of a batch answers to (its dead letter's, its stored result's):
    the batch's id with ``:{index}`` in place of ``:{first}+{count}`` (a redrive's suffix kept)."""
    m = _SPAN.search(batch_command_id)
    if m is None:
        return f"{batch_command_id}:{index}"
    return f"{batch_command_id[:m.start()]}:{index}{m.group(3) or ''}"


def execution_of_command(command_id: str) -> int | None:
    """The execution id a command id starts with (None when it does not)."""
    head = command_id.split(":", 1)[0]
    return int(head) if head.isdigit() else None


# ---------------------------------------------------------------- NATS Msg-Ids
# JetStream drops a message whose Msg-Id it saw within its duplicate window: each kind
# of message has its own format, the same for every retry of the same logical message.

def notice_msg_id(command_id: str, attempt: int) -> str:
    """A command's notice (engine)."""
    return f"{command_id}#{attempt}"


def republish_msg_id(command_id: str, attempt: int, window: int) -> str:
    """A queued command's notice republished by the reaper (one per window)."""
    return f"{command_id}#{attempt}#r{window}"


def result_msg_id(command_id: str, attempt: int) -> str:
    """A worker's result of one attempt."""
    return f"{command_id}#{attempt}#result"


def expired_msg_id(command_id: str, attempt: int) -> str:
    """The reaper's notice that an attempt's lease expired."""
    return f"expired#{command_id}#{attempt}"


def submit_msg_id(execution_id: int) -> str:
    return f"submit#{execution_id}"


def cancel_msg_id(execution_id: int) -> str:
    return f"cancel#{execution_id}"


def redrive_msg_id(dead_letter_id: int) -> str:
    return f"redrive#{dead_letter_id}"


def barrier_msg_id(shard: int, epoch: int) -> str:
    return f"barrier#{shard}#{epoch}"
