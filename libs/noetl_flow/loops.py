"""Loop steps (seed 003; ARCHITECTURE.md section 8), as pure functions over the state.

Collection loop (``loop.in`` + ``iterator``, ``spec.mode`` sequential | parallel):
  * ``loop.in`` is rendered ONCE when the step is entered; the items go to the engine as
    ``Transition.loop_items`` (stored in ``noetl.loop_item``), never re-rendered;
  * iterations are dispatched up to ``max_in_flight`` (1 when sequential; a template there is
    rendered when the loop starts, with the same scope as ``loop.in``), each a command
    ``{execution}:{step}:{visit}:{index}`` whose item the api attaches at claim time;
  * each accepted iteration result is one ``call.done``/``call.error`` event plus a row in
    ``noetl.loop_result`` (ordered by index), so the engine holds counters only;
  * when the last one is in, ``loop.done`` (exactly once per loop instance) carries a
    reference of type ``loop`` to the ordered results, and the step routes its arcs.

Cursor loop (``loop.cursor`` or ``spec.mode: cursor``): the claim SQL is rendered ONCE,
``max_in_flight`` slot commands (kind ``cursor``) each claim rows until none is left;
``loop.done`` fires when the last slot drains.

A loop step's value, as later steps see it, is
``{"results": [...in iteration order...], "stats": {"total", "success", "failed"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from noetl_common.vocab import EventType
from noetl_common.vocab import command_id as make_command_id
from noetl_dsl import Step
from noetl_dsl.templates import RenderContext, TemplateError, referenced_names, render, render_text

from .state import LoopRun, StepRun
from .transitions import Transition

if TYPE_CHECKING:
    from .router import Flow, Inputs



class LoopError(TemplateError):
    """A loop's collection or cursor spec is unusable (the step fails with this message)."""

    def __init__(self, message: str) -> None:
        self.template = ""
        self.message = message
        Exception.__init__(self, message)

DEFAULT_PARALLEL = 16
CURSOR_KIND = "cursor"
# Iterations per command of a parallel loop (batch_size): at most NOETL_EXECUTION_LOOP_BATCH_MAX,
# and about 1 / BATCH_SHARE of what each lane has left.
DEFAULT_BATCH_MAX = 32
BATCH_SHARE = 2
# Once a loop has seen how long its iterations take (LoopRun.iteration_ms, from its
# batches' results), a batch is at least as many iterations as run in about this long
# (NOETL_EXECUTION_LOOP_BATCH_MS; 0: guided self-scheduling alone): a batch shorter than
# that saves less imbalance at the loop's end than its command costs.
DEFAULT_BATCH_MS = 100
# Weight of the newest batch in LoopRun.iteration_ms (an exponential moving average).
PACE_WEIGHT = 0.5
# Kinds whose iterations each run as their own command: a sub-playbook is an execution.
UNBATCHED_KINDS = frozenset({"playbook", CURSOR_KIND})
BATCHED_MODES = frozenset({"parallel", "sequential"})


def template_names(step: Step) -> set[str]:
    """Names the loop's collection / cursor templates read (rendered at entry)."""
    assert step.loop is not None
    names = referenced_names(step.loop.in_) | referenced_names(step.loop.max_in_flight)
    if step.loop.cursor:
        names |= referenced_names(step.loop.cursor)
    return names


def width(step: Step, scope: RenderContext, default: int) -> int:
    """``loop.spec.max_in_flight``: the int, or its template rendered now (the loop is
    starting); a LoopError (the step fails) unless it is a positive integer."""
    assert step.loop is not None
    raw = step.loop.max_in_flight
    if raw is None:
        return default
    if isinstance(raw, int):
        return raw
    value = render(raw, scope)
    try:
        rendered = int(value) if not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        rendered = 0
    if rendered < 1:
        raise LoopError(f"loop.spec.max_in_flight of step '{step.step}' rendered to {value!r}, "
                        "expected a positive integer")
    return rendered


def is_cursor(step: Step) -> bool:
    return step.loop is not None and (step.loop.cursor is not None or step.loop.mode == "cursor")


def start(flow: Flow, t: Transition, step: Step, run: StepRun, event: dict[str, Any],
          scope: RenderContext) -> bool | None:
    """Enter a loop step. Returns None while iterations run, or the loop's outcome (ok)
    when there is nothing to run (an empty collection)."""
    loop = step.loop
    assert loop is not None
    instance = f"{step.step}:{run.visits}"
    iterator = loop.iterator or "item"
    if is_cursor(step):
        cursor = dict(loop.cursor or {})
        if not cursor.get("claim"):
            raise LoopError(f"loop.cursor of step '{step.step}' needs a 'claim' statement")
        rendered = {
            "kind": str(cursor.get("kind") or "postgres"),
            # `credential:` is accepted where `auth:` is
            "auth": render(cursor.get("auth") if cursor.get("auth") is not None else cursor.get("credential"), scope),
            "claim": render_text(str(cursor["claim"]), scope),
            "options": render(cursor.get("options") or {}, scope),
        }
        slots = width(step, scope, 1)
        run.loop = LoopRun(instance=instance, mode="cursor", iterator=iterator, total=slots, max_in_flight=slots,
                           cursor=rendered)
        t.emit(EventType.STEP_ENTER, step=step.step,
               meta={"visit": run.visits, "loop_instance": instance, "mode": "cursor", "total": slots})
    else:
        items = _collection(render(loop.in_, scope), step.step, flow.max_loop_items)
        mode = loop.mode if loop.mode in ("sequential", "parallel") else "sequential"
        in_flight = 1 if mode == "sequential" else width(step, scope, DEFAULT_PARALLEL)
        run.loop = LoopRun(instance=instance, mode=mode, iterator=iterator, total=len(items),
                           max_in_flight=in_flight)
        t.loop_items.append((instance, items))
        t.emit(EventType.STEP_ENTER, step=step.step,
               meta={"visit": run.visits, "loop_instance": instance, "mode": mode, "total": len(items)})
    if run.loop.total == 0:
        return finish(t, step.step, run)
    _refill(flow, t, step.step, run, event)
    return None


def resume(flow: Flow, t: Transition, step: Step, run: StepRun, original_eid: int, original: LoopRun,
           kept: int, todo: list[list[int]], event: dict[str, Any]) -> bool | None:
    """Enter a rerun loop step keeping its original's successful iterations (rerun.py):
    the original's items and the ``kept`` successful results are copied (references) into
    the new instance, and only the ``todo`` ranges are dispatched. Returns the loop's
    outcome when nothing is left to run, else None."""
    instance = f"{step.step}:{run.visits}"
    run.loop = LoopRun(instance=instance, mode=original.mode, iterator=original.iterator, total=original.total,
                       max_in_flight=original.max_in_flight, next_index=original.total, done=kept,
                       todo=[list(r) for r in todo])
    t.loop_copies.append((original_eid, original.instance, instance))
    t.emit(EventType.STEP_ENTER, step=step.step,
           meta={"visit": run.visits, "loop_instance": instance, "mode": original.mode, "total": original.total,
                 "kept": kept, "resumed_from": f"{original_eid}/{original.instance}"})
    if run.loop.finished:
        return finish(t, step.step, run)
    _refill(flow, t, step.step, run, event)
    return None


def on_command_done(flow: Flow, t: Transition, step_name: str, run: StepRun,
                    iterations: list[tuple[int, Mapping[str, Any]]], io: Inputs,
                    returned: list[list[int]] | None = None,
                    summary: Mapping[str, Any] | None = None) -> bool | None:
    """Fold the accepted result of one loop command: its iterations' envelopes in index
    order (one, or a batch's), the ``returned`` index ranges of a batch the worker did not
    get to (dispatched again, next), and a batch's ``summary`` (its envelope's context:
    the pace, ``observe_pace``). Returns the loop's outcome when this was the last
    command, else None (more were dispatched if any remain)."""
    lr = run.loop
    assert lr is not None
    lr.in_flight -= 1
    observe_pace(lr, summary)
    if returned:
        lr.todo = [*(lr.todo or []), *(list(r) for r in returned)]
    for index, envelope in iterations:
        ok = _count(lr, envelope)
        ref = envelope.get("reference") or {}
        t.loop_results.append((lr.instance, index, "ok" if ok else "error", ref.get("ref_id")))
    if lr.finished:
        io.values.setdefault(step_name, {"stats": lr.stats()})
        return finish(t, step_name, run)
    if not t.state.terminal:
        _refill(flow, t, step_name, run, {"name": EventType.LOOP_NEXT, "step": step_name})
    return None


def finishing(lr: LoopRun, envelopes: list[Mapping[str, Any]]) -> dict[str, int] | None:
    """The loop's stats if this command's result (its iterations' envelopes) is the last
    one (None while more are to come)."""
    if lr.in_flight != 1 or not lr.exhausted:
        return None
    after = LoopRun(**{**lr.__dict__})
    after.in_flight = 0
    for envelope in envelopes:
        _count(after, envelope)
    return after.stats()


def _count(lr: LoopRun, envelope: Mapping[str, Any]) -> bool:
    """Count one iteration's (or cursor slot's) accepted result into the loop; whether it is ok."""
    ok = envelope.get("status") != "error"
    if ok:
        lr.done += 1
    else:
        lr.failed += 1
    if lr.mode == "cursor":
        context = envelope.get("context") or {}
        lr.rows += int(context.get("processed") or 0)
        lr.rows_failed += int(context.get("failed") or 0)
    return ok


def finish(t: Transition, step_name: str, run: StepRun) -> bool:
    """Emit ``loop.done`` with a reference to the ordered results; returns ok."""
    lr = run.loop
    assert lr is not None
    stats = lr.stats()
    failed_units = lr.failed + (lr.rows_failed if lr.mode == "cursor" else 0)
    ok = failed_units == 0
    envelope: dict[str, Any] = {
        "status": "ok" if ok else "error",
        "reference": {"ref_id": None, "type": "loop", "uri": f"loop://{t.state.execution_id}/{lr.instance}"},
        "parent_ref": None,
        "context": dict(stats),
    }
    if not ok:
        what = "row(s)" if lr.mode == "cursor" and lr.rows_failed else "iteration(s)"
        count = lr.rows_failed if what == "row(s)" else lr.failed
        total = stats["total"] if what == "row(s)" else lr.total
        envelope["error"] = {"code": "LOOP_FAILED", "message": f"{count} of {total} {what} failed"}
    t.set_result(run, envelope)
    t.loop_refs.append((lr.instance, step_name, envelope))
    meta: dict[str, Any] = {"loop_instance": lr.instance, **stats}
    if t.state.redrives:  # loop.done is exactly once per loop instance and redrive generation
        meta["redrive"] = t.state.redrives
    t.emit(EventType.LOOP_DONE, step=step_name, result=envelope, meta=meta)
    return ok


def command_kind(flow: Flow, step_name: str, run: StepRun) -> str:
    """The kind of the step's commands: ``cursor`` for a cursor loop's slots, else the tool's."""
    if run.loop is not None and run.loop.mode == "cursor":
        return CURSOR_KIND
    return flow.kind(flow.pb.step(step_name))


def batch_size(lr: LoopRun, kind: str, most: int, target_ms: float = DEFAULT_BATCH_MS) -> int:
    """How many iterations the next command of a collection loop runs, one after the other
    (its worker runs them in index order: ``max_in_flight`` still bounds the iterations
    running at once). Guided self-scheduling: a share of what is left per lane,
    ``ceil(undispatched / (BATCH_SHARE * max_in_flight))``, at most ``most``
    (NOETL_EXECUTION_LOOP_BATCH_MAX), so batches shrink as the loop ends and a slow
    iteration holds back few others. They shrink no further than the iterations that run in
    ``target_ms`` at the pace the loop's batches have shown (``LoopRun.iteration_ms``):
    fast iterations keep sharing commands to the end, slow ones still end one per command.
    A sequential loop's batch is still one iteration at a time, in index order: its worker
    hands each iteration ``ctx`` as the previous one left it (``noetl_worker.runner``), as
    the engine would between commands. Cursor slots and sub-playbooks run one per command."""
    if most <= 1 or lr.mode not in BATCHED_MODES or kind in UNBATCHED_KINDS:
        return 1
    share = -(-lr.undispatched // (BATCH_SHARE * lr.max_in_flight))
    pace = lr.iteration_ms
    if pace is not None and target_ms > 0:
        share = max(share, most if pace <= 0 else int(target_ms / pace))
    return max(1, min(most, share))


def observe_pace(lr: LoopRun, summary: Mapping[str, Any] | None) -> None:
    """Fold a batch's pace into ``lr.iteration_ms``: the time its worker spent on it
    (``context.ms`` of the batch's summary envelope, ``runner.execute_command``: its wall
    time, or for a python lane that time without the lanes sharing the cores) over the
    iterations it ran (``context.count``). It only sizes later batches (``batch_size``
    bounds them whatever it says), and it is in the engine's state, so a replay of the same
    results sizes the same batches."""
    if not isinstance(summary, Mapping):
        return
    try:
        count, ms = int(summary["count"]), float(summary["ms"])
    except (KeyError, TypeError, ValueError):
        return
    if count < 1 or not 0 <= ms < 1e9:  # also refuses NaN
        return
    pace = ms / count
    lr.iteration_ms = round(pace if lr.iteration_ms is None
                            else PACE_WEIGHT * pace + (1 - PACE_WEIGHT) * lr.iteration_ms, 3)


def loop_context(lr: LoopRun, index: int, count: int = 1) -> dict[str, Any]:
    """A loop command's ``context.loop``: its instance, first index (and ``count`` for a
    batch), iterator and mode (the api attaches the items from it at claim time)."""
    ctx: dict[str, Any] = {"instance": lr.instance, "index": index, "iterator": lr.iterator, "mode": lr.mode}
    if count > 1:
        ctx["count"] = count
    return ctx


def _refill(flow: Flow, t: Transition, step_name: str, run: StepRun, event: dict[str, Any]) -> None:
    lr = run.loop
    assert lr is not None
    kind = command_kind(flow, step_name, run)
    while lr.in_flight < lr.max_in_flight and not lr.exhausted:
        index, count = lr.take(batch_size(lr, kind, flow.loop_batch, flow.loop_batch_ms))
        lr.in_flight += 1
        command_id = make_command_id(t.state.execution_id, step_name, run.visits, index, count)
        extra: dict[str, Any] = {"loop": loop_context(lr, index, count)}
        if lr.mode == "cursor":
            extra["cursor"] = lr.cursor
        flow.dispatch(t, step_name, command_id, kind, event, extra, index=index, count=count)


def _collection(value: Any, step: str, max_items: int) -> list[Any]:
    """The items of a rendered ``loop.in``; a LoopError (the step fails) for anything
    that is not a collection, or has more than ``max_items`` (NOETL_LIMIT_LOOP_ITEMS),
    checked before a single item is copied."""
    if value is None:
        return []
    size = _size(value)
    if size is not None and size > max_items:
        raise LoopError(f"loop.in of step '{step}' has {size} items; limit NOETL_LIMIT_LOOP_ITEMS={max_items}")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise LoopError(f"loop.in of step '{step}' rendered to a string that is not a JSON list") from exc
        if (size := _size(value)) is not None and size > max_items:
            raise LoopError(f"loop.in of step '{step}' has {size} items; limit NOETL_LIMIT_LOOP_ITEMS={max_items}")
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, Mapping):
        return [{"key": k, "value": v} for k, v in value.items()]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return list(range(value))
    raise LoopError(f"loop.in of step '{step}' rendered to {type(value).__name__}, expected a list")


def _size(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list | tuple | Mapping):
        return len(value)
    return None
