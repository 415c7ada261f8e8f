"""The submit-time name check agrees with the scopes the runtime renders in: every name it
accepts is one the worker or the engine defines, and what they define is accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from noetl_api.static_checks import STEP_NAMES, TASK_NAMES, TASK_SET_NAMES, check_templates
from noetl_common.errors import PlaybookInvalid
from noetl_dsl import parse_playbook
from noetl_dsl.templates import _ENV, RenderContext
from noetl_flow import ExecState, Flow
from noetl_flow.router import Inputs
from noetl_worker.pipeline import _State
from noetl_worker.scope import build_scope

PLAYBOOKS = Path(__file__).resolve().parents[2].parent / "shared/conformance/noetl-e2e/playbooks"
FIXTURES = sorted(p for p in PLAYBOOKS.rglob("*.yaml") if "broken_playbooks" not in p.parts) \
    if PLAYBOOKS.is_dir() else []

BASE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: n, path: n}
workload: {limit: 3}
workflow:
  - step: start
    tool:
      - name: fetch
        kind: http
        url: "http://x/{{ limit }}"
        set: {page: "{{ output.page }}"}
      - name: save
        kind: noop
        input: {p: "{{ page }}", prev: "{{ _prev }}", f: "{{ fetch }}"}
    set:
      ctx.total: "{{ output.data.total }}"
    next:
      arcs:
        - step: end
          when: "{{ output.status == 'ok' and event.name == 'call.done' and ctx.total > limit }}"
          set: {ctx.last: "{{ start.total }}"}
  - step: end
    tool: {kind: noop}
"""


def check(text: str, workload: dict[str, Any] | None = None) -> None:
    check_templates(parse_playbook(text), workload or {"limit": 3})


def test_step_set_and_arcs_may_read_output_and_task_set_reads_its_raw_result() -> None:
    check(BASE)


@pytest.mark.parametrize(("old", "new", "where"), [
    ('ctx.total: "{{ output.data.total }}"', 'ctx.total: "{{ outptu.data.total }}"', "workflow[0].set"),
    ("when: \"{{ output.status == 'ok'", "when: \"{{ _prev == 'ok'", "workflow[0].next.arcs[0].when"),
    ('{ctx.last: "{{ start.total }}"}', '{ctx.last: "{{ iter.total }}"}', "workflow[0].next.arcs[0].set"),
    ('prev: "{{ _prev }}"', 'prev: "{{ output }}"', "workflow[0].tool[1].input"),
    ('prev: "{{ _prev }}"', 'prev: "{{ result.x }}"', "workflow[0].tool[1].input"),
    ('{page: "{{ output.page }}"}', '{page: "{{ secret.x }}"}', "workflow[0].tool[0].set"),
    ('{ctx.last: "{{ start.total }}"}', '{ctx.last: "{{ input_data.x }}"}', "workflow[0].next.arcs[0].set"),
])
def test_names_nothing_defines_are_refused_where_they_are_read(old: str, new: str, where: str) -> None:
    assert old in BASE
    with pytest.raises(PlaybookInvalid) as info:
        check(BASE.replace(old, new))
    assert where in str(info.value)


def test_the_engines_routing_scope_defines_every_step_name() -> None:
    flow = Flow(parse_playbook(BASE))
    st = ExecState(execution_id=1, shard_id=0, catalog_id=1)
    scope = flow._scope(st, Inputs({"limit": 3}, {}), {"name": "call.done", "step": "start"},
                        {"status": "ok", "data": None, "error": None})
    assert STEP_NAMES - set(_ENV.globals) == set(scope) - {"limit"}


async def test_the_workers_task_scope_defines_every_task_name() -> None:
    # a loop iteration's command scope (no step results to read: the store is not asked),
    # plus the keychain the runner adds, inside a pipeline
    command = await build_scope({"workload": {}, "steps": {}, "ctx": {}, "execution_id": 1,
                                 "event": {}, "iter": {"item": 1}, "loop_index": 0}, {}, None, set())  # type: ignore[arg-type]
    state = _State(RenderContext({**command, "keychain": {}}, known=command.known))
    defined = set(state.task_scope("t", 1)) | set(_ENV.globals)
    assert TASK_NAMES <= defined
    assert TASK_SET_NAMES - TASK_NAMES == {"output"}


@pytest.mark.skipif(not FIXTURES, reason=f"upstream fixtures not found under {PLAYBOOKS}")
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: str(p.relative_to(PLAYBOOKS)))
def test_every_upstream_fixture_passes_the_name_check(path: Path) -> None:
    pb = parse_playbook(path.read_text())
    check_templates(pb, dict(pb.workload or {}))
