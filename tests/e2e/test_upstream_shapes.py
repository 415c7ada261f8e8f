"""Upstream's value shapes and bindings that its own playbooks rely on, through all seven
roles: a postgres task's ``command_<i>`` entries beside the top-level rows (what upstream's
production playbooks read), a python task's ``args``, and a failed step that an arc about
its results must not carry on (docs/CONFORMANCE.md)."""

from __future__ import annotations

import pytest
from harness import Runner

pytestmark = pytest.mark.e2e

SHAPES = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: upstream_shapes
  path: tests/upstream_shapes
workload:
  pg_auth: pg_local
workflow:
  - step: start
    tool:
      kind: postgres
      auth: "{{ pg_auth }}"
      command: |
        CREATE TEMP TABLE shapes_items (id int, name text);
        INSERT INTO shapes_items VALUES (1, 'a'), (2, 'b'), (3, 'c');
        SELECT count(*) AS n FROM shapes_items;
        SELECT id, name FROM shapes_items ORDER BY id;
    next:
      arcs:
        - step: each
  - step: each
    loop:
      in: "{{ start.command_3.rows }}"
      iterator: item
      spec: {mode: sequential}
    tool:
      kind: python
      args:
        total: "{{ start.command_2.rows[0].n }}"
        tag: "{{ start.command_1.message }}"
      input:
        name: "{{ item.name }}"
      code: |
        def main(name, total, tag):
            return {"name": name, "of": total, "tag": tag}
    next:
      arcs:
        - step: end
  - step: end
    tool:
      kind: python
      input:
        top: "{{ start.rows | length }}"
      code: |
        result = {"top_rows": top}
"""

FAILING = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: upstream_failed_step
  path: tests/upstream_failed_step
workflow:
  - step: start
    tool:
      kind: python
      code: |
        raise RuntimeError("no rows today")
    next:
      arcs:
        - step: nothing_found
          when: "{{ not start.rows }}"
  - step: nothing_found
    tool:
      kind: python
      code: |
        result = {"ran": True}
"""


def test_postgres_statements_and_python_args_as_upstream_reads_them(runner: Runner) -> None:
    out = runner.run(SHAPES)
    assert out.status == "COMPLETED", out.error
    start = out.result("start")
    assert start["rows"] == [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}]
    assert start["command_0"] == {"status": "success", "row_count": 0, "message": "CREATE TABLE"}
    assert start["command_2"] == {"status": "success", "rows": [{"n": 3}], "row_count": 1, "columns": ["n"]}
    assert out.result("each")["results"] == [{"name": n, "of": 3, "tag": "INSERT 0 3"} for n in "abc"]
    assert out.result("end") == {"top_rows": 3}


def test_a_failed_step_is_not_carried_on_by_an_arc_about_its_results(runner: Runner) -> None:
    out = runner.run(FAILING)
    assert out.status == "FAILED"
    assert "no rows today" in (out.error or "") and "nothing_found" not in out.steps
