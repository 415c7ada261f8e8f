"""Reading and building the execution messages: the terminal statuses, a step's result as
a Python value, and the ``SubmitExecutionRequest`` of a playbook and payload."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from noetl_proto.v1 import common_pb2, execution_pb2

from . import values

TERMINAL = frozenset({common_pb2.EXECUTION_STATUS_COMPLETED, common_pb2.EXECUTION_STATUS_FAILED,
                      common_pb2.EXECUTION_STATUS_CANCELLED})
PRIORITIES = ("high", "normal", "low")


def status_name(status: int) -> str:
    """An execution's status by name: ``EXECUTION_STATUS_COMPLETED`` -> ``"COMPLETED"``."""
    return common_pb2.ExecutionStatus.Name(status).removeprefix("EXECUTION_STATUS_")  # type: ignore[arg-type]


def is_terminal(execution: execution_pb2.Execution) -> bool:
    return execution.status in TERMINAL


def step_result(step: execution_pb2.StepState) -> Any:
    """The step's result as a Python value (None when it has none; asked for with
    ``include_results``)."""
    return values.from_value(step.result) if step.HasField("result") else None


def results(execution: execution_pb2.Execution) -> dict[str, Any]:
    """{step name: result} of every step that has a result."""
    return {s.name: values.from_value(s.result) for s in execution.steps if s.HasField("result")}


def submit_request(playbook_yaml: str | None = None, *, path: str | None = None, version: int = 0,
                   payload: Mapping[str, Any] | None = None, idempotency_key: str | None = None,
                   timeout_seconds: float = 0.0, priority: str | None = None) -> execution_pb2.SubmitExecutionRequest:
    """The request submitting a playbook's text, or a registered one by catalog ``path``
    (``version`` 0: the latest), with ``payload`` merged over its workload. Without an
    ``idempotency_key`` a fresh one is made, so a retried submission never makes two
    executions. ``priority``: "high", "normal", "low" or None (the playbook's)."""
    import uuid  # here: a program that only reads executions does not load it

    if (playbook_yaml is None) == (path is None):
        raise ValueError("give the playbook's YAML or its catalog path (one of them)")
    if priority is not None and priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    request = execution_pb2.SubmitExecutionRequest(
        idempotency_key=idempotency_key or f"client-{uuid.uuid4()}", timeout_seconds=timeout_seconds,
        priority=execution_pb2.Priority.Value(f"PRIORITY_{(priority or 'unspecified').upper()}"))
    if payload is not None:
        request.payload.CopyFrom(values.to_struct(payload))
    if path is not None:
        request.ref.CopyFrom(execution_pb2.PlaybookRef(path=path, version=version))
    else:
        request.playbook_yaml = playbook_yaml or ""
    return request


__all__ = ["PRIORITIES", "TERMINAL", "is_terminal", "results", "status_name", "step_result", "submit_request"]
