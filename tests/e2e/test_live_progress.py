"""Live progress through all seven roles: GetExecution carries a running loop's
iterations (done / total / failed) as the projector accepts them, ``run`` shows them on
stderr while it follows, and ``events --limit`` / ``--follow`` read the log."""

from __future__ import annotations

import json

import pytest
from harness import Runner
from waiting import until_sync

from noetl_proto.v1 import common_pb2, execution_pb2

pytestmark = pytest.mark.e2e

LOOP = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: live_progress
  path: tests/live_progress
workload:
  items: 200
  pause: 0.02
workflow:
  - step: start
    loop:
      in: "{{ range(workload['items']) | list }}"
      iterator: n
      spec: {mode: parallel, max_in_flight: 4}
    tool:
      kind: python
      input: {n: "{{ n }}", pause: "{{ workload.pause }}"}
      code: |
        import time
        time.sleep(pause)
        if n % 50 == 7:
            raise ValueError(f"item {n} is bad")
        result = n
    next:
      arcs:
        - step: end
          when: "{{ event.name == 'loop.failed' }}"
  - step: end
    tool: {kind: noop}
"""


def loop_of(runner: Runner, execution_id: int) -> execution_pb2.StepState | None:
    ex = runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(execution_id=execution_id),
                                            timeout=10).execution
    return next((s for s in ex.steps if s.name == "start" and s.HasField("loop")), None)


def test_a_running_loop_reports_its_iterations(runner: Runner) -> None:
    eid = runner.submit(LOOP).execution_id
    seen: list[int] = []

    def midway() -> bool:
        step = loop_of(runner, eid)
        if step is not None and step.status == common_pb2.STEP_STATUS_RUNNING:
            seen.append(step.loop.done)
            assert step.loop.total == 200
            return 0 < step.loop.done < 200
        return False

    until_sync(midway, timeout=60, what="the loop's progress while it runs")
    out = runner.wait(eid, timeout=120)
    assert out.status == "COMPLETED", out.error
    step = loop_of(runner, eid)
    assert step is not None
    assert (step.loop.total, step.loop.done, step.loop.failed) == (200, 200, 4)
    assert seen == sorted(seen)  # never goes back

    shown = runner.cli("status", str(eid))
    assert shown.returncode == 0, shown.stderr
    assert "200/200 (4 failed)" in shown.stdout
    doc = json.loads(runner.cli("status", str(eid), "--json").stdout)
    assert doc["steps"]["start"]["loop"] == {"total": 200, "done": 200, "failed": 4}


def test_run_shows_progress_and_events_limit_and_follow(runner: Runner, tmp_path: object) -> None:
    from pathlib import Path

    playbook = Path(str(tmp_path)) / "live.yaml"
    playbook.write_text(LOOP.replace("items: 200", "items: 120").replace("pause: 0.02", "pause: 0.05"))
    run = runner.cli("run", str(playbook), "--timeout", "120", "--json")
    assert run.returncode == 0, run.stderr
    progress = [ln for ln in run.stderr.splitlines() if ln.strip().startswith("start") and "/120" in ln]
    assert progress, run.stderr  # at least one progress line while the loop ran
    doc = json.loads(run.stdout)
    assert doc["steps"]["start"]["loop"] == {"total": 120, "done": 120, "failed": 3}
    eid = doc["execution_id"]

    last = runner.cli("events", eid, "--limit", "3", "--json")
    assert last.returncode == 0, last.stderr
    events = json.loads(last.stdout)["events"]
    assert len(events) == 3 and events[-1]["event_type"] == "playbook.completed"

    everything = json.loads(runner.cli("events", eid, "--json").stdout)["events"]
    followed = runner.cli("events", eid, "--follow", "--json", timeout=60)  # ended already: prints all, exits
    assert followed.returncode == 0, followed.stderr
    lines = [json.loads(ln) for ln in followed.stdout.splitlines()]
    assert [e["event_id"] for e in lines] == [e["event_id"] for e in everything]
    bad = runner.cli("events", eid, "--limit", "0")
    assert bad.returncode == 2 and "--limit" in bad.stderr
