"""One slot of a cursor loop (seed 003; ARCHITECTURE.md section 8).

The engine renders ``loop.cursor`` once and dispatches ``max_in_flight`` commands of kind
``cursor``; each one runs here, on one worker, until the cursor is drained:

    resume row? --yes--> run the task chain for it (the row a dead attempt had claimed)
        |
        v
    claim:  BEGIN; <claim SQL> -> row | none
            none -> COMMIT; the slot is done
            row  -> report it to the api (RenewLease progress {"row": row, "counts": counts
                    before the row}), THEN COMMIT
    run the task chain for the row with iter = {<iterator>: row, "_index": n}
    count it (processed; succeeded or failed), claim again

Reporting before the commit is what makes a killed worker harmless without any
stale-claim clause in the user's SQL: the api keeps the row in ``noetl.command.progress``
and hands it back as ``resume`` (with ``resume_counts``) to the slot's next attempt,
which takes the counts over and runs the row first: the slot's counts cover every row
its attempts claimed, not just the last attempt's. If the report cannot be made the
claim is rolled back (the row stays unclaimed) and retried with capped backoff; if the
api says stop, the task is cancelled and the claim rolls back. A row may therefore run
twice (the previous attempt may have finished it before dying, or died after reporting
it but before its claim committed, leaving it to another slot too): sinks should be
idempotent, as for every at-least-once task.

A row whose task chain fails counts as failed and the slot moves on; a claim that fails
(SQL error, a claim returning several rows, an unknown driver) fails the slot with that
error. Per-row results are not stored (a cursor may process millions of rows): the slot's
value ``{"processed", "succeeded", "failed"}`` over all of its attempts (plus
``last_error`` when a row of this attempt failed) is stored once, persist-before-emit,
and its envelope context carries those scalars, which the engine adds up into
``loop.done``. ``ctx`` updates made by rows' policies are merged
(later rows win) and reported once; ``iter`` updates stay with their row.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from noetl_common.errors import ToolError, Unavailable
from noetl_dsl.templates import RenderContext
from noetl_proto.v1 import messages_pb2
from noetl_store import ResultStore, encode_json, envelope

from .cursor_drivers import CursorDriver, CursorError, CursorSpec, Row
from .metrics import CURSOR_ROWS
from .pipeline import TaskRun, run_pipeline
from .runner import (
    StoreFailure,
    TaskCaller,
    build_call_result,
    error_result,
    log_task_run,
    persist_result,
    prepare,
)
from .secrecy import scrub_call_result
from .tools import CommandSecrets, Tools
from .tools.outcome import CURSOR_ERROR, INVALID_COMMAND, REFERENCE_NOT_AVAILABLE, ErrorDetail

logger = logging.getLogger(__name__)

CURSOR_KIND = "cursor"
SLOT_TASK = "cursor"  # the task name the slot's value is stored under
CLAIM_ATTEMPTS = 3
BACKOFF_START_SEC = 0.1
BACKOFF_CAP_SEC = 5.0
MAX_ERROR_TEXT = 200

ReportRow = Callable[[Row, dict[str, int]], Awaitable[None]]
"""Records the row a slot is about to commit a claim for, with the slot's counts before
that row (``SlotCounts.totals``). Raises ``Unavailable`` when it could not be recorded
(the claim is rolled back and retried); a stop arrives as the slot's cancellation."""


@dataclass(slots=True)
class SlotCounts:
    processed: int = 0
    succeeded: int = 0
    failed: int = 0
    last_error: str = ""
    ctx_updates: dict[str, Any] = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        return {"processed": self.processed, "succeeded": self.succeeded, "failed": self.failed}

    def value(self) -> dict[str, Any]:
        out: dict[str, Any] = self.totals()
        if self.last_error:
            out["last_error"] = self.last_error
        return out

    def resume_from(self, counts: Any) -> None:
        """Take over the counts a previous attempt reported with the row it had claimed."""
        if isinstance(counts, Mapping):
            for name in ("processed", "succeeded", "failed"):
                value = counts.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    setattr(self, name, value)


def row_key(row: Any) -> str:
    """A short digest of a row: sub-playbook idempotency keys per row, stable across the
    slot's attempts (the resume row is the same JSON)."""
    return hashlib.sha256(encode_json(row)).hexdigest()[:16]


class CursorSlot:
    """Runs one cursor slot command to its ``CallResult``."""

    def __init__(self, command: messages_pb2.Command, store: ResultStore, tools: Tools, *,
                 report: ReportRow | None = None, worker_id: str = "", default_timeout: float = 0.0,
                 cancelled: asyncio.Event | None = None,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 secrets: CommandSecrets | None = None) -> None:
        self.command = command
        self.secrets = secrets
        self.store = store
        self.tools = tools
        self.report = report
        self.worker_id = worker_id
        self.timeout = command.timeout_seconds or default_timeout or None
        self.cancelled = cancelled
        self.sleep = sleep
        self.infra_retry_sec: float | None = None  # how long an outage of the store is waited out
        self.counts = SlotCounts()
        self.extra = {"execution_id": command.execution_id, "command_id": command.command_id,
                      "step": command.step}

    async def run(self) -> messages_pb2.CallResult:
        """Never raises for task, claim or store failures; cancellation propagates. What the
        command's credentials hand out is masked in its CallResult (``secrecy``)."""
        return scrub_call_result(await self._run(), self.secrets.redactor if self.secrets is not None else None)

    async def _run(self) -> messages_pb2.CallResult:
        command = self.command
        prepared = await prepare(command, self.store, worker_id=self.worker_id, retry_sec=self.infra_retry_sec,
                                 secrets=self.secrets)
        if isinstance(prepared, messages_pb2.CallResult):
            return prepared
        spec, context, tasks, scope = prepared
        loop = context.get("loop") if isinstance(context.get("loop"), Mapping) else {}
        assert isinstance(loop, Mapping)
        iterator = str(loop.get("iterator") or "item")
        try:
            cursor = CursorSpec.from_json(context.get("cursor"))
            if self.tools.cursors is None:
                raise CursorError("this worker has no cursor drivers")
            driver = await self.tools.cursors.open(cursor, self.secrets)
        except ToolError as exc:
            logger.warning("cursor slot cannot start: %s", exc, extra=self.extra)
            return error_result(command, exc.code or INVALID_COMMAND, str(exc), worker_id=self.worker_id,
                                kind=exc.kind, retryable=exc.retryable)

        async def run_row(row: Row) -> None:
            await self._run_row(spec, tasks, scope, iterator, row)

        error: ErrorDetail | None = None
        try:
            resume = context.get("resume")
            if resume is not None:
                self.counts.resume_from(context.get("resume_counts"))
                logger.info("cursor slot resumes with the row its previous attempt had claimed (after %d row(s))",
                            self.counts.processed, extra=self.extra)
                await run_row(resume)
            while (row := await self._claim(driver, cursor)) is not None:
                await run_row(row)
        except ToolError as exc:
            logger.warning("cursor slot failed after %d row(s): %s", self.counts.processed, exc, extra=self.extra)
            error = ErrorDetail.from_exception(exc)
        return await self._finish(error)

    async def _claim(self, driver: CursorDriver, cursor: CursorSpec) -> Row | None:
        """Claim one row, recording it with the api before the claim commits."""
        delay = BACKOFF_START_SEC
        failures = 0
        while True:
            try:
                async with driver.claim(cursor.claim) as row:
                    if row is not None and self.report is not None:
                        await self.report(row, self.counts.totals())
                return row
            except Unavailable as exc:  # the row could not be recorded: the claim rolled back
                logger.warning("cannot record the claimed row (%s); claiming again in %.1fs", exc, delay,
                               extra=self.extra)
            except ToolError as exc:
                failures += 1
                if not exc.retryable or failures >= CLAIM_ATTEMPTS:
                    raise
                logger.warning("cursor claim failed (%s); retrying in %.1fs", exc, delay, extra=self.extra)
            await self.sleep(delay)
            delay = min(delay * 2, BACKOFF_CAP_SEC)

    async def _run_row(self, spec: Mapping[str, Any], tasks: list[dict[str, Any]], scope: RenderContext,
                       iterator: str, row: Row) -> None:
        counts = self.counts
        index = counts.processed
        base_iter = scope.get("iter")
        row_iter = {**(base_iter if isinstance(base_iter, Mapping) else {}), iterator: row, "_index": index}
        row_scope = RenderContext({**scope, iterator: row, "iter": row_iter}, known=scope.known)
        caller = TaskCaller(self.command, spec, self.tools, timeout=self.timeout, cancelled=self.cancelled,
                            key_prefix=f"{self.command.command_id}#row:{row_key(row)}", secrets=self.secrets)

        async def log_only(run: TaskRun) -> None:
            log_task_run(self.command, run)

        result = await run_pipeline(tasks, row_scope, caller, on_result=log_only, sleep=self.sleep)
        counts.processed += 1
        if result.status == "ok":
            counts.succeeded += 1
            CURSOR_ROWS.labels("ok").inc()
        else:
            counts.failed += 1
            CURSOR_ROWS.labels("error").inc()
            message = result.error.message if result.error is not None else "failed"
            counts.last_error = message[:MAX_ERROR_TEXT]
            logger.info("cursor row %d failed: %s", index, message, extra=self.extra)
        counts.ctx_updates.update(result.set_updates.get("ctx") or {})

    async def _finish(self, error: ErrorDetail | None) -> messages_pb2.CallResult:
        command, counts = self.command, self.counts
        value = counts.value()
        try:
            ref = await persist_result(self.store, value, command=command, task=SLOT_TASK, parent_ref_id=None,
                                       retry_sec=self.infra_retry_sec)
        except StoreFailure as exc:
            logger.error("cannot store the cursor slot's counts: %s", exc, extra=self.extra)
            return error_result(command, REFERENCE_NOT_AVAILABLE, str(exc), worker_id=self.worker_id,
                                kind="StoreFailure", retryable=True)
        logger.info("cursor slot %s: processed=%d succeeded=%d failed=%d", "failed" if error else "drained",
                    counts.processed, counts.succeeded, counts.failed, extra=self.extra)
        if error is not None and not error.code:
            error.code = CURSOR_ERROR
        env = envelope("error" if error else "ok", ref, None, value, error.to_dict() if error else None)
        return build_call_result(command, env, worker_id=self.worker_id,
                                 set_updates={"ctx": counts.ctx_updates, "iter": {}},
                                 error_details=error.details if error else None)


async def run_cursor_slot(command: messages_pb2.Command, store: ResultStore, tools: Tools, *,
                          report: ReportRow | None = None, worker_id: str = "", default_timeout: float = 0.0,
                          cancelled: asyncio.Event | None = None,
                          sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                          infra_retry_sec: float | None = None,
                          secrets: CommandSecrets | None = None) -> messages_pb2.CallResult:
    """Run a claimed cursor slot command (see the module docstring) to its ``CallResult``."""
    slot = CursorSlot(command, store, tools, report=report, worker_id=worker_id,
                      default_timeout=default_timeout, cancelled=cancelled, sleep=sleep, secrets=secrets)
    slot.infra_retry_sec = infra_retry_sec
    return await slot.run()
