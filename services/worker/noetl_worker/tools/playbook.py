"""The playbook tool: run another catalog playbook as one task (a sub-playbook).

    task: {kind: playbook, path, version?, input?, return_step?}

    SubmitExecution(ref=(path, version), payload=input, parent_execution_id,
                    idempotency_key=CallInfo.key)   -> the child's execution id; the key is
                    the same on every attempt of the command, so a re-issued command
                    re-attaches to the child instead of starting another one (without a
                    CallInfo: a fresh key per run). Repeated on a transient failure or an
                    overloaded api (``retry.retry_keyed``: only because it has a key)
    WatchExecution(child) until terminal            (polling GetExecution, with capped
                    backoff, whenever the stream fails or ends early)
    COMPLETED          -> ok: the value of the chosen step (GetExecution(include_results))
    FAILED / CANCELLED -> error PLAYBOOK_FAILED naming the child execution and its error

Which step's result is the task's value: ``return_step`` when given (an error when that
step did not complete in the child); otherwise the step named ``end`` when it completed
with a value, else the step that completed last (by ``ended_at``) with a value, else None.

Every call goes through a ``grpcclient.translating`` stub: failures are the project's
errors (NotFound, InvalidInput, Unavailable, Unimplemented, ...), never ``grpc.RpcError``.

Timeout: the task timeout bounds submit + follow; when it passes, the child is cancelled
and the task fails with TIMEOUT. Stop: when the api cancelled this command
(``CallInfo.cancelled``: a lease renewal answering "cancelled", or the cancel hint), the
child is cancelled too. A worker that merely lost its lease or is shutting down leaves
the child alone: the command's next attempt re-attaches to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from google.protobuf import struct_pb2

from noetl_client import values
from noetl_common import grpcclient
from noetl_common.errors import InvalidInput, NoetlError, NotFound, Overloaded, ToolError, Unimplemented
from noetl_common.retry import is_transient, retry_keyed
from noetl_proto.v1 import common_pb2, execution_pb2, execution_pb2_grpc
from noetl_store import json_default

from .call import CallInfo
from .outcome import INVALID_TASK, PLAYBOOK_FAILED, TIMEOUT, TOOL_ERROR, ErrorDetail, ToolOutcome

logger = logging.getLogger(__name__)

END_STEP = "end"
RPC_TIMEOUT_SEC = 10.0
SUBMIT_ATTEMPTS = 6
POLL_SEC = 0.5
POLL_CAP_SEC = 5.0
CANCEL_WAIT_SEC = 5.0
COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})


def _submit_again(exc: BaseException) -> bool:
    """A keyed submission worth repeating: a transient failure (``retry.is_transient``),
    or the api's backpressure (Overloaded: RESOURCE_EXHAUSTED, "retry later")."""
    return is_transient(exc) or isinstance(exc, Overloaded)


def _parent_claim(call: CallInfo | None) -> execution_pb2.ParentClaim | None:
    """The claim a sub-playbook's submission (or cancellation) runs under: a worker token
    may act only on children of a command it holds."""
    if call is None or not call.claim_token:
        return None
    return execution_pb2.ParentClaim(command_id=call.command_id, attempt=call.attempt, worker_id=call.worker_id,
                                     claim_token=call.claim_token)


def _status_name(status: common_pb2.ExecutionStatus.ValueType) -> str:
    return common_pb2.ExecutionStatus.Name(status).removeprefix("EXECUTION_STATUS_")


def pick_result(execution: execution_pb2.Execution, return_step: str | None) -> Any:
    """The child's value (see the module docstring); ToolError when ``return_step`` did
    not complete or a result is not JSON."""
    steps = list(execution.steps)
    done = common_pb2.STEP_STATUS_COMPLETED
    if return_step:
        step = next((s for s in steps if s.name == return_step), None)
        if step is None or step.status != done:
            state = "did not run" if step is None else common_pb2.StepStatus.Name(step.status).removeprefix(
                "STEP_STATUS_").lower()
            raise ToolError(f"return_step {return_step!r} of child execution {execution.execution_id} "
                            f"({execution.playbook_path}) did not complete ({state})", code=INVALID_TASK,
                            kind="ValueError")
        chosen: execution_pb2.StepState | None = step
    else:
        with_value = [s for s in steps if s.status == done and s.HasField("result")]
        chosen = next((s for s in with_value if s.name == END_STEP), None)
        if chosen is None and with_value:
            # Steps are listed by start time; of steps ending in the same instant, the later-listed wins.
            chosen = max(reversed(with_value), key=lambda s: (s.ended_at.seconds, s.ended_at.nanos))
    if chosen is None or not chosen.HasField("result"):
        return None
    return values.from_value(chosen.result)


class PlaybookTool:
    """Runs sub-playbooks through the api's ExecutionService."""

    def __init__(self, api: execution_pb2_grpc.ExecutionServiceStub, *, poll_sec: float = POLL_SEC,
                 poll_cap_sec: float = POLL_CAP_SEC, rpc_timeout_sec: float = RPC_TIMEOUT_SEC,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.api = grpcclient.translating(api)
        self.poll_sec = poll_sec
        self.poll_cap_sec = poll_cap_sec
        self.rpc_timeout = rpc_timeout_sec
        self._sleep = sleep
        self._background: set[asyncio.Task[None]] = set()

    async def run(self, fields: Mapping[str, Any], inputs: Mapping[str, Any], *, call: CallInfo | None,
                  timeout_sec: float | None = None) -> ToolOutcome:
        """Run the sub-playbook ``fields`` (rendered path / version / return_step) with
        ``inputs`` as its payload. Never raises for failures; cancellation propagates."""
        path = fields.get("path")
        if not isinstance(path, str) or not path.strip():
            return ToolOutcome.failure(INVALID_TASK, "playbook task needs `path` (the sub-playbook's catalog path)",
                                       kind="ValueError")
        path = path.strip()
        try:
            version = int(fields.get("version") or 0)
        except (TypeError, ValueError):
            return ToolOutcome.failure(INVALID_TASK, f"playbook task `version` must be an integer, got "
                                       f"{fields.get('version')!r}", kind="ValueError")
        return_step = fields.get("return_step")
        return_step = str(return_step) if return_step not in (None, "") else None
        try:
            payload = values.to_struct(dict(inputs), default=json_default)
        except (TypeError, ValueError) as exc:
            return ToolOutcome.failure(INVALID_TASK, f"playbook task input cannot be the child's payload: {exc}",
                                       kind="ValueError")
        child = 0
        try:
            async with asyncio.timeout(timeout_sec or None):
                child = await self._submit(path, version, payload, call, timeout_sec)
                try:
                    execution = await self._follow(child)
                    if execution.status == COMPLETED:
                        execution = await self._results(child)
                except asyncio.CancelledError:
                    if call is not None and call.is_cancelled:
                        await self._cancel_detached(child, f"parent command {call.command_id} was cancelled", call)
                    raise
        except TimeoutError:
            if child:
                await self._cancel_child(child, "the parent task timed out", call)
            what = f" (child execution {child})" if child else ""
            return ToolOutcome.failure(TIMEOUT, f"sub-playbook {path!r}{what} did not finish within "
                                       f"{timeout_sec or 0:g} s", kind="TimeoutError", retryable=True)
        except ToolError as exc:
            return ToolOutcome("error", None, ErrorDetail.from_exception(exc))
        if execution.status != COMPLETED:
            status = _status_name(execution.status)
            return ToolOutcome.failure(
                PLAYBOOK_FAILED, f"sub-playbook {path!r} (child execution {child}) {status.lower()}: "
                f"{execution.error or 'no error message'}", kind="PlaybookFailed",
                details={"child_execution_id": child, "status": status, "path": path})
        try:
            return ToolOutcome.success(pick_result(execution, return_step))
        except ToolError as exc:
            return ToolOutcome("error", None, ErrorDetail.from_exception(exc))

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=CANCEL_WAIT_SEC)

    # ------------------------------------------------------------ calls

    async def _submit(self, path: str, version: int, payload: struct_pb2.Struct, call: CallInfo | None,
                      timeout_sec: float | None) -> int:
        # The child cannot usefully outlive the task that waits for it: same timeout.
        request = execution_pb2.SubmitExecutionRequest(
            ref=execution_pb2.PlaybookRef(path=path, version=version), payload=payload,
            idempotency_key=call.key if call is not None else f"playbook-tool-{uuid.uuid4()}",
            parent_execution_id=call.execution_id if call is not None else 0,
            timeout_seconds=timeout_sec or 0.0, parent_claim=_parent_claim(call))
        try:
            response = await retry_keyed(
                f"submitting sub-playbook {path!r}", request,
                lambda: self.api.SubmitExecution(request, timeout=self.rpc_timeout),
                attempts=SUBMIT_ATTEMPTS, initial=self.poll_sec, cap=self.poll_cap_sec, transient=_submit_again)
        except (NotFound, InvalidInput) as exc:
            raise ToolError(f"sub-playbook {path!r} was rejected: {exc}", code=INVALID_TASK,
                            kind=type(exc).__name__) from exc
        except NoetlError as exc:
            raise ToolError(f"cannot submit sub-playbook {path!r}: {exc}", code=TOOL_ERROR,
                            kind=type(exc).__name__, retryable=True) from exc
        logger.info("sub-playbook %s is execution %s%s", path, response.execution_id,
                    " (re-attached)" if response.deduplicated else "")
        return int(response.execution_id)

    async def _follow(self, child: int) -> execution_pb2.Execution:
        """Wait for the child to reach a terminal state: the watch stream, polling
        GetExecution whenever the stream fails or ends early."""
        delay = self.poll_sec
        watch = True
        while True:
            if watch:
                execution, watch = await self._watch(child)
                if execution is not None:
                    return execution
            execution = await self._get(child, include_results=False)
            if execution is not None and execution.status in TERMINAL:
                return execution
            await self._sleep(delay)
            delay = min(delay * 2, self.poll_cap_sec)

    async def _watch(self, child: int) -> tuple[execution_pb2.Execution | None, bool]:
        """(terminal execution or None, whether watching is worth trying again)."""
        stream = self.api.WatchExecution(execution_pb2.WatchExecutionRequest(execution_id=child))
        try:
            async for response in stream:
                if response.execution.status in TERMINAL:
                    return response.execution, True
        except NotFound as exc:
            raise ToolError(f"child execution {child} not found: {exc}", code=TOOL_ERROR) from exc
        except NoetlError as exc:
            logger.debug("watching child execution %s failed (%s: %s); polling", child, type(exc).__name__, exc)
            return None, not isinstance(exc, Unimplemented)
        finally:
            stream.cancel()
        return None, True

    async def _get(self, child: int, *, include_results: bool) -> execution_pb2.Execution | None:
        try:
            response = await self.api.GetExecution(
                execution_pb2.GetExecutionRequest(execution_id=child, include_results=include_results),
                timeout=self.rpc_timeout)
        except NotFound as exc:
            raise ToolError(f"child execution {child} not found: {exc}", code=TOOL_ERROR) from exc
        except NoetlError as exc:
            logger.warning("reading child execution %s failed (%s: %s)", child, type(exc).__name__, exc)
            return None
        return response.execution

    async def _results(self, child: int) -> execution_pb2.Execution:
        delay = self.poll_sec
        while True:
            execution = await self._get(child, include_results=True)
            if execution is not None:
                return execution
            await self._sleep(delay)
            delay = min(delay * 2, self.poll_cap_sec)

    async def _cancel_child(self, child: int, reason: str, call: CallInfo | None = None) -> None:
        try:
            response = await self.api.CancelExecution(
                execution_pb2.CancelExecutionRequest(execution_id=child, reason=reason,
                                                     parent_claim=_parent_claim(call)), timeout=self.rpc_timeout)
            logger.info("cancelled child execution %s (%s): accepted=%s", child, reason, response.accepted)
        except NoetlError as exc:
            logger.warning("cancelling child execution %s failed (%s): %s", child, type(exc).__name__, exc)

    async def _cancel_detached(self, child: int, reason: str, call: CallInfo | None = None) -> None:
        """Cancel the child from a task that is itself being cancelled: the call runs in
        its own task (waited for a few seconds) so a second cancel cannot cut it short."""
        task = asyncio.ensure_future(self._cancel_child(child, reason, call))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), CANCEL_WAIT_SEC)
