"""One test per validation rule: small inline playbooks, asserting path and message."""

from __future__ import annotations

import textwrap

import pytest

from noetl_common.errors import PlaybookInvalid
from noetl_dsl import parse_playbook

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: t\n"
OK_STEP = """\
- step: start
  tool: {kind: noop}
"""


def doc(steps: str = OK_STEP, extra: str = "", header: str = HEADER) -> str:
    return header + textwrap.dedent(extra) + "workflow:\n" + textwrap.indent(textwrap.dedent(steps), "  ")


def problems(text: str, **kw: object) -> list[tuple[str, str]]:
    """Every (path, message) the playbook is rejected with."""
    with pytest.raises(PlaybookInvalid) as info:
        parse_playbook(text, **kw)  # type: ignore[arg-type]
    out = []
    for item in info.value.message.split("; "):
        path, sep, message = item.partition(": ")
        out.append((path, message) if sep and not path.startswith("malformed") else ("", item))
    assert info.value.path == out[0][0]
    return out


def one(text: str, **kw: object) -> tuple[str, str]:
    found = problems(text, **kw)
    assert len(found) == 1, found
    return found[0]


def test_minimal_playbook_is_valid() -> None:
    pb = parse_playbook(doc())
    assert pb.name == "t" and pb.path == "t" and pb.workload == {} and pb.workbook == []


def test_malformed_yaml_names_line_and_column() -> None:
    with pytest.raises(PlaybookInvalid) as info:
        parse_playbook("apiVersion: noetl.io/v2\nmetadata: {name: [x\nworkflow: []\n")
    assert info.value.path == ""
    assert info.value.message.startswith("malformed YAML: ")
    assert "(line 3, column" in info.value.message


@pytest.mark.parametrize(("text", "got"), [("- a\n- b\n", "list"), ("", "an empty document"), ("42", "int")])
def test_document_must_be_a_mapping(text: str, got: str) -> None:
    with pytest.raises(PlaybookInvalid) as info:
        parse_playbook(text)
    assert info.value.path == ""
    assert info.value.message == f"a playbook must be a mapping (got {got})"


def test_api_version_required_and_prefixed() -> None:
    assert one(doc(header="kind: Playbook\nmetadata: {name: t}\n")) == (
        "apiVersion", "apiVersion is required (e.g. 'noetl.io/v2')")
    path, msg = one(doc(header="apiVersion: v1\nkind: Playbook\nmetadata: {name: t}\n"))
    assert (path, msg) == ("apiVersion", "apiVersion must start with 'noetl.io/' (got 'v1')")


def test_kind_must_be_playbook() -> None:
    assert one(doc(header="apiVersion: noetl.io/v2\nkind: Job\nmetadata: {name: t}\n")) == (
        "kind", "kind must be 'Playbook' (got 'Job')")


def test_metadata_name_required() -> None:
    path, msg = one(doc(header="apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {path: a/b}\n"))
    assert path == "metadata.name" and "playbook name is required" in msg
    path, msg = one(doc(header="apiVersion: noetl.io/v2\nkind: Playbook\n"))
    assert path == "metadata" and "metadata is required" in msg


def test_metadata_path_falls_back_to_name() -> None:
    assert parse_playbook(doc(header=HEADER + "  path: a/b/c\n")).path == "a/b/c"
    assert parse_playbook(doc()).path == "t"


def test_workload_must_be_a_mapping() -> None:
    assert one(doc(extra="workload: [1, 2]\n")) == ("workload", "workload must be a mapping (got list)")


def test_workflow_must_be_non_empty() -> None:
    assert one(HEADER + "workflow: []\n") == ("workflow", "workflow must be a non-empty list of steps (it is empty)")
    assert one(HEADER) == ("workflow", "workflow must be a non-empty list of steps (it is missing)")


def test_step_must_be_a_mapping() -> None:
    assert one(doc("- just_a_name\n")) == ("workflow[0]", "step must be a mapping (got str)")


def test_step_name_required() -> None:
    assert one(doc("- tool: {kind: noop}\n")) == ("workflow[0].step", "step name is required")


def test_step_names_unique() -> None:
    assert one(doc(OK_STEP + OK_STEP)) == ("workflow[1].step", "duplicate step name 'start' (also workflow[0])")


def test_a_step_without_tool_or_loop_is_a_noop() -> None:
    """Upstream's plain ``- step: end`` (routing only) runs nothing; a loop still needs a tool."""
    playbook = parse_playbook(doc(OK_STEP + "- step: end\n  desc: no tool\n"))
    assert playbook.step("end").tool == {"kind": "noop"}
    assert one(doc(OK_STEP + "- step: end\n  loop: {in: [1], iterator: x}\n")) == (
        "workflow[1].tool", "tool is required (step 'end')")


def test_tool_must_be_mapping_or_list() -> None:
    assert one(doc("- step: a\n  tool: python\n")) == (
        "workflow[0].tool", "tool must be a task mapping or a list of them (step 'a', got str)")


def test_empty_pipeline_is_rejected() -> None:
    path, msg = one(doc("- step: a\n  tool: []\n"))
    assert path == "workflow[0].tool" and "tool is required (step 'a')" in msg


def test_tool_kind_required_with_hint_for_type() -> None:
    assert one(doc("- step: a\n  tool: {type: python, code: x}\n")) == (
        "workflow[0].tool.kind", "tool kind is required (step 'a', found 'type': the canonical key is 'kind')")


def test_unknown_tool_kind() -> None:
    path, msg = one(doc("- step: a\n  tool: {kind: fortran}\n"))
    assert path == "workflow[0].tool.kind"
    assert msg == "unknown tool kind 'fortran' (expected one of: duckdb, http, noop, playbook, postgres, python, workbook)"
    _, msg = one(doc("- step: a\n  tool: {kind: secrets, name: api_key}\n"))
    assert msg.startswith("unknown tool kind 'secrets' (expected one of:")
    assert "upstream NoETL's 'secrets' is not built here: read a stored credential where it is used" in msg


def test_unsupported_tool_kind() -> None:
    text = doc("- step: a\n  tool: {kind: duckdb, query: select 1}\n")
    parse_playbook(text)
    assert one(text, supported_kinds=frozenset({"python", "noop"})) == (
        "workflow[0].tool.kind", "tool kind 'duckdb' is not supported by this runtime (supported: noop, python)")


def test_python_needs_code() -> None:
    assert one(doc("- step: a\n  tool: {kind: python, input: {}}\n")) == (
        "workflow[0].tool.code", "python tool requires 'code' (or 'code_b64' / 'script') (step 'a')")
    parse_playbook(doc("- step: a\n  tool: {kind: python, code_b64: cHJpbnQoMSk=}\n"))


def test_postgres_needs_command_or_query() -> None:
    path, msg = one(doc("- step: a\n  tool: {kind: postgres, auth: pg, command: '  '}\n"))
    assert path == "workflow[0].tool.command"
    assert msg == "postgres tool requires 'command' or 'query': no sql command provided (step 'a')"
    parse_playbook(doc("- step: a\n  tool: {kind: postgres, auth: pg, query: select 1}\n"))


def test_http_needs_url() -> None:
    assert one(doc("- step: a\n  tool: {kind: http, method: GET}\n")) == (
        "workflow[0].tool.url", "http tool requires 'url' (or 'endpoint') (step 'a')")
    parse_playbook(doc("- step: a\n  tool: {kind: http, method: GET, endpoint: 'http://h/x'}\n"))


def test_pre_v10_case_routing_is_refused_not_ignored() -> None:
    steps = """\
    - step: start
      tool: {kind: python, code: 'result = 1'}
      case:
        - when: "{{ event.name == 'step.exit' }}"
          then: {next: [{step: end}]}
    - step: end
    """
    path, msg = one(doc(steps))
    assert path == "workflow[0].case" and msg.startswith("`case:` (step 'start') is the pre-v10 routing form")
    assert "next: {arcs:" in msg


def test_v1_playbooks_are_refused_naming_the_version_and_the_v1_step_form() -> None:
    v1 = doc("- step: a\n  type: postgres\n  command: select 1\n", header=HEADER.replace("noetl.io/v2", "noetl.io/v1"))
    (path, msg), v1_step = problems(v1)
    assert path == "apiVersion" and "'noetl.io/v1'" in msg and "'noetl.io/v2'" in msg
    assert v1_step[0] == "workflow[0].type"
    # the v1 step form under a v2 header: not a silent noop step
    assert one(doc("- step: a\n  type: postgres\n  command: select 1\n")) == ("workflow[0].type", "`type: postgres` on step 'a' is the noetl.io/v1 step form: put the task under "
            "`tool:` with `kind: postgres`")


WORKBOOK = """\
workbook:
  - name: calc
    tool: {kind: python, code: 'result = 1'}
"""


def test_workbook_tool_needs_a_known_entry() -> None:
    assert one(doc("- step: a\n  tool: {kind: workbook}\n", extra=WORKBOOK)) == (
        "workflow[0].tool.name", "workbook tool requires 'name' (the workbook task to run) (step 'a')")
    assert one(doc("- step: a\n  tool: {kind: workbook, name: nope}\n", extra=WORKBOOK)) == (
        "workflow[0].tool.name", "unknown workbook task 'nope' (step 'a', workbook has: calc)")
    assert one(doc("- step: a\n  tool: {kind: workbook, name: nope}\n")) == (
        "workflow[0].tool.name", "unknown workbook task 'nope' (step 'a', the playbook has no workbook)")


def test_workbook_entries_are_validated() -> None:
    extra = "workbook:\n  - name: calc\n    tool: {kind: shell}\n  - name: calc\n    tool: {kind: noop}\n  - tool: {}\n"
    found = problems(doc(extra=extra))
    assert found[0] == ("workbook[1].name", "duplicate workbook entry 'calc' (also workbook[0])")
    assert ("workbook[2].name", "workbook entry name is required (got None)") in found
    assert any(p == "workbook[0].tool.kind" and m.startswith("unknown tool kind 'shell'") for p, m in found)


def test_playbook_tool_needs_path() -> None:
    path, msg = one(doc("- step: a\n  tool: {kind: playbook, input: {x: 1}}\n"))
    assert path == "workflow[0].tool.path" and msg.startswith("playbook tool requires 'path'")


def test_pipeline_task_names_unique() -> None:
    steps = """\
    - step: a
      tool:
        - {name: fetch, kind: noop}
        - {name: fetch, kind: noop}
        - {kind: noop}
        - {name: task_2, kind: noop}
    """
    found = problems(doc(steps))
    assert found == [
        ("workflow[0].tool[1].name", "duplicate task name 'fetch' in the pipeline (step 'a', also workflow[0].tool[0])"),
        ("workflow[0].tool[3].name",
         "duplicate task name 'task_2' in the pipeline (step 'a', also workflow[0].tool[2])"),
    ]


def test_pipeline_task_problems_carry_their_index() -> None:
    steps = "- step: a\n  tool:\n    - {kind: noop}\n    - {kind: http}\n"
    assert one(doc(steps)) == ("workflow[0].tool[1].url", "http tool requires 'url' (or 'endpoint') (step 'a')")


def test_next_mode_must_be_exclusive_or_inclusive() -> None:
    steps = OK_STEP + "  next:\n    spec: {mode: both}\n    arcs: [{step: start}]\n"
    assert one(doc(steps)) == (
        "workflow[0].next.spec.mode", "invalid value 'both' (expected 'exclusive' or 'inclusive')")


def test_arc_must_name_a_step() -> None:
    steps = OK_STEP + "  next:\n    arcs:\n      - step: start\n      - step: nowhere\n"
    assert one(doc(steps)) == ("workflow[0].next.arcs[1].step", "arc targets unknown step 'nowhere' (step 'start')")


def test_arc_step_required() -> None:
    steps = OK_STEP + "  next:\n    arcs:\n      - when: '{{ true }}'\n"
    assert one(doc(steps)) == ("workflow[0].next.arcs[0].step", "field is required")


def test_arc_when_type() -> None:
    steps = OK_STEP + "  next:\n    arcs:\n      - {step: start, when: 3}\n"
    assert one(doc(steps)) == (
        "workflow[0].next.arcs[0].when", "when must be a template string or a boolean (got int)")


@pytest.mark.parametrize(("form", "path"), [
    ("nowhere", "workflow[0].next"),
    ("[start, nowhere]", "workflow[0].next[1]"),
    ("[{step: nowhere}]", "workflow[0].next[0].step"),
    ("{step: nowhere}", "workflow[0].next.step"),
])
def test_next_shorthands_check_targets(form: str, path: str) -> None:
    assert one(doc(OK_STEP + f"  next: {form}\n")) == (path, "arc targets unknown step 'nowhere' (step 'start')")


def test_loop_needs_in_or_cursor_and_iterator() -> None:
    steps = OK_STEP + "  loop: {spec: {mode: sequential}}\n"
    assert problems(doc(steps)) == [
        ("workflow[0].loop.in", "loop requires 'in' (a list or a template) or a 'cursor' (step 'start')"),
        ("workflow[0].loop.iterator", "loop requires 'iterator' (the name each item is bound to) (step 'start')"),
    ]


def test_loop_in_must_be_list_or_template() -> None:
    steps = OK_STEP + "  loop: {in: numbers, iterator: n}\n"
    assert one(doc(steps)) == (
        "workflow[0].loop.in", "loop 'in' must be a list or a template string, got 'numbers' (step 'start')")


def test_loop_mode_and_max_in_flight() -> None:
    steps = OK_STEP + "  loop: {in: [1], iterator: n, spec: {mode: random, max_in_flight: 0}}\n"
    assert problems(doc(steps)) == [
        ("workflow[0].loop.spec.mode", "invalid value 'random' (expected 'sequential', 'parallel' or 'cursor')"),
        ("workflow[0].loop.spec.max_in_flight", "max_in_flight must be a positive integer or a template, got 0"),
    ]


def test_cursor_loop_needs_no_iterator_but_a_cursor() -> None:
    ok = OK_STEP + "  loop: {cursor: {kind: postgres, claim: 'select 1'}, spec: {mode: cursor}}\n"
    assert parse_playbook(doc(ok)).workflow[0].loop is not None
    bad = OK_STEP + "  loop: {in: [1], iterator: n, spec: {mode: cursor}}\n"
    assert one(doc(bad)) == ("workflow[0].loop.cursor", "loop mode 'cursor' requires a 'cursor' mapping (step 'start')")


def test_template_syntax_errors_are_reported_with_their_path() -> None:
    steps = """\
    - step: start
      tool: {kind: python, code: 'result = 1', input: {x: '{{ a + }}'}}
      next:
        arcs:
          - step: start
            set: {ctx.y: '{% if %}'}
    """
    found = problems(doc(steps))
    assert [p for p, _ in found] == ["workflow[0].tool.input.x", 'workflow[0].next.arcs[0].set["ctx.y"]']
    assert all(m.startswith("invalid template: syntax error:") for _, m in found)


def test_type_errors_from_the_model_have_field_paths() -> None:
    steps = "- step: a\n  input: [1]\n  tool: {kind: noop, input: 5, name: 7}\n"
    found = problems(doc(steps))
    assert ("workflow[0].input", "Input should be a valid dictionary") in found
    assert ("workflow[0].tool.input", "Input should be a valid dictionary") in found
    assert ("workflow[0].tool.name", "Input should be a valid string") in found


def test_all_problems_are_collected_in_document_order() -> None:
    text = doc("- step: a\n  tool: {kind: nope}\n- step: b\n  tool: []\n",
               header="apiVersion: x/v1\nkind: Playbook\nmetadata: {name: t}\n")
    found = problems(text)
    assert [p for p, _ in found] == ["apiVersion", "workflow[0].tool.kind", "workflow[1].tool"]
    with pytest.raises(PlaybookInvalid) as info:
        parse_playbook(text)
    assert info.value.path == "apiVersion"
    assert "; workflow[1].tool: tool is required (step 'b'): the pipeline is empty" in info.value.message


def test_sql_may_come_from_script_commands_or_sql() -> None:
    for tool in ("{kind: duckdb, commands: [select 1, select 2]}", "{kind: duckdb, sql: select 1}",
                 "{kind: duckdb, script: {path: a.sql, source: {type: file}}}",
                 "{kind: postgres, auth: pg, script: {uri: 'https://x/a.sql'}}",
                 "{kind: python, script: {path: a.py, source: {type: file}}}"):
        parse_playbook(doc(f"- step: a\n  tool: {tool}\n"))
    with pytest.raises(PlaybookInvalid, match="no sql command provided"):
        parse_playbook(doc("- step: a\n  tool: {kind: duckdb, commands: []}\n"))
