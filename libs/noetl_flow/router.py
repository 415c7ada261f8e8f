"""Routing: fold one input into an execution's state and decide what happens next.

Pure functions over (playbook, workload, state, input, resolved values): no I/O.
The engine prepares ``values`` (full results of the steps a template names, see
``Flow.needs``) before calling, so evaluating ``when``/``set`` never touches storage.

Rules (NoETL canonical DSL):
* A step completes when its command's first terminal result is accepted. Later
  results for the same command id are recorded as ``call.duplicate`` and ignored.
* On success: worker ``set`` updates (task policies), then the step's ``set``, then
  ``next.arcs`` (``exclusive``: the first arc whose ``when`` holds; ``inclusive``:
  every such arc), each arc's ``set`` applied before its target is entered. These
  templates read the step's own result as ``output`` (``{status, data, error}``,
  ``output.data`` being what ``{{ <step> }}`` reads), as upstream does.
* On failure: arcs are evaluated with ``event.name == 'call.error'``; only arcs whose
  ``when`` reads the failure can fire (``_reads_failure``: it reads ``event``, ``error``
  or ``output.status`` / ``output.error``), so an arc written for the results of a step
  that succeeded (``{{ not step.rows }}``) never routes a failure onwards, as upstream
  stops a run at a failed task. If none fires, the execution fails naming the step.
* A step without ``next`` routes to the step named ``end`` when one exists
  (implicit end); otherwise its branch ends.
* Fan-in: a step with two or more predecessors is *armed* when an arc reaches it and
  dispatched once no running step can still reach it (a barrier over every branch
  that was actually taken).
* Loops (``loops.py``): a loop step runs its tool once per item (or per cursor slot)
  and routes once, on ``loop.done`` (``event.name == 'loop.failed'`` when iterations
  failed: only arcs whose ``when`` holds for that fire, else the execution fails).
* The execution completes when nothing is running and nothing is armed.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from noetl_common.vocab import CommandStatus, EventType, ExecutionStatus, ResultStatus, iteration_command_id
from noetl_common.vocab import command_id as make_command_id
from noetl_dsl import Playbook, Step, predecessors, successors
from noetl_dsl.templates import (
    RenderContext,
    TemplateError,
    add_upstream_names,
    attribute_reads,
    evaluate_when,
    referenced_names,
    render,
    set_path,
)

from . import loops, redrive, rerun
from .reach import Reachability
from .state import (
    CANCELLED,
    COMPLETED,
    FAILED,
    STEP_CANCELLED,
    STEP_DONE,
    STEP_FAILED,
    STEP_RUNNING,
    ExecState,
    LoopRun,
    Pending,
    StepRun,
)
from .transitions import (
    CallResultInput,
    CommandUpdate,
    DeadLetter,
    IterationOutcome,
    NewCommand,
    StartInput,
    Transition,
)

# The name a step's own `set` and `next` arcs read its result by (upstream's), and
# upstream's Python reference's `result` (the result alone: `output.data`).
OUTPUT = "output"
RESULT = "result"


@dataclass
class Inputs:
    """What templates evaluated by the engine may read besides the state."""

    workload: Mapping[str, Any]
    values: dict[str, Any]


class Flow:
    """Routing for one playbook version (cache one per catalog id)."""

    def __init__(self, playbook: Playbook, *, copy_state: bool = True, max_loop_items: int = 500_000,
                 loop_batch: int = loops.DEFAULT_BATCH_MAX, loop_batch_ms: float = loops.DEFAULT_BATCH_MS) -> None:
        """``copy_state=False`` folds inputs into the given state object in place (the
        engine does, to skip a deep copy per input: its cache is dropped whenever a batch
        fails, so a half-applied state never outlives the failed transaction).
        ``max_loop_items``: a loop whose collection is larger fails its step
        (NOETL_LIMIT_LOOP_ITEMS). ``loop_batch``: the most iterations of a parallel loop
        one command runs (NOETL_EXECUTION_LOOP_BATCH_MAX; 1: one iteration per command);
        ``loop_batch_ms``: the least time a batch runs once the loop's pace is known
        (NOETL_EXECUTION_LOOP_BATCH_MS; loops.batch_size)."""
        self.pb = playbook
        self._copy_state = copy_state
        self.max_loop_items = max_loop_items
        self.loop_batch = loop_batch
        self.loop_batch_ms = loop_batch_ms
        preds = predecessors(playbook)
        self.joins = {name for name, p in preds.items() if len(p) >= 2}
        self.reach = Reachability(successors(playbook))
        self.step_names = list(playbook.step_names)
        self._names = frozenset(self.step_names)
        # Names read by loop collection/cursor templates: they are rendered when a loop
        # step is entered, which may happen while routing any step.
        self._loop_names = frozenset(n for s in playbook.workflow if s.loop is not None
                                     for n in loops.template_names(s) if n in self._names)
        self._needs_cache: dict[str, frozenset[str]] = {}

    # ------------------------------------------------------------ inputs

    def start(self, inp: StartInput, workload: Mapping[str, Any]) -> Transition:
        state = ExecState(execution_id=inp.execution_id, shard_id=inp.shard_id, catalog_id=inp.catalog_id,
                          deadline_ms=inp.deadline_ms, parent_execution_id=inp.parent_execution_id)
        t = Transition(state)
        t.emit(EventType.PLAYBOOK_STARTED, meta=dict(inp.meta))
        io = Inputs(workload, {})
        try:
            self._enter(t, self.pb.start_step, {"name": EventType.PLAYBOOK_STARTED, "step": None}, io)
        except TemplateError as exc:
            self._fail(t, f"step '{self.pb.start_step}': {exc}", step=_failing_step(exc, self.pb.start_step))
            return t
        self._settle(t, io)
        return t

    def rerun(self, inp: StartInput, original: ExecState, plan: rerun.RerunPlan, workload: Mapping[str, Any],
              values: Mapping[str, Any], todo: Mapping[str, tuple[int, list[list[int]]]]) -> Transition:
        """The first transition of a rerun of ``original`` (rerun.py): kept results by
        reference, ``ctx`` as the original left it, the plan's steps entered again.
        ``values``: what ``rerun.needs`` named, resolved; ``todo``: for each resumed loop,
        (successful iterations kept, ranges still to run)."""
        state = ExecState(execution_id=inp.execution_id, shard_id=inp.shard_id, catalog_id=inp.catalog_id,
                          deadline_ms=inp.deadline_ms, parent_execution_id=inp.parent_execution_id,
                          rerun_of=original.execution_id, ctx=copy.deepcopy(original.ctx))
        t = Transition(state)
        t.emit(EventType.PLAYBOOK_STARTED, meta={**inp.meta, "rerun_of": original.execution_id, "rerun_steps": list(plan.steps),
                                 "kept_steps": list(plan.kept)})
        for name in plan.kept:
            was = original.steps[name]
            state.steps[name] = StepRun(status=was.status, visits=was.visits, command_id=was.command_id,
                                        attempt=was.attempt, result=copy.deepcopy(was.result), error=was.error,
                                        loop=LoopRun(**{**was.loop.__dict__, "todo": None}) if was.loop else None)
            t.emit(EventType.STEP_KEPT, step=name, result=state.steps[name].result,
                   meta={"rerun_of": original.execution_id, "status": was.status, "visit": was.visits,
                         "command_id": was.command_id})
        state.armed = list(plan.armed)
        io = Inputs(workload, dict(values))
        event = {"name": EventType.PLAYBOOK_RERUN, "step": None}
        name = ""
        try:
            for name in plan.steps:
                resumed = plan.resume.get(name)
                if resumed is not None:
                    kept, ranges = todo.get(name, (0, [[0, resumed.total]] if resumed.total else []))
                    run = self._prepare_entry(t, name)
                    done = loops.resume(self, t, self.pb.step(name), run, original.execution_id, resumed, kept,
                                        ranges, event)
                    if done is not None:
                        self._complete(t, name, done, io, loop_done=True)
                else:
                    self._enter(t, name, event, io)
        except TemplateError as exc:
            self._fail(t, f"step '{name}': {exc}", step=_failing_step(exc, name))
            return t
        self._settle(t, io)
        return t

    def refuse(self, inp: StartInput, message: str, meta: Mapping[str, Any]) -> Transition:
        """An execution that fails as it starts (a rerun whose original can no longer be
        rerun when the engine starts it): ``playbook.started`` then ``playbook.failed``."""
        t = Transition(ExecState(execution_id=inp.execution_id, shard_id=inp.shard_id, catalog_id=inp.catalog_id,
                                 deadline_ms=inp.deadline_ms, parent_execution_id=inp.parent_execution_id))
        t.emit(EventType.PLAYBOOK_STARTED, meta={**inp.meta, **meta})
        self._fail(t, message)
        return t

    def route_names(self, step_name: str) -> frozenset[str]:
        """Step names the engine resolves to route ``step_name``'s result (its ``set`` and
        arcs, loop collections)."""
        return self._template_names(step_name)

    def needs(self, state: ExecState, res: CallResultInput) -> dict[str, dict[str, Any] | None]:
        """Step results the templates evaluated for this input will read:
        {step name: reference or None}. The engine resolves them into ``values``."""
        pending = state.pending.get(res.command_id)
        if pending is None or state.terminal:
            return {}
        names = self._template_names(pending.step)
        out: dict[str, dict[str, Any] | None] = {}
        for name in names:
            run = state.steps.get(name)
            if name == pending.step and pending.index is None:
                out[name] = res.envelope.get("reference")
            elif name == pending.step and run is not None and run.loop is not None:
                # This command finishes the loop: its own set/arcs read the whole loop value,
                # so the engine resolves the instance's ordered results plus this command's.
                outcomes, returned = _outcomes(pending, res)
                finishing = None if returned else loops.finishing(run.loop, [o.envelope for o in outcomes])
                if finishing is not None:
                    out[name] = {"loop": {"instance": run.loop.instance,
                                          "results": [[o.index, o.envelope.get("reference")] for o in outcomes]},
                                 "stats": finishing}
            elif run is not None and run.result is not None:
                out[name] = (run.result or {}).get("reference")
        return out

    def on_result(self, state: ExecState, res: CallResultInput, workload: Mapping[str, Any],
                  values: Mapping[str, Any]) -> Transition:
        t = Transition(self._own(state))
        st = t.state
        pending = st.pending.get(res.command_id)
        ok = res.envelope.get("status") != "error"
        if pending is None or st.terminal:
            t.emit(EventType.CALL_DUPLICATE, step=None, command_id=res.command_id, result=res.envelope,
                   meta={"attempt": res.attempt, "worker": res.worker_id,
                         "reason": "terminal" if st.terminal else "not pending"})
            return t
        step_name = pending.step
        run = st.steps[step_name]
        del st.pending[res.command_id]
        in_loop = pending.index is not None and run.loop is not None
        outcomes, returned = (_outcomes(pending, res) if in_loop
                              else ([IterationOutcome(-1, res.envelope, res.set_updates)], []))
        failed = [o for o in outcomes if o.envelope.get("status") == "error"]
        ok = not failed
        meta: dict[str, Any] = {"attempt": res.attempt, "worker": res.worker_id}
        if pending.index is not None:
            meta["index"] = pending.index
        if pending.count > 1:  # a batch: one event for the iterations it ran, the failed ones named
            meta["count"] = len(outcomes)
            meta["failed"] = len(failed)
            if returned:
                meta["returned"] = sum(end - start for start, end in returned)
            if failed:
                meta["errors"] = [{"index": o.index, **_error_brief(o.envelope)} for o in failed]
        t.emit(EventType.CALL_DONE if ok else EventType.CALL_ERROR, step=step_name, command_id=res.command_id,
               result=res.envelope, meta=meta)
        t.updates.append(CommandUpdate(res.command_id, CommandStatus.DONE if ok else CommandStatus.FAILED))
        for o in failed:  # one dead letter per failed iteration (under its own id within a batch)
            t.dead_letters.append(DeadLetter(
                iteration_command_id(res.command_id, o.index) if pending.count > 1 else res.command_id,
                step_name, res.attempt, "failed", dict(o.envelope.get("error") or {}), res.worker_id,
                run.loop.instance if in_loop and run.loop else None, pending.index if pending.count == 1 else o.index))
        for o in outcomes:
            _apply_updates(st.ctx, (o.set_updates or {}).get("ctx") or {})
        io = Inputs(workload, dict(values))
        try:
            if in_loop and run.loop is not None:
                finished = loops.on_command_done(self, t, step_name, run,
                                                 [(o.index, o.envelope) for o in outcomes], io, returned,
                                                 res.envelope.get("context") if pending.count > 1 else None)
                if finished is not None:
                    self._complete(t, step_name, finished, io, loop_done=True)
            else:
                t.set_result(run, res.envelope)
                self._complete(t, step_name, ok, io)
        except TemplateError as exc:
            self._fail(t, f"step '{step_name}': {exc}", step=_failing_step(exc, step_name))
            return t
        self._settle(t, io)
        return t

    def on_cancel(self, state: ExecState, reason: str) -> Transition:
        t = Transition(self._own(state))
        if t.state.terminal:
            return t
        self._finish(t, CANCELLED, EventType.PLAYBOOK_CANCELLED, reason or "cancelled by request")
        return t

    def on_abort(self, state: ExecState, message: str) -> Transition:
        """Fail the execution with ``message`` (the engine could not process one of its
        inputs and quarantined it): running commands are cancelled, nothing is routed."""
        t = Transition(self._own(state))
        self._fail(t, message)
        return t

    def on_timeout(self, state: ExecState, now_ms: int) -> Transition:
        t = Transition(self._own(state))
        st = t.state
        if st.terminal or st.deadline_ms is None or now_ms < st.deadline_ms:
            return t
        self._fail(t, "execution timed out (deadline passed while steps were still running: "
                      f"{', '.join(sorted(st.active_steps())) or 'none'})")
        return t

    def on_expired(self, state: ExecState, command_id: str, attempt: int, max_attempts: int,
                   reason: str) -> Transition:
        """A command's claim lease expired (worker lost) or it was never claimed."""
        t = Transition(self._own(state))
        st = t.state
        pending = st.pending.get(command_id)
        if st.terminal or pending is None or pending.attempt != attempt:
            return t
        run = st.steps[pending.step]
        if attempt < max_attempts:
            pending.attempt = attempt + 1
            run.attempt = attempt + 1
            t.emit(EventType.COMMAND_REISSUED, step=pending.step, command_id=command_id,
                   meta={"attempt": attempt + 1, "reason": reason})
            t.updates.append(CommandUpdate(command_id, CommandStatus.QUEUED, attempt=attempt + 1))
            t.republish.append((command_id, attempt + 1, loops.command_kind(self, pending.step, run)))
            return t
        del st.pending[command_id]
        message = f"step '{pending.step}' command {command_id} dead-lettered after {attempt} attempts ({reason})"
        t.emit(EventType.COMMAND_DEAD_LETTERED, step=pending.step, command_id=command_id,
               result={"status": "error", "error": {"code": "DEAD_LETTERED", "message": message}},
               meta={"attempt": attempt, "reason": reason})
        t.updates.append(CommandUpdate(command_id, CommandStatus.DEAD))
        t.dead_letters.append(DeadLetter(command_id, pending.step, attempt, redrive.EXPIRED,
                                         {"code": "DEAD_LETTERED", "message": message},
                                         loop_instance=run.loop.instance if run.loop and pending.index is not None
                                         else None, loop_index=pending.index))
        run.status = STEP_FAILED
        run.error = message
        self._fail(t, message, cause={"step": pending.step, "command_id": command_id, "instance": None})
        return t

    def on_redrive(self, state: ExecState, items: list[redrive.RedriveItem], deadline_ms: int | None) -> Transition:
        """Redrive dead letters of this execution (``redrive.py``): each is re-issued, or
        refused with the reason in ``Transition.redrive_outcomes``."""
        t = Transition(self._own(state))
        redrive.apply(self, t, items, deadline_ms)
        return t

    # ------------------------------------------------------------ routing

    def _complete(self, t: Transition, step_name: str, ok: bool, io: Inputs, *, loop_done: bool = False) -> None:
        """A step finished (its single command, or its loop): record, then route."""
        run = t.state.steps[step_name]
        run.status = STEP_DONE if ok else STEP_FAILED
        run.error = None if ok else _error_text(run.result or {})
        if loop_done:  # a loop with failed iterations routes as `loop.failed` (arcs may catch it)
            event_name = EventType.LOOP_DONE if ok else EventType.LOOP_FAILED
        else:
            event_name = EventType.CALL_DONE if ok else EventType.CALL_ERROR
        self._route(t, step_name, ok, io, {"name": event_name, "step": step_name})

    def _route(self, t: Transition, step_name: str, ok: bool, io: Inputs, event: dict[str, Any]) -> None:
        st = t.state
        step = self.pb.step(step_name)
        own = self._own_output(st, io, step_name, ok)
        scope = self._scope(st, io, event, own)
        if ok and step.set:
            _apply_set(st.ctx, render(step.set, scope))
            scope = self._scope(st, io, event, own)
        fired = 0
        for arc in self._arcs(step):
            if not ok and not _reads_failure(arc.when):
                continue
            if not evaluate_when(arc.when, scope):
                continue
            fired += 1
            if arc.set:
                _apply_set(st.ctx, render(arc.set, scope))
                scope = self._scope(st, io, event, own)
            self._arrive(t, arc.step, event, io)
            if step.next_mode == "exclusive":
                break
        if not ok and fired == 0:
            run = st.steps[step_name]
            cause = {"step": step_name, "command_id": None if run.loop else run.command_id,
                     "instance": run.loop.instance if run.loop else None}
            self._fail(t, f"step '{step_name}' failed: {run.error}", cause=cause)

    def _arcs(self, step: Step) -> list[Any]:
        if step.arcs:
            return list(step.arcs)
        if step.step != "end" and "end" in self._names:
            return [_ImplicitArc("end")]
        return []

    def _arrive(self, t: Transition, target: str, event: dict[str, Any], io: Inputs) -> None:
        if target in self.joins:
            if target not in t.state.armed:
                t.state.armed.append(target)
            return
        self._enter(t, target, event, io)

    def _prepare_entry(self, t: Transition, name: str) -> StepRun:
        run = t.state.steps.setdefault(name, StepRun())
        run.visits += 1
        run.status = STEP_RUNNING
        run.attempt = 1
        t.set_result(run, None)
        run.error = None
        run.loop = None
        return run

    def _enter(self, t: Transition, name: str, event: dict[str, Any], io: Inputs) -> None:
        st = t.state
        step = self.pb.step(name)
        run = self._prepare_entry(t, name)
        if step.loop is not None:
            run.command_id = ""
            try:
                done = loops.start(self, t, step, run, event, self._scope(st, io, event))
            except TemplateError as exc:  # the step being entered failed, not the one routing to it
                if getattr(exc, "noetl_step", None) is None:
                    exc.noetl_step = name  # type: ignore[attr-defined]
                raise
            if done is not None:  # an empty collection: the loop is done at once
                self._complete(t, name, done, io, loop_done=True)
            return
        command_id = make_command_id(st.execution_id, name, run.visits)
        run.command_id = command_id
        kind = self.kind(step)
        self.dispatch(t, name, command_id, kind, event, extra=None)
        t.emit(EventType.STEP_ENTER, step=name, command_id=command_id,
               meta={"visit": run.visits, "attempt": 1, "kind": kind})

    def dispatch(self, t: Transition, step: str, command_id: str, kind: str, event: dict[str, Any],
                 extra: dict[str, Any] | None, index: int | None = None, count: int = 1) -> None:
        """Insert a command (and its pending entry) with a snapshot of the render context."""
        st = t.state
        st.pending[command_id] = Pending(step=step, attempt=1, index=index, count=count)
        if t.steps_snapshot is None:
            t.steps_snapshot = {n: r.result for n, r in st.steps.items() if r.result is not None}
        context: dict[str, Any] = {
            "ctx": copy.deepcopy(st.ctx),
            "steps": t.steps_snapshot,
            "event": {"name": event.get("name"), "step": event.get("step")},
            "iter": None,
        }
        if extra:
            context.update(extra)
        t.commands.append(NewCommand(command_id, step, kind, 1, context, _timeout(self.pb.step(step))))

    def _settle(self, t: Transition, io: Inputs) -> None:
        """Release fan-in barriers nobody can reach any more; complete when idle."""
        st = t.state
        if st.terminal:
            return
        progressed = True
        while progressed and st.armed and not st.terminal:
            progressed = False
            # The steps running when this pass began: entering a target below only appends
            # to ``pending``, so its first ``running`` entries are that set, read lazily
            # (the first one that can reach a target answers, O(1) for a typical fan-in).
            running = len(st.pending)
            for target in list(st.armed):
                active = (p.step for p in itertools.islice(st.pending.values(), running))
                if not self.reach.any_reaches(active, target):
                    st.armed.remove(target)
                    try:
                        self._enter(t, target, {"name": "fanin", "step": target}, io)
                    except TemplateError as exc:
                        self._fail(t, f"step '{target}': {exc}", step=target)
                        return
                    progressed = True
        if not st.terminal and not st.pending and not st.armed:
            self._finish(t, COMPLETED, EventType.PLAYBOOK_COMPLETED, None)

    def _fail(self, t: Transition, message: str, cause: dict[str, Any] | None = None,
              step: str | None = None) -> None:
        """Fail the execution. ``cause``: the command (or loop) whose failure this is; the
        state then keeps what the failure stops, for a redrive to resume (``redrive.py``).
        ``step`` (else the cause's): the step whose failure it is, where a rerun starts
        (``rerun.py``)."""
        if not t.state.terminal:
            t.state.failed_step = step or (cause["step"] if cause else None)
            self._finish(t, FAILED, EventType.PLAYBOOK_FAILED, message, cause)

    def _finish(self, t: Transition, status: str, event_type: str, message: str | None,
                cause: dict[str, Any] | None = None) -> None:
        st = t.state
        st.status = status
        st.error = message
        st.suspended = None
        if cause is not None and status == FAILED:
            st.suspended = {**cause, "pending": {cid: dict(p.__dict__) for cid, p in st.pending.items()},
                            "armed": list(st.armed)}
        for command_id, pending in list(st.pending.items()):
            t.updates.append(CommandUpdate(command_id, CommandStatus.CANCELLED))
            st.steps[pending.step].status = STEP_CANCELLED
        st.pending.clear()
        # ``armed`` stays: the fan-in steps still waiting when it ended (a rerun re-arms them)
        result = None
        if message:
            # a cancelled execution's error code is its status
            code = ExecutionStatus.CANCELLED.value if status == CANCELLED else "EXECUTION_FAILED"
            result = {"status": ResultStatus.ERROR if status == FAILED else ResultStatus.CANCELLED,
                      "error": {"code": code, "message": message}}
        t.emit(event_type, result=result, meta={"redrive": st.redrives} if st.redrives else {})

    # ------------------------------------------------------------ helpers

    def _own(self, state: ExecState) -> ExecState:
        return copy.deepcopy(state) if self._copy_state else state

    def _scope(self, st: ExecState, io: Inputs, event: dict[str, Any],
               output: dict[str, Any] | None = None) -> RenderContext:
        data: dict[str, Any] = dict(io.workload)
        data.update(io.values)
        data.update(workload=dict(io.workload), ctx=st.ctx, execution_id=st.execution_id, event=event)
        if output is not None:
            if OUTPUT not in self._names:
                data[OUTPUT] = output
            if RESULT not in self._names and RESULT not in data:
                data[RESULT] = output["data"]
        add_upstream_names(data, io.workload, st.execution_id)
        return RenderContext(data, known=self._names)

    @staticmethod
    def _own_output(st: ExecState, io: Inputs, step_name: str, ok: bool) -> dict[str, Any]:
        """``output`` in a step's own ``set`` and arcs (upstream): ``{status, data, error}``
        where ``data`` is the step's result (a loop's ``{results, stats}``), as
        ``{{ <step name> }}`` reads it. Resolved only when a template names ``output``."""
        run = st.steps.get(step_name)
        envelope = (run.result if run is not None else None) or {}
        return {"status": "ok" if ok else "error", "data": io.values.get(step_name),
                "error": None if ok else envelope.get("error")}

    def _template_names(self, step_name: str) -> frozenset[str]:
        cached = self._needs_cache.get(step_name)
        if cached is None:
            step = self.pb.step(step_name)
            names = referenced_names(step.set or {})
            for arc in step.arcs:
                names |= referenced_names(arc.when) | referenced_names(arc.set or {})
            cached = frozenset(n for n in names if n in self._names) | self._loop_names
            if (OUTPUT in names and OUTPUT not in self._names) or (RESULT in names and RESULT not in self._names):
                cached |= {step_name}  # `output` / `result` is the step's own result
            self._needs_cache[step_name] = cached
        return cached

    @staticmethod
    def kind(step: Step) -> str:
        tasks = step.tasks
        return tasks[0].kind if len(tasks) == 1 and not step.is_pipeline else "pipeline"


_FAILURE_NAMES = frozenset({"event", "error"})
_FAILURE_FIELDS = frozenset({"status", "error"})


@functools.lru_cache(maxsize=4096)
def _reads_failure(when: Any) -> bool:
    """Whether an arc's ``when`` can be about a failure of its step: it reads ``event``
    (``event.name == 'call.error'``), ``error``, or the step's ``output`` status or error
    (``output`` passed whole counts too)."""
    if not isinstance(when, str):
        return False
    names = referenced_names(when)
    if names & _FAILURE_NAMES:
        return True
    if OUTPUT not in names:
        return False
    fields = attribute_reads(when, OUTPUT)
    return fields is None or bool(fields & _FAILURE_FIELDS)


class _ImplicitArc:
    __slots__ = ("step",)
    when = None
    set = None

    def __init__(self, step: str) -> None:
        self.step = step


def _failing_step(exc: TemplateError, routing: str) -> str:
    """The step a template error fails: the loop step whose entry raised it, else the step
    whose ``set``/arcs were being rendered."""
    return str(getattr(exc, "noetl_step", None) or routing)


def _outcomes(pending: Pending, res: CallResultInput) -> tuple[list[IterationOutcome], list[list[int]]]:
    """(the iterations a loop command's result answers for, in index order; the index
    ranges it gives back). One iteration: its own envelope. A batch: each iteration's
    outcome from the worker's result; the iterations after the last one it ran (its time
    budget ran out: runner.execute_command) go back to the loop, to be dispatched again.
    A batch result with no outcome at all (the worker could not run the batch, e.g. an
    earlier result it reads is gone) fails every iteration with the batch's error."""
    assert pending.index is not None
    first, end = pending.index, pending.index + pending.count
    if pending.count == 1 and not res.iterations:
        return [IterationOutcome(first, res.envelope, res.set_updates)], []
    given = sorted((o for o in res.iterations if first <= o.index < end), key=lambda o: o.index)
    if given and [o.index for o in given] == list(range(first, first + len(given))):
        last = given[-1].index + 1
        return given, ([[last, end]] if last < end else [])
    error = res.envelope.get("error") or {
        "code": "BATCH_INCOMPLETE", "message": "the worker's result of the batch has no outcome for this iteration"}
    missing = {"status": "error", "reference": None, "parent_ref": None, "context": None, "error": error}
    by_index = {o.index: o for o in given}
    return [by_index.get(i) or IterationOutcome(i, missing) for i in range(first, end)], []


def _error_brief(envelope: Mapping[str, Any]) -> dict[str, Any]:
    error = envelope.get("error") or {}
    return {"code": str(error.get("code") or ""), "message": str(error.get("message") or "")[:300]}


def _error_text(envelope: Mapping[str, Any]) -> str:
    err = envelope.get("error") or {}
    msg = err.get("message") or "unknown error"
    code = err.get("code")
    exception_type = err.get("exception_type")
    if exception_type and code in ("TOOL_ERROR", None, ""):
        return f"{exception_type}: {msg}"
    return f"{code}: {msg}" if code and code not in ("TOOL_ERROR",) else str(msg)


def _apply_set(ctx: dict[str, Any], rendered: Mapping[str, Any]) -> None:
    """Apply a rendered ``set`` mapping: ``ctx.a.b`` (or bare ``a``) keys update ctx."""
    for key, value in rendered.items():
        path = key[4:] if key.startswith("ctx.") else key
        if key.startswith(("iter.", "_")):
            continue
        set_path(ctx, path, value)


def _apply_updates(ctx: dict[str, Any], updates: Mapping[str, Any]) -> None:
    for key, value in updates.items():
        set_path(ctx, key, value)


def _timeout(step: Step) -> float:
    tool = step.raw_tool if isinstance(step.raw_tool, dict) else {}
    for source in (tool, tool.get("spec") or {}, step.spec or {}):
        for key in ("timeout", "timeout_s", "timeout_sec"):
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, int | float) and value > 0:
                return float(value)
    return 0.0
