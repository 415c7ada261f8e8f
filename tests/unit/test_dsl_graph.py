"""Graph helpers: successors, predecessors, reachability, the implicit end rule."""

from __future__ import annotations

import pytest
from conformance_data import playbook

from noetl_dsl import Playbook, parse_playbook, predecessors, reachable_from, successors


def load(rel: str) -> Playbook:
    return parse_playbook(playbook(rel).read_text())


def test_control_flow_workbook_graph() -> None:
    pb = load("control_flow_workbook/control_flow_workbook.yaml")
    succ = successors(pb)
    assert succ["eval_flag"] == {"hot_path", "cold_path"}
    assert succ["hot_path"] == {"hot_task_a", "hot_task_b"}
    assert succ["end"] == set()
    preds = predecessors(pb)
    assert preds["end"] == {"hot_task_a", "hot_task_b", "cold_task"}
    assert {"hot_task_a", "hot_task_b"} <= preds["end"]
    assert preds["start"] == set()
    assert reachable_from(pb, "hot_path") == {"hot_task_a", "hot_task_b", "end"}
    assert reachable_from(pb, "start") == set(pb.step_names) - {"start"}
    assert reachable_from(pb, "end") == set()


def test_fanout_reduce_graph() -> None:
    pb = load("fanout_reduce/fanout_reduce_phase6.yaml")
    assert pb.step("start").next_mode == "inclusive"
    assert successors(pb)["start"] == {"normalize_customer", "enrich_customer"}
    assert predecessors(pb)["reduce_customer"] == {"normalize_customer", "enrich_customer"}
    # no step named "end": a step without next has no successors
    assert successors(pb)["reduce_customer"] == set()
    assert reachable_from(pb, "start") == {"normalize_customer", "enrich_customer", "reduce_customer"}


def test_implicit_end_routing() -> None:
    pb = load("root_scripts/test_implicit_end_routing.yaml")
    assert pb.step("step1").next is None
    succ = successors(pb)
    assert succ == {"start": {"step1"}, "step1": {"end"}, "end": set()}
    assert predecessors(pb)["end"] == {"step1"}
    assert reachable_from(pb, "start") == {"step1", "end"}


def test_cycle_includes_the_step_itself() -> None:
    pb = load("pagination/cursor/test_pagination_cursor.yaml")
    assert successors(pb)["check_pagination"] == {"fetch_page", "validate_results"}
    assert "fetch_page" in reachable_from(pb, "fetch_page")
    assert "start" not in reachable_from(pb, "fetch_page")


def test_unknown_step_raises_key_error() -> None:
    with pytest.raises(KeyError):
        reachable_from(load("hello_world/hello_world.yaml"), "nope")
