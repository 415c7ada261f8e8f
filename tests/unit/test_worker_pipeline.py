"""Task pipelines and policies, with scripted fake tools (no processes, no servers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from noetl_dsl.templates import RenderContext
from noetl_worker.pipeline import Action, TaskRun, backoff_delay, decide, run_pipeline, task_names
from noetl_worker.tools import ToolOutcome


def ok(data: Any = None) -> ToolOutcome:
    return ToolOutcome.success(data)


def err(message: str = "boom", *, retryable: bool = False, data: Any = None) -> ToolOutcome:
    return ToolOutcome.failure("TOOL_ERROR", message, kind="Exception", retryable=retryable, data=data)


class Script:
    """A fake tool: each task name answers from its list of outcomes (the last repeats)."""

    def __init__(self, **outcomes: list[ToolOutcome]) -> None:
        self.outcomes = {k: list(v) for k, v in outcomes.items()}
        self.calls: list[tuple[str, int]] = []
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, task: Mapping[str, Any], scope: RenderContext) -> ToolOutcome:
        name = str(task["name"])
        self.calls.append((name, scope["_attempt"]))
        self.scopes.append(dict(scope))
        queue = self.outcomes[name]
        return queue.pop(0) if len(queue) > 1 else queue[0]


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def scope(**values: Any) -> RenderContext:
    return RenderContext({"ctx": {}, "iter": {}, **values}, known={"some_step"})


def rules(*items: Any) -> dict[str, Any]:
    return {"spec": {"policy": {"rules": list(items)}}}


# ---------------------------------------------------------------- defaults


async def test_single_task_ok() -> None:
    result = await run_pipeline([{"name": "t"}], scope(), Script(t=[ok({"a": 1})]))
    assert (result.status, result.data, result.error, result.stopped_by) == ("ok", {"a": 1}, None, "end")
    assert result.set_updates == {"ctx": {}, "iter": {}}


async def test_error_without_rules_fails_with_the_task_error() -> None:
    script = Script(a=[err("nope")], b=[ok()])
    result = await run_pipeline([{"name": "a"}, {"name": "b"}], scope(), script)
    assert result.status == "error" and result.error is not None
    assert result.error.message == "nope"
    assert script.calls == [("a", 1)]


def test_task_names_default() -> None:
    assert task_names([{"name": "x"}, {"kind": "python"}]) == ["x", "task_1"]


# ---------------------------------------------------------------- continue + set


async def test_vars_simple_set_ctx_keeps_native_types() -> None:
    """vars_test/test_vars_simple.yaml: else -> continue, set ctx from output.data."""
    task = {"name": "set_vars", **rules({"else": {"then": {"do": "continue", "set": {
        "ctx.test_counter": "{{ output.data.test_counter }}",
        "ctx.set_message": "{{ output.data.message }}"}}}})}
    data = {"status": "success", "test_counter": 42, "message": "Variable set successfully"}
    result = await run_pipeline([task], scope(), Script(set_vars=[ok(data)]))
    assert result.status == "ok"
    assert result.set_updates["ctx"] == {"test_counter": 42, "set_message": "Variable set successfully"}
    assert isinstance(result.set_updates["ctx"]["test_counter"], int)


async def test_ctx_updates_visible_to_later_tasks_and_nested_paths() -> None:
    first = {"name": "a", **rules({"when": True, "then": {"set": {"ctx.deep.x": "{{ output.data }}"}}})}
    script = Script(a=[ok(5)], b=[ok()])
    result = await run_pipeline([first, {"name": "b"}], scope(ctx={"keep": 1}), script)
    assert script.scopes[1]["ctx"] == {"keep": 1, "deep": {"x": 5}}
    assert result.set_updates["ctx"] == {"deep.x": 5}


async def test_later_tasks_see_earlier_results_prev_and_task_vars() -> None:
    """v10_canonical_example: task-level `set: validate_result: {{ output }}`."""
    validate = {"name": "validate", "set": {"validate_result": "{{ output }}"}}
    script = Script(validate=[ok({"count": 3})], transform=[ok("t")])
    result = await run_pipeline([validate, {"name": "transform"}], scope(), script)
    later = script.scopes[1]
    assert later["validate"] == {"count": 3}
    assert later["_prev"] == {"count": 3}
    assert later["_task"] == "transform"
    # upstream: a task-level `set` binds `output` to the task's raw result, not the envelope
    assert later["validate_result"] == {"count": 3}
    assert result.data == "t"


async def test_task_set_reads_fields_of_the_raw_result_while_policies_see_the_envelope() -> None:
    """A paginated fetch: the policy reads `output.data.*` (envelope), the task's own `set`
    reads `output.*` (the raw result); both bind the same values."""
    fetch = {"name": "fetch", "set": {"page": "{{ output.page }}", "rows": "{{ output.rows }}",
                                      "ctx.last_page": "{{ output.page }}"},
             **rules({"when": "{{ output.status == 'ok' and output.data.page == 2 }}",
                      "then": {"do": "continue", "set": {"iter.seen": "{{ output.data.rows }}"}}})}
    script = Script(fetch=[ok({"page": 2, "rows": [1, 2], "status": "raw-status"})], save=[ok()])
    result = await run_pipeline([fetch, {"name": "save"}], scope(), script)
    later = script.scopes[1]
    assert (later["page"], later["rows"]) == (2, [1, 2])
    assert later["iter"]["seen"] == [1, 2]
    assert result.set_updates["ctx"] == {"last_page": 2}


async def test_task_set_is_not_applied_when_the_task_fails_the_pipeline() -> None:
    task = {"name": "a", "set": {"ctx.v": "{{ output }}"}}
    result = await run_pipeline([task], scope(), Script(a=[err()]))
    assert result.status == "error"
    assert result.set_updates["ctx"] == {}


async def test_iter_set_visible_to_next_task() -> None:
    """iterator_save_test: `iter.processed_item: {{ output.data }}` then a task reads it."""
    first = {"name": "process_item", **rules({"when": True, "then": {"do": "continue", "set": {
        "iter.processed_item": "{{ output.data }}"}}})}
    script = Script(process_item=[ok({"item_name": "item1"})], save_item=[ok()])
    result = await run_pipeline([first, {"name": "save_item"}], scope(iter={"item": {"name": "item1"}}), script)
    assert script.scopes[1]["iter"] == {"item": {"name": "item1"}, "processed_item": {"item_name": "item1"}}
    assert result.set_updates["iter"] == {"processed_item": {"item_name": "item1"}}


async def test_else_forms() -> None:
    heavy = {"name": "a", **rules({"else": {"do": "continue", "set": {"ctx.v": 1}}})}
    result = await run_pipeline([heavy], scope(), Script(a=[ok()]))
    assert result.set_updates["ctx"] == {"v": 1}
    v10 = {"name": "a", **rules({"else": None, "then": {"do": "continue", "set": {"ctx.w": 2}}})}
    result = await run_pipeline([v10], scope(), Script(a=[ok()]))
    assert result.set_updates["ctx"] == {"w": 2}


async def test_continue_on_error_by_policy_completes_ok() -> None:
    task = {"name": "a", **rules({"when": "{{ output.status == 'error' }}", "then": {"do": "continue"}})}
    result = await run_pipeline([task, {"name": "b"}], scope(), Script(a=[err()], b=[ok("b")]))
    assert (result.status, result.data) == ("ok", "b")


# ---------------------------------------------------------------- retry


RETRY = rules({"when": "{{ output.status == 'error' }}",
               "then": {"do": "retry", "attempts": 5, "delay": 0.2, "backoff": "exponential"}},
              {"else": {"then": {"do": "continue"}}})


async def test_retry_until_success() -> None:
    """retry_test/python_retry_exception.yaml."""
    script, sleeps = Script(start=[err("Random failure"), err("Random failure"), ok({"success": True})]), Sleeps()
    result = await run_pipeline([{"name": "start", **RETRY}], scope(), script, sleep=sleeps)
    assert result.status == "ok" and result.data == {"success": True}
    assert script.calls == [("start", 1), ("start", 2), ("start", 3)]
    assert sleeps.delays == [0.2, 0.4]


async def test_retry_exhausted_fails_with_last_error() -> None:
    script, sleeps = Script(start=[err("always")]), Sleeps()
    result = await run_pipeline([{"name": "start", **RETRY}], scope(), script, sleep=sleeps)
    assert result.status == "error" and result.error is not None and result.error.message == "always"
    assert len(script.calls) == 5
    assert sleeps.delays == [0.2, 0.4, 0.8, 1.6]


async def test_retry_exhausted_on_ok_outcome_continues() -> None:
    task = {"name": "a", **rules({"when": "{{ output.data < 10 }}", "then": {"do": "retry", "attempts": 2,
                                                                          "backoff": "none"}})}
    script, sleeps = Script(a=[ok(1)], b=[ok()]), Sleeps()
    result = await run_pipeline([task, {"name": "b"}], scope(), script, sleep=sleeps)
    assert result.status == "ok" and script.calls == [("a", 1), ("a", 2), ("b", 1)]
    assert sleeps.delays == [0.0]


async def test_retry_on_retryable_error_flag() -> None:
    task = {"name": "a", **rules({"when": "{{ output.status == 'error' and output.error.retryable }}",
                                  "then": {"do": "retry", "attempts": 3, "delay": 0}},
                                 {"when": "{{ output.status == 'error' }}", "then": {"do": "fail"}})}
    script = Script(a=[err("x", retryable=False)])
    result = await run_pipeline([task], scope(), script, sleep=Sleeps())
    assert result.status == "error" and len(script.calls) == 1


def test_backoff_delays() -> None:
    assert backoff_delay(Action(do="retry", backoff="none", delay=3), 2) == 0
    assert backoff_delay(Action(do="retry", backoff="fixed", delay=3), 4) == 3
    assert backoff_delay(Action(do="retry", backoff="linear", delay=2), 3) == 6
    assert backoff_delay(Action(do="retry", backoff="exponential", delay=1), 4) == 8
    assert backoff_delay(Action(do="retry", backoff="exponential", delay=1), 20) == 30


# ---------------------------------------------------------------- jump, break, fail


async def test_jump() -> None:
    a = {"name": "a", "set": {"count": "{{ (count | default(0)) + 1 }}"}}
    b = {"name": "b", **rules({"when": "{{ count < 3 }}", "then": {"do": "jump", "to": "a"}})}
    script = Script(a=[ok()], b=[ok()], c=[ok("c")])
    result = await run_pipeline([a, b, {"name": "c"}], scope(), script)
    assert [c[0] for c in script.calls] == ["a", "b", "a", "b", "a", "b", "c"]
    assert result.data == "c"


async def test_jump_to_unknown_task_fails() -> None:
    task = {"name": "a", **rules({"when": True, "then": {"do": "jump", "to": "nowhere"}})}
    result = await run_pipeline([task], scope(), Script(a=[ok()]))
    assert result.error is not None and result.error.code == "INVALID_TASK"
    assert "nowhere" in result.error.message


async def test_jump_loop_is_bounded() -> None:
    task = {"name": "a", **rules({"when": True, "then": {"do": "jump", "to": "a"}})}
    result = await run_pipeline([task], scope(), Script(a=[ok()]), max_runs=50)
    assert result.status == "error" and result.runs == 51


async def test_break_stops_ok_with_last_data() -> None:
    task = {"name": "a", **rules({"when": "{{ output.data.done }}", "then": {"do": "break"}})}
    script = Script(a=[ok({"done": True})], b=[ok()])
    result = await run_pipeline([task, {"name": "b"}], scope(), script)
    assert (result.status, result.data, result.stopped_by) == ("ok", {"done": True}, "break")
    assert script.calls == [("a", 1)]


async def test_fail_on_ok_outcome_by_policy() -> None:
    task = {"name": "validate", **rules({"when": "{{ output.data.status == 'error' }}", "then": {"do": "fail"}},
                                        {"else": {"then": {"do": "continue"}}})}
    result = await run_pipeline([task, {"name": "b"}], scope(), Script(validate=[ok({"status": "error"})]))
    assert result.status == "error" and result.error is not None
    assert result.error.code == "POLICY_FAIL" and "validate" in result.error.message
    assert result.data == {"status": "error"}


async def test_unknown_action_fails() -> None:
    task = {"name": "a", **rules({"when": True, "then": {"do": "explode"}})}
    result = await run_pipeline([task], scope(), Script(a=[ok()]))
    assert result.error is not None and "explode" in result.error.message


async def test_rule_template_error_names_the_template() -> None:
    task = {"name": "a", **rules({"when": "{{ output.data.missing > 1 }}", "then": {"do": "fail"}})}
    result = await run_pipeline([task], scope(), Script(a=[ok({})]))
    assert result.error is not None and result.error.code == "TEMPLATE_ERROR"
    assert "output.data.missing" in result.error.message


async def test_rule_sees_attempt_task_prev_and_known_steps() -> None:
    task = {"name": "b", **rules({"when": "{{ _attempt == 1 and _task == 'b' and _prev == 'pa' "
                                          "and some_step is none }}", "then": {"do": "break"}})}
    result = await run_pipeline([{"name": "a"}, task, {"name": "c"}], scope(),
                                Script(a=[ok("pa")], b=[ok("pb")], c=[ok()]))
    assert result.stopped_by == "break"


def test_decide_first_match_wins() -> None:
    chosen = decide([{"when": "{{ false }}", "then": {"do": "fail"}},
                     {"when": "{{ true }}", "then": {"do": "break"}},
                     {"else": {"then": {"do": "retry"}}}], {})
    assert chosen is not None and chosen.do == "break"
    assert decide([{"when": False, "then": {}}], {}) is None


# ---------------------------------------------------------------- result hook


async def test_on_result_sees_every_attempt_and_can_stop_the_pipeline() -> None:
    seen: list[tuple[str, int]] = []

    async def hook(run: TaskRun) -> None:
        seen.append((run.name, run.attempt))
        if run.name == "b":
            raise RuntimeError("store down")

    task = {"name": "a", **rules({"when": "{{ _attempt < 2 }}", "then": {"do": "retry", "delay": 0}})}
    with pytest.raises(RuntimeError, match="store down"):
        await run_pipeline([task, {"name": "b"}, {"name": "c"}], scope(), Script(a=[ok()], b=[ok()], c=[ok()]),
                           on_result=hook, sleep=Sleeps())
    assert seen == [("a", 1), ("a", 2), ("b", 1)]
