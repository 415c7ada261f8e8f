"""Steps written with neither ``tool`` nor ``loop`` (upstream's plain ``- step: end``, and
routing-only steps) run nothing and route by their ``next``, through all seven roles."""

from __future__ import annotations

import pytest
from harness import Runner

pytestmark = pytest.mark.e2e

PLAYBOOK = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: routing_only_steps
  path: tests/routing_only_steps
workload:
  threshold: 5
workflow:
  - step: start
    tool:
      kind: python
      code: |
        result = {"value": 7}
    next:
      arcs:
        - step: decide
  - step: decide
    desc: routing only
    next:
      spec:
        mode: exclusive
      arcs:
        - step: high
          when: "{{ start.value > workload.threshold }}"
        - step: low
  - step: high
    tool:
      kind: python
      code: |
        result = {"branch": "high"}
    next:
      arcs:
        - step: end
  - step: low
    tool:
      kind: python
      code: |
        result = {"branch": "low"}
    next:
      arcs:
        - step: end
  - step: end
    desc: nothing to run
"""


def test_steps_without_a_tool_route_and_end(runner: Runner) -> None:
    out = runner.run(PLAYBOOK)
    assert out.status == "COMPLETED", out.error
    assert {"start", "decide", "high", "end"} <= set(out.steps) and "low" not in out.steps
    assert out.result("high") == {"branch": "high"}
