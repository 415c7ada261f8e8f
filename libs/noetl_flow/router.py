"""Routing: fold one input into an execution's state and decide what happens next.

Pure functions over (playbook, workload, state, input, resolved values): no I/O.
The engine prepares ``values`` (full results of the steps a template names, see
``Flow.needs``) before calling, so evaluating ``when``/``set`` never touches storage.

Rules (NoETL canonical DSL):
* A step completes when its command's first terminal result is accepted. Later
  results for the same command id are recorded as ``call.duplicate`` and ignored.
* On success: worker ``set`` updates (task policies), then the step's ``set``, then
  ``next.arcs`` (``exclusive``: the first arc whose ``when`` holds; ``inclusive``:
  every such arc), each arc's ``set`` applied before its target is entered.
* On failure: arcs are evaluated with ``event.name == 'call.error'``; only arcs with
  a ``when`` can fire. If none fires, the execution fails naming the step.
* A step without ``next`` routes to the step named ``end`` when one exists
  (implicit end); otherwise its branch ends.
* Fan-in: a step with two or more predecessors is *armed* when an arc reaches it and
  dispatched once no running step can still reach it (a barrier over every branch
  that was actually taken).
* The execution completes when nothing is running and nothing is armed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from noetl_dsl import Playbook, Step, predecessors, reachable_from
from noetl_dsl.templates import (
    RenderContext,
    TemplateError,
    evaluate_when,
    referenced_names,
    render,
    set_path,
)

from .state import (
    CANCELLED,
    COMPLETED,
    FAILED,
    STEP_CANCELLED,
    STEP_DONE,
    STEP_FAILED,
    STEP_RUNNING,
    ExecState,
    Pending,
    StepRun,
)
from .transitions import CallResultInput, CommandUpdate, NewCommand, StartInput, Transition

EV_STARTED = "playbook.started"
EV_COMPLETED = "playbook.completed"
EV_FAILED = "playbook.failed"
EV_CANCELLED = "playbook.cancelled"
EV_STEP_ENTER = "step.enter"
EV_CALL_DONE = "call.done"
EV_CALL_ERROR = "call.error"
EV_DUPLICATE = "call.duplicate"
EV_REISSUED = "command.reissued"
EV_DEAD = "command.dead_lettered"


class Flow:
    """Routing for one playbook version (cache one per catalog id)."""

    def __init__(self, playbook: Playbook) -> None:
        self.pb = playbook
        preds = predecessors(playbook)
        self.joins = {name for name, p in preds.items() if len(p) >= 2}
        self.reach = {name: reachable_from(playbook, name) for name in playbook.step_names}
        self.step_names = list(playbook.step_names)
        self._needs_cache: dict[str, frozenset[str]] = {}

    # ------------------------------------------------------------ inputs

    def start(self, inp: StartInput, workload: Mapping[str, Any]) -> Transition:
        state = ExecState(execution_id=inp.execution_id, shard_id=inp.shard_id, catalog_id=inp.catalog_id,
                          deadline_ms=inp.deadline_ms, parent_execution_id=inp.parent_execution_id)
        t = Transition(state)
        t.emit(EV_STARTED, meta=dict(inp.meta))
        self._enter(t, self.pb.start_step, {"name": EV_STARTED, "step": None})
        self._settle(t)
        return t

    def needs(self, state: ExecState, res: CallResultInput) -> dict[str, dict[str, Any] | None]:
        """Step results the templates evaluated for this input will read:
        {step name: reference or None}. The engine resolves them into ``values``."""
        pending = state.pending.get(res.command_id)
        if pending is None or state.terminal:
            return {}
        names = self._template_names(pending.step)
        out: dict[str, dict[str, Any] | None] = {}
        for name in names:
            if name == pending.step:
                out[name] = res.envelope.get("reference")
            elif name in state.steps and state.steps[name].result is not None:
                out[name] = (state.steps[name].result or {}).get("reference")
        return out

    def on_result(self, state: ExecState, res: CallResultInput, workload: Mapping[str, Any],
                  values: Mapping[str, Any]) -> Transition:
        t = Transition(copy.deepcopy(state))
        st = t.state
        pending = st.pending.get(res.command_id)
        ok = res.envelope.get("status") != "error"
        if pending is None or st.terminal:
            t.emit(EV_DUPLICATE, step=None, command_id=res.command_id, result=res.envelope,
                   meta={"attempt": res.attempt, "worker": res.worker_id,
                         "reason": "terminal" if st.terminal else "not pending"})
            return t
        step_name = pending.step
        run = st.steps[step_name]
        del st.pending[res.command_id]
        t.emit(EV_CALL_DONE if ok else EV_CALL_ERROR, step=step_name, command_id=res.command_id,
               result=res.envelope, meta={"attempt": res.attempt, "worker": res.worker_id})
        t.updates.append(CommandUpdate(res.command_id, "done" if ok else "failed"))
        run.result = res.envelope
        run.status = STEP_DONE if ok else STEP_FAILED
        run.error = None if ok else _error_text(res.envelope)
        _apply_updates(st.ctx, (res.set_updates or {}).get("ctx") or {})
        try:
            self._route(t, step_name, ok, workload, values)
        except TemplateError as exc:
            self._fail(t, f"step '{step_name}': {exc}")
            return t
        self._settle(t)
        return t

    def on_cancel(self, state: ExecState, reason: str) -> Transition:
        t = Transition(copy.deepcopy(state))
        if t.state.terminal:
            return t
        self._finish(t, CANCELLED, EV_CANCELLED, reason or "cancelled by request")
        return t

    def on_timeout(self, state: ExecState, now_ms: int) -> Transition:
        t = Transition(copy.deepcopy(state))
        st = t.state
        if st.terminal or st.deadline_ms is None or now_ms < st.deadline_ms:
            return t
        self._fail(t, "execution timed out (deadline passed while steps were still running: "
                      f"{', '.join(sorted(st.active_steps())) or 'none'})")
        return t

    def on_expired(self, state: ExecState, command_id: str, attempt: int, max_attempts: int,
                   reason: str) -> Transition:
        """A command's claim lease expired (worker lost) or it was never claimed."""
        t = Transition(copy.deepcopy(state))
        st = t.state
        pending = st.pending.get(command_id)
        if st.terminal or pending is None or pending.attempt != attempt:
            return t
        run = st.steps[pending.step]
        if attempt < max_attempts:
            pending.attempt = attempt + 1
            run.attempt = attempt + 1
            t.emit(EV_REISSUED, step=pending.step, command_id=command_id,
                   meta={"attempt": attempt + 1, "reason": reason})
            t.updates.append(CommandUpdate(command_id, "queued", attempt=attempt + 1))
            t.republish.append((command_id, attempt + 1, self._kind(self.pb.step(pending.step))))
            return t
        del st.pending[command_id]
        message = f"step '{pending.step}' command {command_id} dead-lettered after {attempt} attempts ({reason})"
        t.emit(EV_DEAD, step=pending.step, command_id=command_id,
               result={"status": "error", "error": {"code": "DEAD_LETTERED", "message": message}},
               meta={"attempt": attempt, "reason": reason})
        t.updates.append(CommandUpdate(command_id, "dead"))
        run.status = STEP_FAILED
        run.error = message
        self._fail(t, message)
        return t

    # ------------------------------------------------------------ routing

    def _route(self, t: Transition, step_name: str, ok: bool, workload: Mapping[str, Any],
               values: Mapping[str, Any]) -> None:
        st = t.state
        step = self.pb.step(step_name)
        event = {"name": EV_CALL_DONE if ok else EV_CALL_ERROR, "step": step_name}
        scope = self._scope(st, workload, values, event)
        if ok and step.set:
            _apply_set(st.ctx, render(step.set, scope))
            scope = self._scope(st, workload, values, event)
        fired = 0
        for arc in self._arcs(step):
            if not ok and arc.when is None:
                continue
            if not evaluate_when(arc.when, scope):
                continue
            fired += 1
            if arc.set:
                _apply_set(st.ctx, render(arc.set, scope))
                scope = self._scope(st, workload, values, event)
            self._arrive(t, arc.step, event)
            if step.next_mode == "exclusive":
                break
        if not ok and fired == 0:
            self._fail(t, f"step '{step_name}' failed: {st.steps[step_name].error}")

    def _arcs(self, step: Step) -> list[Any]:
        if step.arcs:
            return list(step.arcs)
        if step.step != "end" and "end" in self.reach:
            return [_ImplicitArc("end")]
        return []

    def _arrive(self, t: Transition, target: str, event: dict[str, Any]) -> None:
        if target in self.joins:
            if target not in t.state.armed:
                t.state.armed.append(target)
            return
        self._enter(t, target, event)

    def _enter(self, t: Transition, name: str, event: dict[str, Any]) -> None:
        st = t.state
        step = self.pb.step(name)
        run = st.steps.setdefault(name, StepRun())
        run.visits += 1
        run.status = STEP_RUNNING
        run.attempt = 1
        run.result = None
        run.error = None
        command_id = f"{st.execution_id}:{name}:{run.visits}"
        run.command_id = command_id
        st.pending[command_id] = Pending(step=name, attempt=1)
        kind = self._kind(step)
        context = {
            "ctx": copy.deepcopy(st.ctx),
            "steps": {n: r.result for n, r in st.steps.items() if r.result is not None},
            "event": {"name": event.get("name"), "step": event.get("step")},
            "iter": None,
        }
        t.commands.append(NewCommand(command_id, name, kind, 1, context, _timeout(step)))
        t.emit(EV_STEP_ENTER, step=name, command_id=command_id,
               meta={"visit": run.visits, "attempt": 1, "kind": kind})

    def _settle(self, t: Transition) -> None:
        """Release fan-in barriers nobody can reach any more; complete when idle."""
        st = t.state
        if st.terminal:
            return
        progressed = True
        while progressed and st.armed:
            progressed = False
            active = st.active_steps()
            for target in list(st.armed):
                if not any(target in self.reach.get(a, ()) for a in active if a != target):
                    st.armed.remove(target)
                    self._enter(t, target, {"name": "fanin", "step": target})
                    progressed = True
        if not st.pending and not st.armed:
            self._finish(t, COMPLETED, EV_COMPLETED, None)

    def _fail(self, t: Transition, message: str) -> None:
        self._finish(t, FAILED, EV_FAILED, message)

    def _finish(self, t: Transition, status: str, event_type: str, message: str | None) -> None:
        st = t.state
        st.status = status
        st.error = message
        for command_id, pending in list(st.pending.items()):
            t.updates.append(CommandUpdate(command_id, "cancelled"))
            st.steps[pending.step].status = STEP_CANCELLED
        st.pending.clear()
        st.armed.clear()
        result = None
        if message:
            code = "CANCELLED" if status == CANCELLED else "EXECUTION_FAILED"
            result = {"status": "error" if status == FAILED else "cancelled",
                      "error": {"code": code, "message": message}}
        t.emit(event_type, result=result)

    # ------------------------------------------------------------ helpers

    def _scope(self, st: ExecState, workload: Mapping[str, Any], values: Mapping[str, Any],
               event: dict[str, Any]) -> RenderContext:
        data: dict[str, Any] = dict(workload)
        data.update(values)
        data.update(workload=dict(workload), ctx=st.ctx, execution_id=st.execution_id, event=event)
        return RenderContext(data, known=self.step_names)

    def _template_names(self, step_name: str) -> frozenset[str]:
        cached = self._needs_cache.get(step_name)
        if cached is None:
            step = self.pb.step(step_name)
            names = referenced_names(step.set or {})
            for arc in step.arcs:
                names |= referenced_names(arc.when) | referenced_names(arc.set or {})
            cached = frozenset(n for n in names if n in self.reach)
            self._needs_cache[step_name] = cached
        return cached

    @staticmethod
    def _kind(step: Step) -> str:
        tasks = step.tasks
        return tasks[0].kind if len(tasks) == 1 and not step.is_pipeline else "pipeline"


class _ImplicitArc:
    __slots__ = ("step",)
    when = None
    set = None

    def __init__(self, step: str) -> None:
        self.step = step


def _error_text(envelope: Mapping[str, Any]) -> str:
    err = envelope.get("error") or {}
    msg = err.get("message") or "unknown error"
    code = err.get("code")
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
