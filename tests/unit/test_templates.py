"""Jinja rendering with NoETL's semantics (``noetl_dsl.templates``) and the two render
scopes built on it: the engine's (``when``/``set`` in ``noetl_flow.router``) and the
worker's (``noetl_worker.scope.build_scope``: a command's inputs)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from noetl_dsl import parse_playbook
from noetl_dsl.templates import (
    RenderContext,
    TemplateError,
    evaluate_when,
    is_template,
    referenced_names,
    render,
    render_str,
    render_text,
    set_path,
    truthy,
)
from noetl_flow import CallResultInput, Flow, StartInput
from noetl_store import MemoryResultStore
from noetl_worker.scope import build_scope, template_names

SCOPE = RenderContext({"n": 100, "ratio": 0.5, "flag": False, "name": "ada", "nothing": None,
                       "d": {"a": 1, "inner": {"b": [1, 2]}}, "l": [1, "two", {"three": 3}],
                       "r": {"items": ["shadowed"], "keys": 2}},
                      known=("later",))


# ---------------------------------------------------------------- native values


@pytest.mark.parametrize(("source", "expected"), [
    ("{{ n }}", 100),
    ("{{n}}", 100),
    ("  {{ n }}\n".strip(), 100),
    ("{{ ratio }}", 0.5),
    ("{{ flag }}", False),
    ("{{ nothing }}", None),
    ("{{ d }}", {"a": 1, "inner": {"b": [1, 2]}}),
    ("{{ d.inner.b }}", [1, 2]),
    ("{{ l }}", [1, "two", {"three": 3}]),
    ("{{ l[2].three }}", 3),
    ("{{ n * 2 }}", 200),
    ("{{ n > 50 }}", True),
    ("{{ [n, name] }}", [100, "ada"]),
    ("{{ {'k': n} }}", {"k": 100}),
    ("{{ name }}", "ada"),
])
def test_a_single_expression_keeps_its_native_type(source: str, expected: Any) -> None:
    value = render_str(source, SCOPE)
    assert value == expected
    assert type(value) is type(expected)


def test_strings_are_never_reparsed_as_literals() -> None:
    assert render_str("{{ '100' }}", SCOPE) == "100"
    assert render_str("{{ '[1, 2]' }}", SCOPE) == "[1, 2]"
    assert render_str("{{ 'true' }}", SCOPE) == "true"


@pytest.mark.parametrize(("source", "expected"), [
    ("n={{ n }}", "n=100"),
    ("{{ n }}{{ n }}", "100100"),
    (" {{ n }} ", " 100 "),  # surrounding text makes it a string template
    ("{{ d }}", {"a": 1, "inner": {"b": [1, 2]}}),
    ("{% if n > 5 %}big{% else %}small{% endif %}", "big"),
    ("{% for x in d.inner.b %}{{ x }},{% endfor %}", "1,2,"),
])
def test_anything_else_renders_to_text(source: str, expected: Any) -> None:
    assert render_str(source, SCOPE) == expected


def test_render_walks_dicts_and_lists_and_keeps_plain_values() -> None:
    value = {"count": "{{ n }}", "label": "run {{ name }}", "nested": [{"x": "{{ d.a }}"}, 7, None, "plain"],
             "obj": "{{ d }}", "num": 3.5}
    assert render(value, SCOPE) == {"count": 100, "label": "run ada", "nested": [{"x": 1}, 7, None, "plain"],
                                    "obj": {"a": 1, "inner": {"b": [1, 2]}}, "num": 3.5}
    assert render(42, SCOPE) == 42 and render("no template", SCOPE) == "no template"


def test_render_text_always_gives_a_string() -> None:
    assert render_text("{{ n }}", SCOPE) == "100"
    assert render_text("SELECT * FROM t LIMIT {{ n }}", SCOPE) == "SELECT * FROM t LIMIT 100"
    assert render_text("plain", SCOPE) == "plain"


def test_filters_json_round_trip() -> None:
    assert json.loads(render_str("{{ d | tojson }}", SCOPE)) == SCOPE["d"]
    assert json.loads(render_str("{{ l | to_json }}", SCOPE)) == SCOPE["l"]
    scope = RenderContext({"text": '{"k": [1, 2]}'})
    assert render_str("{{ text | fromjson }}", scope) == {"k": [1, 2]}
    assert render_str("{{ (text | from_json).k[1] }}", scope) == 2
    assert datetime.fromisoformat(render_str("{{ now() }}", SCOPE)).tzinfo is not None


def test_a_mapping_key_shadows_a_dict_method() -> None:
    assert render_str("{{ r.items }}", SCOPE) == ["shadowed"]
    assert render_str("{{ r.keys }}", SCOPE) == 2


# ---------------------------------------------------------------- strict names, lenient attributes


@pytest.mark.parametrize("source", ["{{ nope }}", "x {{ nope }} y", "{{ nope.x }}", "{{ nope['x'] }}",
                                    "{% if nope %}a{% endif %}", "{% for i in nope %}{{ i }}{% endfor %}",
                                    "{{ nope + 1 }}", "{{ nope == 1 }}", "{{ nope != 1 }}", "{{ 1 == nope }}",
                                    "{{ nope in [1, 2] }}"])
def test_an_unknown_name_is_an_error_naming_the_template(source: str) -> None:
    with pytest.raises(TemplateError) as info:
        render_str(source, SCOPE)
    assert info.value.template == source
    assert "nope" in str(info.value) and source in str(info.value)


def test_an_unknown_name_fails_with_a_plain_dict_scope_too() -> None:
    with pytest.raises(TemplateError, match="nope"):
        render_str("{{ nope }}", {"n": 1})
    assert render_str("{{ n }}", {"n": 1}) == 1


def test_default_and_is_defined_work_on_unknown_names() -> None:
    assert render_str("{{ nope | default(3) }}", SCOPE) == 3
    assert render_str("{{ nope is defined }}", SCOPE) is False
    assert render_str("{{ n is defined }}", SCOPE) is True


@pytest.mark.parametrize(("source", "expected"), [
    ("{{ d.missing }}", None),
    ("{{ d.missing.deeper.still }}", None),
    ("{{ d['missing'] }}", None),
    ("x{{ d.missing }}y", "xy"),
    ("{{ d.missing | default(5) }}", 5),
    ("{{ d.missing is defined }}", False),
    ("{{ 'yes' if d.missing else 'no' }}", "no"),
    ("{{ l[2].missing }}", None),
])
def test_a_missing_attribute_of_a_known_value_is_lenient(source: str, expected: Any) -> None:
    assert render_str(source, SCOPE) == expected


@pytest.mark.parametrize("source", ["{{ d.missing > 1 }}", "{{ d.missing + 1 }}", "{{ d.missing < n }}"])
def test_computing_with_a_missing_attribute_is_an_error(source: str) -> None:
    with pytest.raises(TemplateError) as info:
        render_str(source, SCOPE)
    assert "missing" in str(info.value) and info.value.template == source


def test_known_but_absent_names_read_as_none() -> None:
    """Steps that exist but have not run: ``{{ a.x if a else b.x }}`` works on the branch that ran."""
    assert render_str("{{ later }}", SCOPE) is None
    assert render_str("{{ later.x if later else n }}", SCOPE) == 100
    assert render_str("[{{ later }}]", SCOPE) == "[None]"


def test_a_syntax_error_names_the_template() -> None:
    with pytest.raises(TemplateError, match=r"syntax error"):
        render_str("{{ n +* }}", SCOPE)
    with pytest.raises(TemplateError):
        referenced_names("{% if %}")


def test_is_template_and_referenced_names() -> None:
    assert is_template("{{ x }}") and is_template("{% if x %}{% endif %}") and is_template("{# c #}")
    assert not is_template("plain") and not is_template(5) and not is_template(None)
    assert referenced_names({"a": "{{ start.data.x }} {{ workload.n }}", "b": ["{{ ctx.y }}", 3],
                             "c": "{% for r in rows %}{{ r }}{% endfor %}"}) == {"start", "workload", "ctx", "rows"}
    assert referenced_names("no template") == set()


# ---------------------------------------------------------------- when, truthiness, set paths


@pytest.mark.parametrize(("value", "expected"), [
    ("", False), ("false", False), ("False", False), (" FALSE ", False), ("none", False), ("None", False),
    ("null", False), ("0", False), ("no", False),
    ("true", True), ("yes", True), ("1", True), ("anything", True), ("0.0", True),
    (0, False), (1, True), (None, False), ([], False), ([0], True), ({}, False), ({"a": 1}, True),
    (True, True), (False, False),
])
def test_truthy(value: Any, expected: bool) -> None:
    assert truthy(value) is expected


@pytest.mark.parametrize(("when", "expected"), [
    (None, True),
    (True, True),
    (False, False),
    ("{{ n > 50 }}", True),
    ("{{ n > 500 }}", False),
    ("{{ flag }}", False),
    ("{{ d.missing }}", False),           # lenient: a missing attribute is falsy
    ("{{ 'false' }}", False),             # a rendered string is judged by its text
    ("{{ name == 'ada' and d.a == 1 }}", True),
    ("{% if n > 50 %}true{% else %}false{% endif %}", True),
    ("{% if n > 500 %}true{% else %}false{% endif %}", False),
    ("{{ later }}", False),
])
def test_evaluate_when(when: Any, expected: bool) -> None:
    assert evaluate_when(when, SCOPE) is expected


@pytest.mark.parametrize("when", ["{{ nope == 1 }}", "{{ nope != 1 }}", "{{ nope }}", "{{ n > 1 and nope }}"])
def test_evaluate_when_with_an_unknown_name_is_an_error(when: str) -> None:
    """A typo in a `when` fails loudly instead of quietly never (or always) firing."""
    with pytest.raises(TemplateError, match="nope"):
        evaluate_when(when, SCOPE)


def test_set_path_creates_and_replaces() -> None:
    target: dict[str, Any] = {"a": 1, "b": {"keep": True}, "c": "scalar"}
    set_path(target, "x", 1)
    set_path(target, "b.c.d", [1])
    set_path(target, "c.e", 2)  # a scalar on the way is replaced by a dict
    set_path(target, "a", {"new": 1})
    assert target == {"a": {"new": 1}, "b": {"keep": True, "c": {"d": [1]}}, "c": {"e": 2}, "x": 1}


# ---------------------------------------------------------------- the engine's scope (when / set)

SCOPE_PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: scope, path: tests/templates/scope}
workload:
  limit: 100
  nested: {k: v}
workflow:
  - step: start
    tool: {kind: noop}
    set:
      ctx.limit_top: "{{ limit }}"
      ctx.limit_workload: "{{ workload.limit }}"
      ctx.nested: "{{ workload.nested }}"
      ctx.eid: "{{ execution_id }}"
      ctx.event: "{{ event.name }}"
      ctx.count: "{{ start.count }}"
      ctx.absent: "{{ start.absent }}"
    next:
      arcs:
        - step: big
          when: "{{ start.count > workload.limit and ctx.limit_top == limit and event.name == 'call.done' }}"
          set: {ctx.via: big}
        - step: small
          set: {ctx.via: small}
  - step: big
    tool: {kind: noop}
    next:
      arcs:
        - step: recover
          when: "{{ event.name == 'call.error' }}"
  - step: small
    tool: {kind: noop}
  - step: recover
    tool: {kind: noop}
"""


def ok(ref: int = 1) -> dict[str, Any]:
    return {"status": "ok", "reference": {"ref_id": ref, "type": "db", "uri": f"pg://result_payload/{ref}"},
            "parent_ref": None, "context": {}}


def start(flow: Flow, workload: dict[str, Any]) -> Any:
    return flow.start(StartInput(4242, 0, 1, deadline_ms=10_000), workload).state


def finish(flow: Flow, state: Any, step: str, envelope: dict[str, Any], workload: dict[str, Any],
           values: dict[str, Any]) -> Any:
    command = next(c for c, p in state.pending.items() if p.step == step)
    res = CallResultInput(command, 1, envelope)
    assert set(flow.needs(state, res)) <= set(values)  # the engine resolves exactly these
    return flow.on_result(state, res, workload, values)


@pytest.mark.parametrize(("count", "via"), [(150, "big"), (50, "small")])
def test_engine_scope_workload_ctx_step_results_execution_id_and_event(count: int, via: str) -> None:
    pb = parse_playbook(SCOPE_PLAYBOOK)
    flow = Flow(pb)
    workload = {"limit": 100, "nested": {"k": "v"}}
    state = start(flow, workload)
    t = finish(flow, state, "start", ok(), workload, {"start": {"count": count}})
    assert t.state.ctx == {"limit_top": 100, "limit_workload": 100, "nested": {"k": "v"}, "eid": 4242,
                           "event": "call.done", "count": count, "absent": None, "via": via}
    assert [c.step for c in t.commands] == [via]
    # the command carries the scope its worker renders with: ctx as set, the event that entered it
    assert t.commands[0].context["ctx"]["via"] == via
    assert t.commands[0].context["event"] == {"name": "call.done", "step": "start"}


def test_engine_scope_routes_a_failure_by_event_name() -> None:
    flow = Flow(parse_playbook(SCOPE_PLAYBOOK))
    workload = {"limit": 100, "nested": {"k": "v"}}
    state = finish(flow, start(flow, workload), "start", ok(), workload, {"start": {"count": 500}}).state
    error = {"status": "error", "reference": None, "parent_ref": None, "context": {},
             "error": {"code": "TOOL_ERROR", "message": "boom"}}
    t = finish(flow, state, "big", error, workload, {})
    assert [c.step for c in t.commands] == ["recover"]
    assert t.commands[0].context["event"] == {"name": "call.error", "step": "big"}


def test_engine_unknown_name_in_set_fails_the_execution_naming_step_and_template() -> None:
    text = SCOPE_PLAYBOOK.replace('ctx.absent: "{{ start.absent }}"', 'ctx.absent: "{{ no_such_name }}"')
    flow = Flow(parse_playbook(text))  # the api's submit-time checks would reject it; the router still must not
    workload = {"limit": 100, "nested": {"k": "v"}}
    t = finish(flow, start(flow, workload), "start", ok(), workload, {"start": {"count": 1}})
    assert t.state.status == "failed" and t.commands == []
    assert "step 'start'" in (t.state.error or "") and "no_such_name" in (t.state.error or "")
    assert [e.event_type for e in t.events] == ["call.done", "playbook.failed"]


# ---------------------------------------------------------------- the worker's scope (inputs)


async def test_worker_scope_workload_both_ways_ctx_steps_execution_id_event() -> None:
    store = MemoryResultStore()
    ref = await store.put({"rows": [{"id": 7}], "count": 1}, execution_id=9, step="fetch", command_id="9:fetch:1",
                          task="fetch", parent_ref_id=None)
    other = await store.put({"never": "read"}, execution_id=9, step="other", command_id="9:other:1",
                            task="other", parent_ref_id=None)
    context = {"execution_id": 9, "workload": {"limit": 100, "user": {"name": "ada"}},
               "ctx": {"seen": 3}, "event": {"name": "call.done", "step": "fetch"}, "iter": None,
               "steps": {"fetch": {"status": "ok", "reference": ref.to_json()},
                         "other": {"status": "ok", "reference": other.to_json()},
                         "inline": {"value": 5}},
               "known_steps": ["start", "fetch", "other", "inline", "later"]}
    spec = {"tool": {"kind": "python", "code_b64": "{{ other }}"},  # base64 code is not a template: not resolved
            "input": {"top": "{{ limit }}", "nested": "{{ workload.limit }}", "user": "{{ user.name }}",
                      "wuser": "{{ workload.user }}", "ctx": "{{ ctx.seen }}", "row": "{{ fetch.rows[0].id }}",
                      "fetch": "{{ fetch }}", "eid": "{{ execution_id }}", "event": "{{ event.name }}",
                      "later": "{{ later }}", "inline": "{{ inline }}", "text": "limit {{ limit }}"}}
    assert template_names(spec) == {"limit", "workload", "user", "ctx", "fetch", "execution_id", "event", "later",
                                    "inline"}
    scope = await build_scope(context, spec, store)
    assert "other" not in scope  # only the step results the templates name are resolved
    assert render(spec["input"], scope) == {
        "top": 100, "nested": 100, "user": "ada", "wuser": {"name": "ada"}, "ctx": 3, "row": 7,
        "fetch": {"rows": [{"id": 7}], "count": 1}, "eid": 9, "event": "call.done", "later": None,
        "inline": 5, "text": "limit 100"}
    with pytest.raises(TemplateError, match="undeclared"):
        render_str("{{ undeclared }}", scope)
