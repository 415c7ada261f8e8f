"""Pin noetl_dsl's public surface."""

from __future__ import annotations

import noetl_dsl


def test_public_surface_is_pinned() -> None:
    assert sorted(noetl_dsl.__all__) == sorted([
        "Arc", "Loop", "Next", "Playbook", "Step", "Task",
        "parse_playbook", "load_playbook", "load_yaml", "static_auth_refs", "merged_workload", "TOOL_KINDS",
        "successors", "predecessors", "reachable_from",
        "render", "render_str", "render_text", "evaluate_when", "referenced_names",
        "RenderContext", "TemplateError", "is_template", "Placement", "placements",
    ])
    for name in noetl_dsl.__all__:
        assert getattr(noetl_dsl, name) is not None, name


def test_tool_kinds() -> None:
    assert noetl_dsl.TOOL_KINDS == frozenset({"python", "http", "postgres", "duckdb", "noop", "workbook", "playbook"})
