"""Executes one claimed command: parse it, build the render scope, run the pipeline,
persist every task result, and build the ``CallResult`` (references only).

Persist-before-emit: every result the worker reports (each task of a pipeline, a
cursor slot's counts) is stored by ``persist_result`` (one ``ResultStore.put``, bounded
by a timeout, whose ``parent_ref`` is the previous task's reference) before any
``CallResult`` is built. A store failure or timeout stops the command with
``REFERENCE_NOT_AVAILABLE``: a result is never silently lost, and never waited on forever.
A result the store refuses as larger than ``NOETL_LIMIT_RESULT_BYTES`` (``ResultTooLarge``)
is the task's own failure: the command fails with ``RESULT_TOO_LARGE``, not retryable.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from noetl_common import tracing
from noetl_common.errors import NoetlError
from noetl_common.retry import retry_transient
from noetl_common.vocab import EventType, iteration_command_id
from noetl_dsl.templates import RenderContext, set_path
from noetl_proto.v1 import messages_pb2
from noetl_store import Reference, ResultStore, ResultTooLarge, encode_json, envelope, envelope_to_proto

from .pipeline import PipelineResult, TaskRun, run_pipeline
from .scope import build_scope
from .secrecy import KeychainError, keychain_scope, scrub_call_result, scrub_outcome
from .tools import CallInfo, CommandSecrets, ToolOutcome, Tools
from .tools.outcome import INVALID_COMMAND, REFERENCE_NOT_AVAILABLE, RESULT_TOO_LARGE, ErrorDetail
from .tools.python import PythonLane

logger = logging.getLogger(__name__)


# Outer bound of one persist attempt (the store bounds its own calls too, NOETL_RESULT_TIMEOUT_SEC).
PERSIST_TIMEOUT_SEC = 120.0
# How long the worker waits out an outage of the result store (Postgres, S3) or of the
# runtime database before a result it holds becomes REFERENCE_NOT_AVAILABLE: an outage
# shorter than this is never a user-visible error. A command whose lease is lost meanwhile
# is stopped (cancelled) and retries nothing.
INFRA_RETRY_SEC = 600.0
# A batch of loop iterations starts no new one after this long (NOETL_WORKER_BATCH_BUDGET_SEC).
BATCH_BUDGET_SEC = 0.25


class StoreFailure(NoetlError):
    """A task result could not be persisted."""


async def persist_result(store: ResultStore, value: Any, *, command: messages_pb2.Command, task: str,
                         parent_ref_id: int | None, limit_sec: float | None = None,
                         retry_sec: float | None = None) -> Reference:
    """Persist-before-emit: store one result of ``command`` and return its reference.
    Every result the worker reports goes through here. A failure of the store that is an
    outage (``retry.is_transient``: unreachable, restarting, timing out) is retried with
    backoff for up to ``retry_sec`` (default ``INFRA_RETRY_SEC``); each attempt is bounded
    by ``limit_sec`` (default ``PERSIST_TIMEOUT_SEC``). Raises ``StoreFailure`` (the caller
    reports ``REFERENCE_NOT_AVAILABLE``) when the store refuses the value or the outage
    outlasts the retries. A value larger than the store's result size limit raises
    ``ResultTooLarge`` as it is (the task's failure: the caller reports
    ``RESULT_TOO_LARGE``; nothing was stored, nothing to retry)."""
    limit = PERSIST_TIMEOUT_SEC if limit_sec is None else limit_sec
    deadline = INFRA_RETRY_SEC if retry_sec is None else retry_sec

    async def once() -> Reference:
        try:
            async with asyncio.timeout(limit):
                return await store.put(value, execution_id=command.execution_id, step=command.step,
                                       command_id=command.command_id, task=task, parent_ref_id=parent_ref_id)
        except TimeoutError as exc:
            raise _PutTimeout(f"the result store did not answer within {limit:g}s") from exc

    try:
        return await retry_transient(f"storing the result of task '{task}' of {command.command_id}", once,
                                     deadline_sec=deadline, initial=0.1, cap=5.0)
    except _PutTimeout as exc:
        raise StoreFailure(f"cannot store the result of task '{task}': {exc}") from exc
    except ResultTooLarge:
        raise
    except (NoetlError, TypeError, ValueError) as exc:
        raise StoreFailure(f"cannot store the result of task '{task}': {exc}") from exc


# A batch holds back only results this small (an estimate of their JSON size): a batch of
# NOETL_EXECUTION_LOOP_BATCH_MAX iterations keeps at most that many of them in memory.
DEFER_MAX_BYTES = 16 * 1024


def _small(value: Any, budget: int) -> bool:
    """Whether ``value`` encodes to about ``budget`` bytes or fewer; stops looking as soon
    as it has seen more (O(budget), whatever the value's size)."""
    left = budget
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str | bytes):
            left -= len(item) + 2
        elif isinstance(item, Mapping):
            left -= 2 + 4 * len(item)
            if left >= 0:
                for key, member in item.items():
                    stack.append(key)
                    stack.append(member)
        elif isinstance(item, list | tuple):
            left -= 2 + len(item)
            if left >= 0:
                stack.extend(item)
        else:
            left -= 24  # a number, a bool, None, or something the codec converts
        if left < 0:
            return False
    return True


class _PutTimeout(TimeoutError):
    """One put attempt ran out of time (transient: retried)."""


class _Persister:
    """Stores each task result (``persist_result``), chaining references through
    ``parent_ref_id``. With ``defer`` a small result is held back until ``flush``: the
    runner flushes before the pipeline runs another task (``run_task``), so a result the
    store refuses still stops the pipeline before anything else runs, and at the end, when
    a batch stores its iterations' results together (one statement) before it reports."""

    def __init__(self, store: ResultStore, command: messages_pb2.Command, retry_sec: float | None = None,
                 *, defer: bool = False) -> None:
        self.store = store
        self.command = command
        self.retry_sec = retry_sec
        self.defer = defer
        self.stored: list[tuple[TaskRun, Reference]] = []
        self._deferred: TaskRun | None = None

    async def record(self, run: TaskRun) -> None:
        outcome = run.outcome
        log_task_run(self.command, run)
        if not outcome.ok and outcome.data is None:
            return  # nothing to keep: the error itself travels in the envelope
        if self.defer and _small(outcome.data, DEFER_MAX_BYTES):
            self._deferred = run
            return
        await self._store(run)

    def run_task(self, caller: TaskCaller) -> Callable[[Mapping[str, Any], RenderContext], Awaitable[ToolOutcome]]:
        """``caller``, storing a held-back result first (the next task's parent)."""
        if not self.defer:
            return caller

        async def run(task: Mapping[str, Any], scope: RenderContext) -> ToolOutcome:
            await self.flush()
            return await caller(task, scope)
        return run

    async def flush(self) -> None:
        """Store the deferred result, if any (StoreFailure / ResultTooLarge as ``record``)."""
        run, self._deferred = self._deferred, None
        if run is not None:
            await self._store(run)

    async def _store(self, run: TaskRun) -> None:
        parent = self.stored[-1][1].ref_id if self.stored else None
        ref = await persist_result(self.store, run.outcome.data, command=self.command, task=run.name,
                                   parent_ref_id=parent, retry_sec=self.retry_sec)
        self.stored.append((run, ref))

    def references(self, last: TaskRun | None) -> tuple[Reference | None, Reference | None]:
        """(reference of the last run, the reference before it)."""
        if not self.stored:
            return None, None
        if last is not None and self.stored[-1][0] is last:
            parent = self.stored[-2][1] if len(self.stored) > 1 else None
            return self.stored[-1][1], parent
        return None, self.stored[-1][1]


def log_task_run(command: messages_pb2.Command, run: TaskRun) -> None:
    extra = {"execution_id": command.execution_id, "command_id": command.command_id, "step": command.step}
    if run.outcome.stdout:
        logger.debug("task %s output:\n%s", run.name, run.outcome.stdout.rstrip(), extra=extra)
    if run.outcome.error is not None:
        logger.info("task %s attempt %d failed: %s: %s", run.name, run.attempt, run.outcome.error.code,
                    run.outcome.error.message, extra=extra)


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError as exc:
        raise ValueError(f"{field} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object")
    return value


class TaskCaller:
    """Runs one task attempt of a command's pipeline with the tools, the step's input,
    workbook and timeout, and a ``CallInfo`` whose key is deterministic per task run:
    ``{prefix}#{task}`` for a task's first run in this pipeline, ``{prefix}#{task}#{n}``
    for its n-th (policy retries, jumps), so every attempt of the command derives the
    same keys in the same order."""

    def __init__(self, command: messages_pb2.Command, spec: Mapping[str, Any], tools: Tools, *,
                 timeout: float | None, cancelled: asyncio.Event | None = None, key_prefix: str = "",
                 worker_id: str = "", secrets: CommandSecrets | None = None,
                 python_lane: PythonLane | None = None) -> None:
        self.command = command
        self.python_lane = python_lane
        self.worker_id = worker_id
        self.tools = tools
        self.secrets = secrets
        self.timeout = timeout
        self.cancelled = cancelled
        self.prefix = key_prefix or command.command_id
        self.step_input = spec.get("input") if isinstance(spec.get("input"), Mapping) else None
        self.workbook = spec.get("workbook") if isinstance(spec.get("workbook"), Mapping) else None
        self.playbook_path = str(spec.get("playbook_path") or "")
        self._runs: dict[str, int] = {}

    def call_info(self, name: str) -> CallInfo:
        n = self._runs[name] = self._runs.get(name, 0) + 1
        key = f"{self.prefix}#{name}" + (f"#{n}" if n > 1 else "")
        return CallInfo(self.command.execution_id, self.command.command_id, self.command.step, key, self.cancelled,
                        self.command.attempt, self.worker_id, self.command.claim_token, self.secrets,
                        self.playbook_path, self.python_lane)

    async def __call__(self, task: Mapping[str, Any], scope: RenderContext) -> ToolOutcome:
        name = str(scope.get("_task") or task.get("name") or "task")
        call = self.call_info(name)
        kind = str(task.get("kind") or "")
        # One span per tool run, in the execution's trace (noetl_common.tracing).
        with tracing.span(f"tool.run {kind or 'unknown'}", attributes={
                "noetl.execution_id": self.command.execution_id, "noetl.command_id": self.command.command_id,
                "noetl.step": self.command.step, "noetl.task": name, "noetl.tool.kind": kind,
                "noetl.attempt": self.command.attempt, "noetl.call_key": call.key}) as span:
            outcome = await self.tools.run_task(task, scope, step_input=self.step_input, workbook=self.workbook,
                                                timeout_sec=self.timeout, call=call)
            # what the task produced, as it may be reported: the secrets it was given masked
            outcome = scrub_outcome(outcome, self.secrets.redactor if self.secrets is not None else None)
            if outcome.error is not None:
                tracing.set_error(span, f"{outcome.error.code}: {outcome.error.message}"[:500])
            return outcome


def parse_command(command: messages_pb2.Command) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(spec, context, tasks) of a command; ValueError naming what is malformed."""
    spec = _json_object(command.spec_json, "spec_json")
    context = _json_object(command.context_json, "context_json")
    return spec, context, command_tasks(spec)


def command_tasks(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tasks of a command's ``tool`` (one task, or a list: a pipeline)."""
    tool = spec.get("tool")
    raw: list[Any] = tool if isinstance(tool, list) else [tool]
    tasks = [dict(t) for t in raw if isinstance(t, Mapping)]
    if not tasks or len(tasks) != len(raw):
        raise ValueError("spec_json: `tool` must be a task object or a non-empty list of task objects")
    if not isinstance(tool, list) and not tasks[0].get("name") and spec.get("step"):
        tasks[0]["name"] = str(spec["step"])  # a single unnamed tool is named after its step (as the DSL does)
    return tasks


def _now() -> Timestamp:
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


def build_call_result(command: messages_pb2.Command, env: Mapping[str, Any], *, worker_id: str,
                      set_updates: Mapping[str, Any] | None = None,
                      error_details: Mapping[str, Any] | None = None) -> messages_pb2.CallResult:
    return messages_pb2.CallResult(
        command_id=command.command_id, execution_id=command.execution_id, step=command.step,
        attempt=command.attempt, worker_id=worker_id,
        envelope=envelope_to_proto(env, error_details=error_details),
        set_json=_set_json(set_updates),
        finished_at=_now(), claim_token=command.claim_token)


def _set_json(set_updates: Mapping[str, Any] | None) -> str:
    """A result's ``set`` updates as JSON text (empty ones spelled out)."""
    return encode_json(dict(set_updates) if set_updates else {"ctx": {}, "iter": {}}).decode()


def error_result(command: messages_pb2.Command, code: str, message: str, *, worker_id: str,
                 kind: str = "", retryable: bool = False,
                 parent: Reference | None = None) -> messages_pb2.CallResult:
    return build_call_result(command, _error_envelope(code, message, kind, retryable, parent), worker_id=worker_id)


async def prepare(command: messages_pb2.Command, store: ResultStore, *, worker_id: str = "",
                  retry_sec: float | None = None, secrets: CommandSecrets | None = None
                  ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], RenderContext] | messages_pb2.CallResult:
    """(spec, context, tasks, render scope) of a command, or the error ``CallResult`` when
    the command is malformed, an earlier result cannot be read or a keychain entry it
    reads cannot be had (``secrecy.keychain_scope``)."""
    extra = {"execution_id": command.execution_id, "command_id": command.command_id, "step": command.step}
    try:
        spec, context, tasks = parse_command(command)
    except ValueError as exc:
        logger.warning("invalid command: %s", exc, extra=extra)
        return error_result(command, INVALID_COMMAND, str(exc), worker_id=worker_id, kind="ValueError")
    try:
        scope = await _build_scope_waiting_out_outages(context, spec, store, command, retry_sec)
    except ValueError as exc:
        return error_result(command, INVALID_COMMAND, str(exc), worker_id=worker_id, kind="ValueError")
    except NoetlError as exc:
        logger.warning("cannot resolve earlier results: %s", exc, extra=extra)
        return error_result(command, REFERENCE_NOT_AVAILABLE, f"cannot read an earlier step's result: {exc}",
                            worker_id=worker_id, kind=type(exc).__name__, retryable=True)
    try:
        keychain = await keychain_scope(spec, scope, secrets)
    except KeychainError as exc:
        error = exc.outcome.error
        assert error is not None
        logger.info("keychain: %s", error.message, extra=extra)
        return error_result(command, error.code, error.message, worker_id=worker_id, kind=error.kind,
                            retryable=error.retryable)
    if keychain is not None:
        scope = RenderContext({**scope, "keychain": keychain}, known=scope.known)
    return spec, context, tasks, scope


async def _build_scope_waiting_out_outages(context: dict[str, Any], spec: dict[str, Any], store: ResultStore,
                                           command: messages_pb2.Command, retry_sec: float | None) -> RenderContext:
    """``build_scope``, with an outage of the result store waited out (``retry_sec``,
    default INFRA_RETRY_SEC)."""
    deadline = INFRA_RETRY_SEC if retry_sec is None else retry_sec
    return await retry_transient(f"reading earlier results for {command.command_id}",
                                 lambda: build_scope(context, spec, store), deadline_sec=deadline, initial=0.1, cap=5.0)


async def execute_command(command: messages_pb2.Command, store: ResultStore, tools: Tools, *,
                          worker_id: str = "", default_timeout: float = 0.0,
                          cancelled: asyncio.Event | None = None,
                          sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                          infra_retry_sec: float | None = None,
                          secrets: CommandSecrets | None = None,
                          batch_budget_sec: float = BATCH_BUDGET_SEC) -> messages_pb2.CallResult:
    """Run a claimed command to its ``CallResult``. Never raises for task, template or
    store failures (they become error envelopes); cancellation propagates. ``cancelled``
    is set when the api cancelled the command (tools that started work elsewhere, like
    sub-playbooks, cancel it then). ``secrets``: the command's access to stored
    credentials; what they hand out is masked in everything the command reports.
    A batch of loop iterations starts no new iteration once ``batch_budget_sec`` have
    passed: its result answers for the iterations it ran (at least one), and the engine
    gives the others back to the loop, so slow iterations report (and are lost to a
    crash) in small groups, while fast ones share one claim and one result."""
    redactor = secrets.redactor if secrets is not None else None
    return scrub_call_result(await _execute(command, store, tools, worker_id=worker_id,
                                            default_timeout=default_timeout, cancelled=cancelled, sleep=sleep,
                                            infra_retry_sec=infra_retry_sec, secrets=secrets,
                                            batch_budget_sec=batch_budget_sec), redactor)


async def _execute(command: messages_pb2.Command, store: ResultStore, tools: Tools, *, worker_id: str,
                   default_timeout: float, cancelled: asyncio.Event | None,
                   sleep: Callable[[float], Awaitable[Any]], infra_retry_sec: float | None,
                   secrets: CommandSecrets | None, batch_budget_sec: float) -> messages_pb2.CallResult:
    prepared = await prepare(command, store, worker_id=worker_id, retry_sec=infra_retry_sec, secrets=secrets)
    if isinstance(prepared, messages_pb2.CallResult):
        return prepared
    spec, context, tasks, scope = prepared
    timeout = command.timeout_seconds or default_timeout or None
    items = context.get("batch_items")
    if not isinstance(items, list) or not items:
        caller = TaskCaller(command, spec, tools, timeout=timeout, cancelled=cancelled, worker_id=worker_id,
                            secrets=secrets)
        env, set_updates, details = await _run_tasks(command, command, tasks, scope, caller, store, sleep,
                                                     infra_retry_sec)
        return build_call_result(command, env, worker_id=worker_id, set_updates=set_updates, error_details=details)
    # A batch of loop iterations (noetl_flow.loops.batch_size): each item in index order,
    # with its own scope, result keys and stored results, under this command's claim.
    loop = context.get("loop") or {}
    first, iterator = int(loop.get("index") or 0), str(loop.get("iterator") or "item")
    # A sequential loop's iterations each see ctx as the previous one left it, and the
    # event that dispatches all but its first (the engine's view between commands).
    carried = _Carried(scope, command.step, secrets) if loop.get("mode") == "sequential" else None
    # A parallel loop's iterations store their results together when the batch ends (one
    # statement, not one round trip per iteration), before the batch reports; a sequential
    # one's iteration is finished before the next starts (its `set` is carried forward).
    started = time.monotonic()

    def iteration(offset: int, item: Any, lane: PythonLane | None = None) -> Awaitable[Finish]:
        index = first + offset
        own = messages_pb2.Command(command_id=iteration_command_id(command.command_id, index),
                                   execution_id=command.execution_id, shard_id=command.shard_id, step=command.step,
                                   attempt=command.attempt, kind=command.kind)
        names = {**scope, iterator: item, "_index": index, "loop_index": index,
                 "iter": {iterator: item, "_index": index}}
        if carried is not None and offset:
            names.update(carried.names())
        caller = TaskCaller(command, spec, tools, timeout=timeout, cancelled=cancelled, worker_id=worker_id,
                            secrets=secrets, key_prefix=own.command_id, python_lane=lane)
        return _start_tasks(command, own, tasks, RenderContext(names, known=scope.known), caller, store,
                            sleep, infra_retry_sec, defer=carried is None)

    finishers: list[tuple[int, Finish]] = []
    pace: Callable[[float], float] = float  # the batch's time as its pace (below)
    if carried is None and tools.python is not None and _python_only(tasks):
        # python tasks in one child, written ahead of their turn (PythonLane): still one at a time
        async with tools.python.lane() as lane:
            await lane.acquire()
            started = time.monotonic()  # the budget and the pace count from when the batch has a child
            finishers = await _overlapped(items, first, batch_budget_sec, started,
                                          lambda o, i: iteration(o, i, lane))
        pace = lane.pace_ms
    else:
        for offset, item in enumerate(items):
            if offset and time.monotonic() - started >= batch_budget_sec:
                break  # the rest go back to the loop (noetl_flow.router: the iterations not answered for)
            finish = await iteration(offset, item)
            if carried is not None:
                done = await finish()
                carried.apply(done[1])
                finish = _finished(done)
            finishers.append((first + offset, finish))
    outcomes: list[messages_pb2.IterationResult] = []
    failed = 0
    for index, (env, set_updates, details) in zip([i for i, _ in finishers],
                                                  await asyncio.gather(*(f() for _, f in finishers)), strict=True):
        failed += env["status"] == "error"
        outcomes.append(messages_pb2.IterationResult(
            index=index, envelope=envelope_to_proto(env, error_details=details),
            set_json=_set_json(set_updates)))
    ran = len(outcomes)
    # The batch's pace sizes the loop's later batches (noetl_flow.loops.batch_size): its wall
    # ms, or for a python lane what its tasks took without the lanes it shared the cores with.
    took = {"count": ran, "failed": failed, "ms": round(pace(1000 * (time.monotonic() - started)), 1)}
    summary = envelope("error" if failed else "ok", None, None, took,
                       {"code": "ITERATIONS_FAILED", "message": f"{failed} of {ran} iteration(s) failed"}
                       if failed else None)
    result = build_call_result(command, summary, worker_id=worker_id)
    result.iterations.extend(outcomes)
    return result


# (envelope, set updates, error details) of one command or one iteration of its batch
_Outcome = tuple[dict[str, Any], Mapping[str, Any] | None, Mapping[str, Any] | None]
# what finishes an iteration that has run: stores a result held back, then gives its _Outcome
Finish = Callable[[], Awaitable[_Outcome]]
# Iterations of a batch under way at once, at most (_overlapped): their python tasks are
# written to the lane's child up to this far ahead of their turn.
LANE_DEPTH = 8
# Task kinds whose batch may overlap: python (one child runs them one at a time) and noop.
LANE_KINDS = frozenset({"python", "noop"})


def _finished(outcome: _Outcome) -> Finish:
    async def done() -> _Outcome:
        return outcome
    return done


def _python_only(tasks: list[dict[str, Any]]) -> bool:
    """Whether every task of a pipeline is python (or noop): only then may a batch's
    iterations overlap, their tools still running one at a time in one child."""
    return all(str(task.get("kind") or "").lower() in LANE_KINDS for task in tasks)


async def _overlapped(items: list[Any], first: int, budget_sec: float, started: float,
                      start: Callable[[int, Any], Awaitable[Finish]]) -> list[tuple[int, Finish]]:
    """Run a parallel batch's iterations (``start``) in index order, several under way at
    once: (index, finish) of each one started. An iteration's own work is unchanged; what
    overlaps is its rendering, its waits and its result handling with the next ones'
    (their python tasks queue in one child, ``PythonLane``, so the tools still run one at
    a time, in index order). How many are under way follows the budget as the serial loop
    does (no new iteration once ``budget_sec`` have passed since ``started``): one until one
    has finished, then as many as fit in the budget left at the pace so far, at most
    LANE_DEPTH, so slow iterations still end a batch in small groups."""
    running: list[tuple[int, asyncio.Task[Finish]]] = []
    freed = asyncio.Event()
    state = {"under_way": 0, "done": 0}

    def finished(_: object) -> None:
        state["under_way"] -= 1
        state["done"] += 1
        freed.set()

    def depth() -> int:
        if not state["done"]:
            return 1
        spent = time.monotonic() - started
        return max(1, min(LANE_DEPTH, int((budget_sec - spent) * state["done"] / max(spent, 1e-6))))

    try:
        for offset, item in enumerate(items):
            while state["under_way"] >= depth():
                freed.clear()
                await freed.wait()
            if offset and time.monotonic() - started >= budget_sec:
                break  # the rest go back to the loop (noetl_flow.router: the iterations not answered for)
            task = asyncio.ensure_future(start(offset, item))
            state["under_way"] += 1
            task.add_done_callback(finished)
            running.append((first + offset, task))
        return [(index, await task) for index, task in running]
    finally:
        for _, task in running:
            task.cancel()  # a no-op for the finished ones (cancelled or failed: the rest stop)
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)


class _Carried:
    """What one iteration of a sequential batch leaves the next: ``ctx`` with its ``set``
    updates applied as the engine applies them (``set_path``, masked as the engine would
    receive them), and the ``loop.next`` event."""

    def __init__(self, scope: RenderContext, step: str, secrets: CommandSecrets | None) -> None:
        self.ctx: dict[str, Any] = copy.deepcopy(dict(scope.get("ctx") or {}))
        self.event = {"name": EventType.LOOP_NEXT, "step": step}
        self.redactor = secrets.redactor if secrets is not None else None

    def names(self) -> dict[str, Any]:
        return {"ctx": copy.deepcopy(self.ctx), "event": dict(self.event)}

    def apply(self, set_updates: Mapping[str, Any] | None) -> None:
        if not set_updates or not set_updates.get("ctx"):
            return
        updates = json.loads(_set_json(set_updates))["ctx"]  # as the engine receives them (JSON)
        if self.redactor:
            updates = self.redactor.value(updates)
        for key, value in updates.items():
            set_path(self.ctx, key, value)


async def _run_tasks(command: messages_pb2.Command, own: messages_pb2.Command, tasks: list[dict[str, Any]],
                     scope: RenderContext, caller: TaskCaller, store: ResultStore,
                     sleep: Callable[[float], Awaitable[Any]], infra_retry_sec: float | None) -> _Outcome:
    """Run the command's tasks in ``scope`` (``own``: the command, or one iteration of its
    batch, whose results are stored): (envelope, set updates, error details)."""
    finish = await _start_tasks(command, own, tasks, scope, caller, store, sleep, infra_retry_sec, defer=False)
    return await finish()


async def _start_tasks(command: messages_pb2.Command, own: messages_pb2.Command, tasks: list[dict[str, Any]],
                       scope: RenderContext, caller: TaskCaller, store: ResultStore,
                       sleep: Callable[[float], Awaitable[Any]], infra_retry_sec: float | None, *, defer: bool
                       ) -> Callable[[], Awaitable[_Outcome]]:
    """Run the tasks; returns what finishes them: it stores a result ``defer`` held back
    (``_Persister``), then gives (envelope, set updates, error details)."""
    extra = {"execution_id": command.execution_id, "command_id": own.command_id, "step": command.step}
    persister = _Persister(store, own, infra_retry_sec, defer=defer)

    def failed(exc: StoreFailure | ResultTooLarge) -> _Outcome:
        _, parent = persister.references(None)
        if isinstance(exc, ResultTooLarge):
            logger.info("%s", exc, extra=extra)
            return _error_envelope(RESULT_TOO_LARGE, str(exc), "ResultTooLarge", False, parent), None, None
        logger.error("%s", exc, extra=extra)
        return _error_envelope(REFERENCE_NOT_AVAILABLE, str(exc), "StoreFailure", True, parent), None, None

    try:
        result: PipelineResult = await run_pipeline(tasks, scope, persister.run_task(caller),
                                                    on_result=persister.record, sleep=sleep)
    except (StoreFailure, ResultTooLarge) as exc:
        return _finished(failed(exc))

    async def finish() -> _Outcome:
        try:
            await persister.flush()
        except (StoreFailure, ResultTooLarge) as exc:
            return failed(exc)
        ref, parent = persister.references(result.last)
        error = result.error.to_dict() if result.error is not None else None
        return (envelope(result.status, ref, parent, result.data, error), result.set_updates,
                result.error.details if result.error is not None else None)
    return finish


def _error_envelope(code: str, message: str, kind: str, retryable: bool, parent: Reference | None) -> dict[str, Any]:
    return envelope("error", None, parent, None, ErrorDetail(code, message, kind, retryable).to_dict())
