"""Task pipelines and task policies (pure logic: tools are passed in).

A step's ``tool`` is one task or a list of tasks; both run here as a pipeline, in order,
inside one command. After each task its ``spec.policy.rules`` decide what happens:

    rules: [{when: "<template>", then: {...}}, ..., {else: {then: {...}}}]
    then:  do: continue (default) | retry | jump | break | fail
           attempts: N (retry: total attempts), backoff: none|fixed|linear|exponential,
           delay: seconds (capped at 30), to: <task name> (jump),
           set: {ctx.X: tpl, iter.X: tpl, name: tpl}

The first rule whose ``when`` holds (an ``else`` rule holds when reached) wins; with
no rule matching, an ok outcome continues and an error fails. A retry whose attempts
are spent falls back to that default. Rule templates see the render scope plus
``output`` (status/data/error/http), ``_prev`` (the previous task's data), ``_task``,
``_attempt`` (1-based), ``ctx`` and ``iter`` (with this pipeline's updates). ``set``
keys ``ctx.X`` / ``iter.X`` update the execution / iteration scope (reported to the
engine); other keys define variables later tasks can read, as they read earlier
tasks' results by task name. A task-level ``set`` (outside the policy) is applied once
the task is done (unless it fails the pipeline); there, as upstream, ``output`` is the
task's raw result (``{{ output.x }}`` reads the result's ``x``), not the policy's
envelope. The pipeline's value is the data of the last task that ran.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from noetl_dsl.templates import RenderContext, TemplateError, evaluate_when, render, set_path

from .tools.outcome import INVALID_TASK, POLICY_FAIL, TEMPLATE_ERROR, ErrorDetail, ToolOutcome

MAX_DELAY_SEC = 30.0
DEFAULT_ATTEMPTS = 3
DEFAULT_DELAY_SEC = 1.0
MAX_RUNS = 10_000
ACTIONS = ("continue", "retry", "jump", "break", "fail")


@dataclass(frozen=True, slots=True)
class Action:
    do: str = "continue"
    attempts: int = DEFAULT_ATTEMPTS
    backoff: str = "fixed"
    delay: float = DEFAULT_DELAY_SEC
    to: str | None = None
    set: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class TaskRun:
    """One executed attempt of one task."""

    name: str
    index: int
    attempt: int
    task: Mapping[str, Any]
    outcome: ToolOutcome


@dataclass(slots=True)
class PipelineResult:
    status: str  # "ok" | "error"
    data: Any
    error: ErrorDetail | None
    last: TaskRun | None
    set_updates: dict[str, dict[str, Any]]
    stopped_by: str  # "end" | "break" | "fail"
    runs: int


TaskFn = Callable[[Mapping[str, Any], RenderContext], Awaitable[ToolOutcome]]
ResultHook = Callable[[TaskRun], Awaitable[None]]


def task_names(tasks: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each task's ``name`` (``task_<index>`` when it has none, 0-based, as the DSL names them)."""
    return [str(t.get("name") or f"task_{i}") for i, t in enumerate(tasks)]


def rules_of(task: Mapping[str, Any]) -> list[Any]:
    for holder in (task.get("spec"), task):
        policy = holder.get("policy") if isinstance(holder, Mapping) else None
        if isinstance(policy, Mapping) and isinstance(policy.get("rules"), list):
            return list(policy["rules"])
    return []


def parse_action(then: Any) -> Action:
    if not isinstance(then, Mapping):
        return Action()
    raw_set = then.get("set")
    return Action(
        do=str(then.get("do") or "continue").lower(),
        attempts=int(then.get("attempts", then.get("max_attempts", DEFAULT_ATTEMPTS))),
        backoff=str(then.get("backoff") or "fixed").lower(),
        delay=float(then.get("delay", DEFAULT_DELAY_SEC)),
        to=str(then["to"]) if then.get("to") is not None else None,
        set=dict(raw_set) if isinstance(raw_set, Mapping) else {},
    )


def _else_then(rule: Mapping[str, Any]) -> Any:
    branch = rule.get("else")
    if isinstance(branch, Mapping):
        return branch["then"] if "then" in branch else branch
    return rule.get("then")


def decide(rules: Sequence[Any], scope: Mapping[str, Any]) -> Action | None:
    """The action of the first matching rule, or None when none matches."""
    for rule in rules:
        if not isinstance(rule, Mapping):
            continue
        if "else" in rule:
            return parse_action(_else_then(rule))
        if "when" in rule and evaluate_when(rule["when"], scope):
            return parse_action(rule.get("then"))
    return None


def backoff_delay(action: Action, attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based), capped at 30."""
    base = max(0.0, action.delay)
    if action.backoff == "none":
        return 0.0
    if action.backoff == "linear":
        wait = base * attempt
    elif action.backoff == "exponential":
        wait = base * (2 ** (attempt - 1))
    else:
        wait = base
    return min(wait, MAX_DELAY_SEC)


class _State:
    """The mutable scope of one pipeline run."""

    def __init__(self, scope: RenderContext) -> None:
        self.known = scope.known
        self.vars: dict[str, Any] = dict(scope)
        self.ctx: dict[str, Any] = copy.deepcopy(dict(scope.get("ctx") or {}))
        self.iter: dict[str, Any] = copy.deepcopy(dict(scope.get("iter") or {}))
        self.ctx_updates: dict[str, Any] = {}
        self.iter_updates: dict[str, Any] = {}
        self.prev: Any = None

    def task_scope(self, name: str, attempt: int) -> RenderContext:
        return RenderContext({**self.vars, "ctx": self.ctx, "iter": self.iter, "_prev": self.prev,
                              "_task": name, "_attempt": attempt}, known=self.known)

    def apply_set(self, mapping: Mapping[str, Any], scope: Mapping[str, Any]) -> None:
        rendered = {str(k): render(v, scope) for k, v in mapping.items()}
        for key, value in rendered.items():
            if key.startswith("ctx."):
                set_path(self.ctx, key[4:], value)
                self.ctx_updates[key[4:]] = value
            elif key.startswith("iter."):
                set_path(self.iter, key[5:], value)
                self.iter_updates[key[5:]] = value
            else:
                self.vars[key] = value

    def result(self, status: str, last: TaskRun | None, error: ErrorDetail | None, stopped_by: str,
               runs: int) -> PipelineResult:
        return PipelineResult(status, last.outcome.data if last else None, error, last,
                              {"ctx": self.ctx_updates, "iter": self.iter_updates}, stopped_by, runs)


async def run_pipeline(tasks: Sequence[Mapping[str, Any]], scope: RenderContext, run_task: TaskFn, *,
                       on_result: ResultHook | None = None,
                       sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                       max_runs: int = MAX_RUNS) -> PipelineResult:
    """Run ``tasks`` with their policies. ``run_task(task, scope)`` runs one attempt;
    ``on_result`` sees every attempt before its policy is evaluated (the runner persists
    results there; an exception from it stops the pipeline and propagates)."""
    names = task_names(tasks)
    index_of = {n: i for i, n in reversed(list(enumerate(names)))}
    state = _State(scope)
    last: TaskRun | None = None
    runs = 0
    i, attempt = 0, 1

    def failed(code: str, message: str, kind: str) -> PipelineResult:
        return state.result("error", last, ErrorDetail(code, message, kind), "fail", runs)

    while i < len(tasks):
        runs += 1
        if runs > max_runs:
            return failed(INVALID_TASK, f"pipeline ran more than {max_runs} tasks (a jump loop?)", "PipelineLimit")
        task, name = tasks[i], names[i]
        task_scope = state.task_scope(name, attempt)
        outcome = await run_task(task, task_scope)
        last = TaskRun(name, i, attempt, task, outcome)
        if on_result is not None:
            await on_result(last)
        rule_scope = RenderContext({**task_scope, "output": outcome.to_output()}, known=state.known)
        try:
            action = decide(rules_of(task), rule_scope)
            if action is not None and action.set:
                state.apply_set(action.set, rule_scope)
        except TemplateError as exc:
            return failed(TEMPLATE_ERROR, f"task '{name}' policy: {exc}", "TemplateError")
        except (TypeError, ValueError) as exc:
            return failed(INVALID_TASK, f"task '{name}' policy: {exc}", type(exc).__name__)
        do = action.do if action is not None else ("continue" if outcome.ok else "fail")
        if do == "retry":
            assert action is not None
            if attempt < action.attempts:
                await sleep(backoff_delay(action, attempt))
                attempt += 1
                continue
            do = "continue" if outcome.ok else "fail"

        # The task is done: publish its result to later tasks, apply its own `set`.
        state.vars[name] = outcome.data
        state.prev = outcome.data
        task_set = task.get("set")
        if isinstance(task_set, Mapping) and task_set and do != "fail":
            # Upstream binds a task's own `set` to its raw result: `{{ output }}` is the
            # value the tool returned (what `{{ <task name> }}` reads), not the envelope.
            set_scope = RenderContext({**state.task_scope(name, attempt), "output": outcome.data},
                                      known=state.known)
            try:
                state.apply_set(task_set, set_scope)
            except TemplateError as exc:
                return failed(TEMPLATE_ERROR, f"task '{name}' set: {exc}", "TemplateError")

        if do == "continue":
            i, attempt = i + 1, 1
        elif do == "jump":
            target = action.to if action is not None else None
            if target not in index_of:
                return failed(INVALID_TASK, f"task '{name}' policy: jump target task {target!r} not found",
                              "ValueError")
            i, attempt = index_of[target], 1
        elif do == "break":
            return state.result("ok", last, None, "break", runs)
        elif do == "fail":
            error = outcome.error or ErrorDetail(POLICY_FAIL, f"task '{name}' failed by policy", "PolicyFail")
            return state.result("error", last, error, "fail", runs)
        else:
            return failed(INVALID_TASK, f"task '{name}' policy: unknown action {do!r} "
                          f"(expected one of {', '.join(ACTIONS)})", "ValueError")
    return state.result("ok", last, None, "end", runs)
