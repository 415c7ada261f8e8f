"""NATS KV is a read-through cache only (seed 004 invariant 3): on a stack with
``NOETL_RESULT_CACHE=kv`` the cache serves reads, and emptying it mid-run (again and
again, from another connection) changes nothing but latency: the same results per step
and iteration, each iteration accepted once, the same accepted events per step and type
(but for how many of a loop's iterations each call.done answers for: batches follow the
iterations' pace)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Runner, accepted_iterations, event_counts, start_stack

from noetl_cli import devstack

pytestmark = pytest.mark.e2e

BUCKET = "noetl_results"

PLAYBOOK = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kv_purge, path: tests/kv/purge}
workload:
  n: 12
workflow:
  - step: seed
    tool:
      kind: python
      input: {n: "{{ n }}"}
      code: "result = {'items': [{'k': i, 'w': (i * 37) % 11} for i in range(n)], 'base': 10}"
    next: {arcs: [{step: fan}]}
  - step: fan
    loop:
      in: "{{ seed['items'] }}"
      iterator: item
      spec: {mode: parallel, max_in_flight: 4}
    tool:
      kind: python
      input: {item: "{{ item }}", base: "{{ seed.base }}"}
      code: "result = {'k': item['k'], 'v': item['w'] * base}"
    next:
      arcs:
        - step: total
          when: "{{ event.name == 'loop.done' }}"
  - step: total
    tool:
      kind: python
      input: {rows: "{{ fan.results }}", base: "{{ seed.base }}"}
      code: "result = {'sum': sum(r['v'] for r in rows), 'count': len(rows), 'base': base}"
    next:
      arcs:
        - step: big
          when: "{{ total.sum > 0 and seed.base == 10 }}"
        - step: small
  - step: big
    tool:
      kind: python
      input: {s: "{{ total.sum }}", first: "{{ fan.results[0] }}"}
      code: "result = {'label': 'big', 'sum': s, 'first': first}"
  - step: small
    tool: {kind: python, code: "result = {'label': 'small'}"}
"""


@pytest.fixture(scope="module")
def kv_stack() -> Iterator[Runner]:
    home = Path(tempfile.mkdtemp(prefix="noetl-kv-"))
    os.chmod(home, 0o755)
    state = start_stack(home, env={"NOETL_RESULT_CACHE": "kv", "NOETL_RESULT_KV_BUCKET": BUCKET})
    runner = Runner(state)
    try:
        yield runner
    finally:
        runner.api.close()
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)


def snapshot(runner: Runner, execution_id: int) -> dict[str, Any]:
    out = runner.wait(execution_id, timeout=120)
    assert out.status == "COMPLETED", out.error
    steps = {name: (s["status"], s["result"]) for name, s in out.steps.items()}
    counts = {step: event_counts(runner, execution_id, step) for step in out.steps}
    # How many iterations one command of the loop runs follows the pace of its iterations
    # (noetl_flow.loops.batch_size), so the number of the loop's call.done events may differ
    # between runs. What may not differ: each iteration accepted once, and its outcome.
    counts["fan"] = {t: n for t, n in counts["fan"].items() if t not in ("call.done", "call.error")}
    iterations = accepted_iterations(runner, execution_id, "fan")
    outcomes = sorted(tuple(r) for r in runner.sql(
        "SELECT idx, status FROM noetl.loop_result WHERE execution_id = %s", (execution_id,)))
    return {"steps": steps, "events": counts, "iterations": iterations, "outcomes": outcomes,
            "total": runner.sql("SELECT event_type, count(*) FROM noetl.event WHERE execution_id = %s"
                                " AND event_type <> 'checkpoint.committed'"
                                " AND NOT (step = 'fan' AND event_type IN ('call.done', 'call.error'))"
                                " GROUP BY 1 ORDER BY 1", (execution_id,))}


def cache_hits(state: devstack.StackState) -> float:
    total = 0.0
    for role in ("api", "worker"):
        for proc in state.processes(role):
            with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith('noetl_result_cache_requests_total{cache="kv",outcome="hit"}'):
                        total += float(line.split()[-1])
    return total


class Purger:
    """Empties the KV bucket every few milliseconds from its own NATS connection."""

    def __init__(self, state: devstack.StackState) -> None:
        self.state = state
        self.stop = threading.Event()
        self.purges = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        nc = await self.state.nats_connect("test-purger")
        js = nc.jetstream()
        try:
            while not self.stop.is_set():
                try:
                    await js.purge_stream(f"KV_{BUCKET}")
                    self.purges += 1
                except Exception:
                    pass
                await asyncio.sleep(0.01)  # a sleep, not a wait: the fault is a purge every 10 ms
        finally:
            await nc.close()

    def __enter__(self) -> Purger:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_emptying_the_kv_cache_mid_run_changes_nothing_but_latency(kv_stack: Runner) -> None:
    baseline = snapshot(kv_stack, kv_stack.submit(PLAYBOOK).execution_id)
    assert baseline["steps"]["big"][1]["label"] == "big" and baseline["steps"]["total"][1]["count"] == 12
    assert baseline["iterations"] == list(range(12)) and baseline["outcomes"] == [(i, "ok") for i in range(12)]
    assert "small" not in baseline["steps"]

    hits = cache_hits(kv_stack.state)
    again = snapshot(kv_stack, kv_stack.submit(PLAYBOOK).execution_id)
    assert again == baseline
    assert cache_hits(kv_stack.state) > hits, "the KV cache served no read"

    with Purger(kv_stack.state) as purger:
        purged = snapshot(kv_stack, kv_stack.submit(PLAYBOOK).execution_id)
    assert purger.purges > 10
    assert purged == baseline

    # dropping the whole bucket mid-run: the stores read through and re-create it
    async def drop() -> None:
        nc = await kv_stack.state.nats_connect("test-drop")
        try:
            await nc.jetstream().delete_key_value(BUCKET)
        finally:
            await nc.close()

    sub = kv_stack.submit(PLAYBOOK)
    asyncio.run(drop())
    assert snapshot(kv_stack, sub.execution_id) == baseline
