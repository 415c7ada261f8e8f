"""The model over real conformance playbooks: steps, tasks, arcs, loops, workbook."""

from __future__ import annotations

import pytest
from conformance_data import playbook

from noetl_dsl import Arc, Loop, Playbook, Step, Task, parse_playbook


def load(rel: str) -> Playbook:
    return parse_playbook(playbook(rel).read_text())


def test_playbook_header_and_lookup() -> None:
    pb = load("control_flow_workbook/control_flow_workbook.yaml")
    assert pb.name == "control_flow_workbook"
    assert pb.path == "fixtures/playbooks/control_flow_workbook"
    assert pb.workload == {"temperature_c": 30}
    assert pb.step_names == ["start", "eval_flag", "hot_path", "hot_task_a", "hot_task_b",
                             "cold_path", "cold_task", "end"]
    assert pb.start_step == "start"
    assert pb.step("eval_flag").desc == "Call workbook action to compute is_hot"
    with pytest.raises(KeyError):
        pb.step("missing")
    assert pb.raw["metadata"]["name"] == "control_flow_workbook"
    assert "raw" not in pb.model_dump()


def test_start_step_falls_back_to_first() -> None:
    pb = parse_playbook("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t}\n"
                        "workflow:\n  - {step: first, tool: {kind: noop}}\n  - {step: second, tool: {kind: noop}}\n")
    assert pb.start_step == "first"


def test_workbook_lookup() -> None:
    pb = load("control_flow_workbook/control_flow_workbook.yaml")
    task = pb.workbook_task("compute_flag")
    assert task is not None
    assert task["kind"] == "python" and task["input"] == {"temperature_c": None}
    assert "is_hot" in task["code"]
    assert pb.workbook_task("nope") is None
    # the entry's non-runtime fields are kept in the workbook itself
    assert pb.workbook[0]["assert"]["returns"] == ["is_hot", "message"]
    step = pb.step("eval_flag")
    assert step.tasks[0].kind == "workbook" and step.tasks[0].name == "compute_flag"


def test_single_tool_is_one_task_named_after_the_step() -> None:
    pb = load("hello_world/hello_world.yaml")
    step = pb.step("test_step")
    assert not step.is_pipeline
    assert step.raw_tool == {"kind": "python", "input": {"message": "{{ message }}"},
                             "code": step.raw_tool["code"]}
    [task] = step.tasks
    assert isinstance(task, Task)
    assert (task.kind, task.name, task.input) == ("python", "test_step", {"message": "{{ message }}"})
    assert "name" not in task.raw  # raw is the task as written
    assert task.raw["code"].startswith('print(f"HELLO_WORLD')


def test_pipeline_tasks_keep_their_names_and_policies() -> None:
    pb = load("iterator_save_test/iterator_save_test.yaml")
    step = pb.step("process_items")
    assert step.is_pipeline and isinstance(step.raw_tool, list)
    assert [t.name for t in step.tasks] == ["process_item", "save_item"]
    assert [t.kind for t in step.tasks] == ["python", "postgres"]
    first, second = step.tasks
    assert first.policy_rules[0]["when"] is True
    assert first.policy_rules[0]["then"]["set"] == {"iter.processed_item": "{{ output.data }}"}
    assert second.raw["auth"] == "{{ pg_auth }}"
    assert (second.model_extra or {})["auth"] == "{{ pg_auth }}"  # extra keys are kept


def test_unnamed_pipeline_tasks_get_index_names() -> None:
    step = Step.model_validate({"step": "s", "tool": [{"kind": "noop"}, {"kind": "noop", "name": "b"},
                                                      {"kind": "noop"}]})
    assert [t.name for t in step.tasks] == ["task_0", "b", "task_2"]


def test_task_level_set_and_spec() -> None:
    pb = load("v10_canonical_example.yaml")
    validate, transform = pb.step("process_data").tasks
    assert validate.set == {"validate_result": "{{ output }}"}
    assert validate.spec is not None and len(validate.policy_rules) == 2
    assert transform.input == {"prev": "{{ validate_result }}"}
    assert pb.step("start").spec is not None  # step-level spec kept raw
    assert pb.raw["executor"]["profile"] == "auto"


def test_arcs_and_next_mode() -> None:
    pb = load("control_flow_workbook/control_flow_workbook.yaml")
    eval_flag = pb.step("eval_flag")
    assert eval_flag.next_mode == "exclusive"
    assert [(a.step, a.when) for a in eval_flag.arcs] == [
        ("hot_path", "{{ eval_flag.is_hot == true }}"), ("cold_path", "{{ eval_flag.is_hot == false }}")]
    hot = pb.step("hot_path")
    assert hot.next_mode == "inclusive"
    assert [a.step for a in hot.arcs] == ["hot_task_a", "hot_task_b"]
    end = pb.step("end")
    assert end.next is None and end.arcs == [] and end.next_mode == "exclusive"


def test_arc_set() -> None:
    pb = load("test_args_passing.yaml")
    [arc] = pb.step("start").arcs
    assert isinstance(arc, Arc)
    assert arc.set == {"ctx.test_var": "{{ initial_value }}", "ctx.computed": 200}


def test_step_level_set_and_input() -> None:
    pb = load("pagination/basic/test_pagination_basic.yaml")
    assert pb.step("start").set == {
        "ctx.slow_delay_seconds": "{{ workload.slow_delay_seconds }}",
        "ctx.fast_probe_count": "{{ workload.fast_probe_count }}",
        "ctx.expected_min_overlap": "{{ workload.expected_min_overlap }}",
    }
    loop_pb = load("loop_test.yaml")
    assert loop_pb.step("start").input == {"num": "{{ num }}", "loop_index": "{{ loop_index }}"}


@pytest.mark.parametrize(("form", "expected"), [
    ("b", ["b"]),
    (["b", {"step": "c", "when": True}], ["b", "c"]),
    ({"step": "b"}, ["b"]),
    ({"spec": {"mode": "inclusive"}, "arcs": [{"step": "b"}, {"step": "c"}]}, ["b", "c"]),
])
def test_next_shorthands(form: object, expected: list[str]) -> None:
    step = Step.model_validate({"step": "a", "tool": {"kind": "noop"}, "next": form})
    assert [a.step for a in step.arcs] == expected


def test_simple_loop() -> None:
    step = load("root_scripts/test_simple_loop.yaml").step("loop_test")
    loop = step.loop
    assert isinstance(loop, Loop)
    assert (loop.in_, loop.iterator, loop.mode, loop.max_in_flight) == ("{{ numbers }}", "num", "sequential", None)
    assert loop.cursor is None
    assert [a.step for a in step.arcs] == ["end"]


def test_loop_test_has_two_loops() -> None:
    pb = load("loop_test.yaml")
    loops = {s.step: s.loop for s in pb.workflow if s.loop is not None}
    assert set(loops) == {"start", "user_loop"}
    assert loops["start"].iterator == "num" and loops["start"].in_ == "{{ numbers }}"
    assert loops["user_loop"].iterator == "user" and loops["user_loop"].in_ == "{{ users }}"


def test_parallel_loop_with_max_in_flight() -> None:
    pb = load("pagination/basic/test_pagination_basic.yaml")
    step = pb.step("run_probes")
    assert step.loop is not None
    assert (step.loop.mode, step.loop.max_in_flight, step.loop.iterator) == ("parallel", 5, "item")
    assert step.loop.in_ == "{{ ctx.probe_delays }}"
    assert step.tasks[0].kind == "http" and len(step.tasks[0].policy_rules) == 3
    assert step.arcs[0].when == '{{ event.name == "loop.done" }}'


def test_loop_policy_and_literal_list() -> None:
    step = load("v10_canonical_example.yaml").step("store_results")
    assert step.loop is not None and step.loop.spec.policy == {"exec": "local"}
    lit = Loop.model_validate({"in": [1, 2], "iterator": "x"})
    assert lit.in_ == [1, 2] and lit.mode == "sequential"
    assert lit.model_dump(by_alias=True)["in"] == [1, 2]
