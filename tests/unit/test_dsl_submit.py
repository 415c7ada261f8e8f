"""Submit-time helpers: merged_workload and static_auth_refs."""

from __future__ import annotations

from conformance_data import playbook

from noetl_dsl import Playbook, merged_workload, parse_playbook, static_auth_refs


def load(rel: str) -> Playbook:
    return parse_playbook(playbook(rel).read_text())


def inline(workload: str, tool: str) -> Playbook:
    return parse_playbook(f"apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {{name: t}}\n"
                          f"workload: {workload}\nworkflow:\n  - step: a\n    tool: {tool}\n")


def test_static_auth_from_workload_template() -> None:
    pb = load("broken_sql.yaml")
    assert static_auth_refs(pb, merged_workload(pb, {})) == [("workflow[1].tool.auth", "pg_local")]
    assert static_auth_refs(pb, merged_workload(pb, {"pg_auth": "pg_other"})) == [
        ("workflow[1].tool.auth", "pg_other")]


def test_static_auth_literal_in_pipeline() -> None:
    pb = load("postgres_test.yaml")
    assert static_auth_refs(pb, pb.workload) == [("workflow[0].tool[0].auth", "pg_noetl_k8s")]


def test_static_auth_workload_prefix_and_skips() -> None:
    pb = inline("{creds: {pg: pg_a}}", "{kind: postgres, auth: '{{ workload.creds.pg }}', query: select 1}")
    assert static_auth_refs(pb, pb.workload) == [("workflow[0].tool.auth", "pg_a")]
    # reads a step result: not known before the run
    pb = inline("{}", "{kind: postgres, auth: '{{ start.cred }}', query: select 1}")
    assert static_auth_refs(pb, pb.workload) == []
    # reads a workload key that is absent: rendering fails, skipped
    pb = inline("{x: 1}", "{kind: postgres, auth: '{{ workload.missing.deeper }}', query: select 1}")
    assert static_auth_refs(pb, pb.workload) == []


def test_static_auth_in_workbook() -> None:
    text = ("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t}\nworkload: {cred: pg_wb}\n"
            "workbook:\n  - name: q\n    tool: {kind: postgres, auth: '{{ cred }}', query: select 1}\n"
            "workflow:\n  - step: a\n    tool: {kind: workbook, name: q}\n")
    pb = parse_playbook(text)
    assert static_auth_refs(pb, pb.workload) == [("workbook[0].tool.auth", "pg_wb")]


def test_merged_workload_deep_merges() -> None:
    pb = inline("{a: 1, db: {host: h, port: 5432, opts: {ssl: true}}, items: [1, 2]}", "{kind: noop}")
    merged = merged_workload(pb, {"db": {"port": 6543, "opts": {"timeout": 3}}, "items": [9], "new": "x"})
    assert merged == {"a": 1, "db": {"host": "h", "port": 6543, "opts": {"ssl": True, "timeout": 3}},
                      "items": [9], "new": "x"}
    # the playbook's own workload is untouched
    assert pb.workload["db"] == {"host": "h", "port": 5432, "opts": {"ssl": True}}
    assert merged_workload(pb, {}) == pb.workload
    assert merged_workload(pb, {}) is not pb.workload


def test_payload_replaces_non_mapping_values() -> None:
    pb = inline("{db: {host: h}, n: 1}", "{kind: noop}")
    assert merged_workload(pb, {"db": "plain", "n": {"x": 1}}) == {"db": "plain", "n": {"x": 1}}
