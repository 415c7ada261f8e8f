"""Collection loops through all seven processes.

Upstream playbooks that loop (read in place from ../shared) run unchanged, with the
values upstream's playbook_test_config.yaml expects where it has an entry and otherwise
the values the playbooks' own code computes/asserts. Then the loop contract itself
(libs/noetl_flow/loops.py): results in iteration order, `max_in_flight`, one event per
iteration plus two per loop, exactly one `loop.done` per loop instance, failed
iterations, re-entering a loop step, cancelling a running loop.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    INSERTED_ONE,
    Runner,
    accepted_iterations,
    cancel,
    command_counts,
    conformance,
    event_counts,
    execute,
    meta,
    put_credential,
    worker_busy,
    worker_log,
)
from waiting import until_sync

from bench.fixture_api import DATA, TestApi, serve
from noetl_client import values
from noetl_common.vocab import loop_span

pytestmark = pytest.mark.e2e

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: {name}\n  path: tests/loops/{name}\n"
MEASURED: dict[str, Any] = {}


def playbook(name: str, body: str) -> str:
    return HEADER.format(name=name) + body


@pytest.fixture(scope="module")
def http_api() -> Iterator[TestApi]:
    with serve() as api:
        yield api


def loop_done_events(runner: Runner, execution_id: int, step: str | None = None) -> list[Any]:
    return [e for e in runner.events(execution_id)
            if e.event_type == "loop.done" and (step is None or e.step == step)]


def assert_sequential(runner: Runner, execution_id: int, step: str) -> None:
    """Each command (one iteration, or a batch its worker runs one at a time) was created
    no earlier than the previous one finished, and took up the indexes where it left off."""
    rows = runner.sql("SELECT command_id, created_at, updated_at, status FROM noetl.command"
                      " WHERE execution_id = %s AND step = %s", (execution_id, step))
    rows.sort(key=lambda r: r[1])
    assert all(r[3] == "done" for r in rows)
    for prev, cur in itertools.pairwise(rows):
        assert cur[1] >= prev[2], f"{cur[0]} was issued before {prev[0]} finished"
    spans = [loop_span(str(r[0])) or (int(str(r[0]).rsplit(":", 1)[1]), 1) for r in rows]
    assert spans[0][0] == 0 and all(prev[0] < cur[0] <= prev[0] + prev[1] for prev, cur in itertools.pairwise(spans)), spans


# ---------------------------------------------------------------- upstream playbooks


def test_simple_loop(runner: Runner) -> None:
    out = runner.run(conformance("root_scripts/test_simple_loop.yaml"))
    assert out.status == "COMPLETED", out.error
    assert out.result("start") == {"status": "started"}
    assert out.result("loop_test") == {
        "results": [{"value": 10, "name": "ten", "doubled": 20},
                    {"value": 20, "name": "twenty", "doubled": 40},
                    {"value": 30, "name": "thirty", "doubled": 60}],
        "stats": {"total": 3, "success": 3, "failed": 0},
    }
    assert out.result("end") == {"status": "completed"}
    assert len(loop_done_events(runner, out.execution_id, "loop_test")) == 1
    assert_sequential(runner, out.execution_id, "loop_test")


def test_loop_test_two_sequential_loops(runner: Runner) -> None:
    out = runner.run(conformance("loop_test.yaml"))
    assert out.status == "COMPLETED", out.error
    # `loop_index` and the iterator reach the code through `input_data`; top-level `return`.
    assert out.result("start")["results"] == [{"number": n, "doubled": 2 * n, "index": n - 1} for n in range(1, 6)]
    assert out.result("start")["stats"] == {"total": 5, "success": 5, "failed": 0}
    assert out.result("process") == {"original_sum": 15, "doubled_sum": 30, "count": 5}
    assert out.result("user_loop")["results"] == [
        {"name": "Alice", "age": 30, "category": "senior", "index": 0},
        {"name": "Bob", "age": 25, "category": "junior", "index": 1},
        {"name": "Charlie", "age": 35, "category": "senior", "index": 2},
    ]
    assert out.result("verify") == {"status": "passed", "original_sum": 15, "doubled_sum": 30, "count": 5}
    assert out.result("end") == {"status": "ok", "test_passed": True}
    done = loop_done_events(runner, out.execution_id)
    assert [e.step for e in done] == ["start", "user_loop"]


def test_loop_instance_isolation(runner: Runner) -> None:
    out = runner.run(conformance("test_loop_instance_isolation/playbook.yaml"))
    assert out.status == "COMPLETED", out.error
    users = {"results": [{"type": "user", "id": 1, "name": "Alice", "message": "Processed user Alice"},
                         {"type": "user", "id": 2, "name": "Bob", "message": "Processed user Bob"}],
             "stats": {"total": 2, "success": 2, "failed": 0}}
    products = {"results": [{"type": "product", "id": 101, "name": "Laptop", "message": "Processed product Laptop"},
                            {"type": "product", "id": 102, "name": "Mouse", "message": "Processed product Mouse"}],
                "stats": {"total": 2, "success": 2, "failed": 0}}
    verify = out.result("verify_results")
    assert verify == {"users_count": 2, "products_count": 2, "verification": "Both loops completed independently",
                      "users_results": users, "products_results": products}
    assert out.result("end") == {"message": "Workflow completed"}
    done = loop_done_events(runner, out.execution_id)
    assert sorted(e.step for e in done) == ["process_items_products", "process_items_users"]
    assert len({meta(e)["loop_instance"] for e in done}) == 2


def test_heavy_loop_aggregation_100_items(runner: Runner) -> None:
    started = time.monotonic()
    out = runner.run(conformance("load_test/heavy_loop_aggregation/heavy_loop_aggregation.yaml"), timeout=150)
    MEASURED["heavy_loop_aggregation (100 sequential items, ctx grows each iteration) wall s"] = round(
        time.monotonic() - started, 2)
    assert out.status == "COMPLETED", out.error
    loop = out.result("process_items")
    assert loop["stats"] == {"total": 100, "success": 100, "failed": 0}
    # Sequential, and each iteration saw the ctx.loop_results its predecessor's policy set.
    for i, item in enumerate(loop["results"]):
        assert item["item_result"]["item_id"] == i and item["item_result"]["item_name"] == f"item_{i:04d}"
        assert [r["item_id"] for r in item["loop_results"]] == list(range(i + 1))
    agg = out.result("aggregate_results")
    assert agg["summary"] == {"total_processed": 100, "successful": 100, "failed": 0, "success_rate": 100.0}
    metrics = agg["metrics"]
    assert metrics["by_category"] == {f"category_{k}": 10 for k in range(10)}
    assert metrics["by_priority"] == {str(k): 20 for k in range(5)}
    assert metrics["even_items"] == 50 and metrics["odd_items"] == 50
    assert metrics["total_computed_value"] == sum(i * 100 * 2 for i in range(100))
    validate = out.result("validate_results")
    assert validate["all_checks_passed"] is True and validate["status"] == "validated"
    assert validate["final_message"] == "Heavy load loop test PASSED"
    assert [v["passed"] for v in validate["validations"]] == [True, True, True]
    assert validate["validations"][0]["message"] == "Processed 100 items as expected"
    assert out.result("end") == {"status": "completed", "test_name": "heavy_loop_aggregation",
                                 "test_result": "validated", "all_passed": True}


def test_python_retry_exception(runner: Runner) -> None:
    """Each attempt fails with probability 0.69; the policy allows 5 attempts (exponential
    backoff 0.2 s), so one run fails with probability ~0.16. Upstream expects COMPLETED:
    run until it completes (at most 6 runs), and check every failed run really exhausted
    its 5 attempts (>= 0.2+0.4+0.8+1.6 s between step.enter and call.error)."""
    failures = []
    for _ in range(6):
        out = runner.run(conformance("retry_test/python_retry_exception.yaml"), timeout=60)
        if out.status == "COMPLETED":
            start = out.result("start")
            value = start["data"]["value"]
            assert 70 <= value <= 100
            assert start == {"success": True, "message": f"Success after retry (value: {value})",
                             "data": {"value": value}}
            assert out.result("end") == {"status": "complete"}
            break
        assert out.status == "FAILED", out.error
        # the step's error: `Exception: <message>`, then the task's traceback
        first, *trace = out.steps["start"]["error"].splitlines()
        match = re.fullmatch(r"Exception: Random failure \(value: (\d+)\)", first)
        assert match and int(match.group(1)) < 70, out.steps["start"]["error"]
        assert trace and trace[0] == "Traceback (most recent call last):", out.steps["start"]["error"]
        events = {e.event_type: e for e in runner.events(out.execution_id)}
        spent = (events["call.error"].created_at.ToDatetime() - events["step.enter"].created_at.ToDatetime())
        assert spent.total_seconds() >= 3.0, f"failed after {spent} without exhausting the retries"
        failures.append(out.execution_id)
    else:
        pytest.fail(f"6 runs failed: {failures}")


def test_iterator_save_test_writes_one_row_per_item(runner: Runner) -> None:
    out = runner.run(conformance("iterator_save_test/iterator_save_test.yaml"))
    assert out.status == "COMPLETED", out.error
    # The step value is the last pipeline task's (save_item, postgres) per iteration.
    assert out.result("process_items") == {"results": [INSERTED_ONE] * 3,
                                           "stats": {"total": 3, "success": 3, "failed": 0}}
    assert out.result("end") == {"status": "complete"}
    eid = out.execution_id
    rows = runner.sql("SELECT id, item_name, item_value FROM public.iterator_save_test WHERE execution_id = %s"
                      " ORDER BY item_name", (str(eid),))
    assert rows == [(f"{eid}:item1", "item1", 100), (f"{eid}:item2", "item2", 200), (f"{eid}:item3", "item3", 300)]
    assert_sequential(runner, eid, "process_items")


def test_comprehensive_test_both_branches(runner: Runner) -> None:
    """`start` draws random 1..20; > threshold 10 takes process_high, else process_low.
    Run until both branches were seen (P(missing one in 16 runs) ~ 3e-5)."""
    seen: set[str] = set()
    for _ in range(16):
        out = runner.run(conformance("comprehensive_test.yaml"))
        assert out.status == "COMPLETED", out.error
        value = out.result("start")["random_value"]
        assert out.result("start") == {"status": "initialized", "random_value": value,
                                       "message": "Starting comprehensive test"}
        assert 1 <= value <= 20
        branch, processed = ("high", value * 2) if value > 10 else ("low", value + 100)
        assert ("process_low" if branch == "high" else "process_high") not in out.steps
        assert out.result(f"process_{branch}") == {"status": f"{branch}_processed", "original": value,
                                                   "processed": processed, "category": branch}
        assert out.result("summarize") == {"workflow": "comprehensive_test", "original_value": value,
                                           "processing_path": branch, "final_result": processed, "completed": True}
        assert out.result("end") == {"status": "completed"}
        seen.add(branch)
        if seen == {"high", "low"}:
            break
    assert seen == {"high", "low"}


def test_actions_test(runner: Runner) -> None:
    out = runner.run(conformance("actions_test.yaml"))
    assert out.status == "COMPLETED", out.error
    assert out.result("process_loop") == {
        "results": [{"original": 10, "doubled": 20}, {"original": 20, "doubled": 40},
                    {"original": 30, "doubled": 60}],
        "stats": {"total": 3, "success": 3, "failed": 0},
    }
    # `aggregate` reads `ctx.loop_results | default([])`, which nothing in the playbook sets
    # (the loop's policy sets only the iteration-scoped `iter.loop_result`), so its own
    # code counts 0 items and `verify` computes success=False: the values the code computes.
    assert out.result("aggregate") == {"count": 0, "original_sum": 0, "doubled_sum": 0}
    assert out.result("helper") == {"helper_called": True, "message": "Aggregate completed with 0 items"}
    verify = out.result("verify")
    assert verify["success"] is False and verify["message"] == "Some tests failed"
    assert out.result("end") == {"status": "completed", "success": False}


def test_atomic_item_context(runner: Runner) -> None:
    out = runner.run(conformance("atomic_item_context.yaml"))
    assert out.status == "COMPLETED", out.error
    assert out.result("producer_a") == {"tag": "AAA_KEEP"}
    assert out.result("producer_b") == {"tag": "BBB_DROP"}
    assert out.result("consumer") == {"consumed": "AAA_KEEP"}
    assert out.result("end") == {"status": "completed"}
    enters = [e.step for e in runner.events(out.execution_id) if e.event_type == "step.enter"]
    assert enters == ["start", "producer_a", "producer_b", "consumer", "end"]


@pytest.fixture(scope="module")
def results_table(runner: Runner) -> str:
    """v10_canonical_example writes with `auth: pg_test` into `results(item_id, data)`,
    which it does not create (upstream's setup tasks would)."""
    put_credential(runner, "pg_test")
    execute(runner, "CREATE TABLE IF NOT EXISTS public.results (item_id int PRIMARY KEY, data text)")
    execute(runner, "TRUNCATE public.results")
    return "public.results"


def test_v10_canonical_example(runner: Runner, http_api: TestApi, results_table: str) -> None:
    http_api.clear()
    out = runner.run(conformance("v10_canonical_example.yaml"), {"api_url": http_api.url})
    assert [(r.method, r.path) for r in http_api.requests()] == [("GET", "/data")]
    assert out.result("start") == {"status": "initialized", "timestamp": "now"}
    fetched = out.result("fetch_data")
    assert fetched["status_code"] == 200 and fetched["body"] == DATA
    # The http tool's value carries the parsed body as `body` and as `data` (upstream
    # playbooks read `{{ step.data }}`), so `validate` sees the records.
    assert fetched["data"] == DATA
    assert out.status == "COMPLETED", out.error
    # `transform` reads `prev.get("count")` from `validate_result: "{{ output }}"`, a task's
    # own `set`, where (as upstream) `output` is the task's raw result: the 3 records.
    assert out.result("process_data") == {"transformed": True, "items": 3}
    # store_results: `process_data.results.transform.items` is absent, so `or [1, 2, 3]`.
    loop = out.result("store_results")
    assert loop["stats"] == {"total": 3, "success": 3, "failed": 0}
    assert sorted(r[0] for r in runner.sql(f"SELECT item_id FROM {results_table}")) == [1, 2, 3]
    end = out.result("end")
    assert end["status"] == "COMPLETED" and end["message"] == "Workflow finished successfully"
    assert end["context"] == {"fetch_completed": True, "transform_done": True}


# ---------------------------------------------------------------- the loop contract

THOUSAND = playbook("thousand", """workload:
  items: []
workflow:
  - step: fan
    loop:
      in: "{{ items }}"
      iterator: item
      spec: {mode: parallel, max_in_flight: 32}
    tool:
      kind: python
      input: {item: "{{ item }}", idx: "{{ loop_index }}"}
      code: "result = {'key': item['key'], 'square': item['key'] * item['key'], 'idx': idx}"
    next:
      arcs:
        - step: after
          when: "{{ event.name == 'loop.done' }}"
  - step: after
    tool: {kind: noop}
""")


def test_thousand_item_parallel_loop(runner: Runner) -> None:
    n = 1000
    items = [{"key": (i * 7919) % n} for i in range(n)]  # a permutation: item i is not i
    started = time.monotonic()
    sub = runner.submit(THOUSAND, {"items": items})
    out = runner.wait(sub.execution_id, timeout=150)
    wall = time.monotonic() - started
    assert out.status == "COMPLETED", out.error
    value = out.result("fan")
    assert value["stats"] == {"total": n, "success": n, "failed": 0}
    assert len(value["results"]) == n
    for i, (item, res) in enumerate(zip(items, value["results"], strict=True)):
        assert res == {"key": item["key"], "square": item["key"] ** 2, "idx": i}
    assert "after" in out.steps

    eid = out.execution_id
    counts = event_counts(runner, eid, "fan")
    assert counts.get("loop.done") == 1
    assert accepted_iterations(runner, eid, "fan") == list(range(n))  # each accepted exactly once
    per_iteration = sum(counts.values()) / n
    # at most 1 per iteration + 2 per loop: one call.done per command, and a command runs a
    # batch of iterations (noetl_flow.loops.batch_size)
    assert set(counts) == {"step.enter", "call.done", "loop.done"} and counts["call.done"] <= n, counts
    assert runner.sql("SELECT count(*) FROM noetl.loop_item WHERE execution_id = %s", (eid,))[0][0] == n
    assert runner.sql("SELECT count(*), count(DISTINCT idx) FROM noetl.loop_result WHERE execution_id = %s",
                      (eid,))[0] == (n, n)
    span = runner.sql("SELECT extract(epoch FROM max(created_at) - min(created_at)) FROM noetl.event"
                      " WHERE execution_id = %s", (eid,))[0][0]
    MEASURED["1,000-item parallel loop (max_in_flight 32) wall s, submit->terminal"] = round(wall, 2)
    MEASURED["1,000-item parallel loop first->last event s"] = round(float(span), 2)
    MEASURED["events per iteration (loop step)"] = per_iteration
    MEASURED["events of the loop step"] = counts


def probe_loop(name: str, mode: str, width: int) -> str:
    return playbook(name, f"""workload:
  api_url: ""
  n: 1
  delay: 0
workflow:
  - step: probes
    loop:
      in: "{{{{ n }}}}"
      iterator: i
      spec: {{mode: {mode}, max_in_flight: {width}}}
    tool:
      kind: http
      method: GET
      url: "{{{{ api_url }}}}/api/v1/concurrency/probe"
      params: {{delay_seconds: "{{{{ delay }}}}", label: "probe-{{{{ i }}}}"}}
""")


@pytest.mark.parametrize(("mode", "width", "n", "delay", "expected_max"),
                         [("parallel", 3, 6, 2.0, 3), ("sequential", 3, 4, 0.3, 1)])
def test_max_in_flight_bounds_concurrent_iterations(runner: Runner, http_api: TestApi, mode: str, width: int,
                                                    n: int, delay: float, expected_max: int) -> None:
    http_api.state.reset()
    out = runner.run(probe_loop(f"probe_{mode}", mode, width),
                     {"api_url": http_api.url, "n": n, "delay": delay}, timeout=60)
    assert out.status == "COMPLETED", out.error
    assert http_api.state.stats() == {"started": n, "completed": n, "active": 0, "max_active": expected_max}
    labels = [r["body"]["label"] for r in out.result("probes")["results"]]
    assert labels == [f"probe-{i}" for i in range(n)]
    if mode == "sequential":  # batches whose budget (0.25 s) each 0.3 s probe outruns: the rest runs next
        assert_sequential(runner, out.execution_id, "probes")
        assert len(runner.sql("SELECT 1 FROM noetl.command WHERE execution_id = %s AND step = 'probes'",
                              (out.execution_id,))) == n


def test_empty_collection_completes_the_loop_at_once(runner: Runner) -> None:
    out = runner.run(playbook("empty", """workflow:
  - step: nothing
    loop: {in: "{{ [] }}", iterator: x}
    tool: {kind: python, code: "result = 1"}
    next: {arcs: [{step: after}]}
  - step: after
    tool: {kind: python, input: {seen: "{{ nothing }}"}, code: "result = seen"}
"""))
    assert out.status == "COMPLETED", out.error
    empty = {"results": [], "stats": {"total": 0, "success": 0, "failed": 0}}
    assert out.result("nothing") == empty and out.result("after") == empty
    assert runner.sql("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND step = 'nothing'",
                      (out.execution_id,))[0][0] == 0
    assert len(loop_done_events(runner, out.execution_id, "nothing")) == 1


FAILING = """workload:
  items: [0, 1, 2, 3, 4]
workflow:
  - step: work
    loop:
      in: "{{ items }}"
      iterator: n
      spec: {mode: parallel, max_in_flight: 2}
    tool:
      kind: python
      input: {n: "{{ n }}"}
      code: |
        if n in (1, 3):
            raise ValueError(f"item {n} is bad")
        result = {"n": n}
    next:
      arcs:
%s
  - step: after
    tool: {kind: noop}
  - step: recover
    tool:
      kind: python
      input: {seen: "{{ work }}"}
      code: "result = {'recovered': True, 'seen': seen}"
"""


def test_failed_iterations_fail_the_loop_step_and_the_execution(runner: Runner) -> None:
    out = runner.run(playbook("loopfail", FAILING % "        - step: after"))
    assert out.status == "FAILED"
    step = out.steps["work"]
    assert step["status"] == "FAILED"
    assert "2 of 5 iteration(s) failed" in step["error"]
    assert "work" in out.error and "2 of 5 iteration(s) failed" in out.error
    # Every iteration ran; results stay in iteration order, failed ones as null.
    assert step["result"] == {"results": [{"n": 0}, None, {"n": 2}, None, {"n": 4}],
                              "stats": {"total": 5, "success": 3, "failed": 2}}
    counts = event_counts(runner, out.execution_id, "work")
    assert accepted_iterations(runner, out.execution_id, "work") == list(range(5))
    assert counts["step.enter"] == 1 and counts["loop.done"] == 1 and counts["call.error"] >= 1, counts
    failed = runner.sql("SELECT sum(COALESCE((meta->>'failed')::int, 1)) FROM noetl.event WHERE execution_id = %s"
                        " AND step = 'work' AND event_type = 'call.error'", (out.execution_id,))[0][0]
    assert failed == 2  # the failed iterations, whether they ran alone or in a batch
    done = loop_done_events(runner, out.execution_id)
    assert values.from_struct(done[0].result)["status"] == "error"
    assert "after" not in out.steps and "recover" not in out.steps


def test_an_arc_on_loop_failed_catches_failed_iterations(runner: Runner) -> None:
    arcs = ("        - step: recover\n          when: \"{{ event.name == 'loop.failed' }}\"\n"
            "        - step: after\n          when: \"{{ event.name == 'loop.done' }}\"")
    out = runner.run(playbook("loopcaught", FAILING % arcs))
    assert out.status == "COMPLETED", out.error
    assert out.steps["work"]["status"] == "FAILED"
    assert out.result("recover") == {"recovered": True, "seen": {
        "results": [{"n": 0}, None, {"n": 2}, None, {"n": 4}], "stats": {"total": 5, "success": 3, "failed": 2}}}
    assert "after" not in out.steps


REENTER = playbook("reenter", """workload:
  batches: [[1, 2, 3], [10, 20]]
workflow:
  - step: start
    tool: {kind: noop}
    set:
      ctx.round: 0
    next:
      arcs:
        - step: work
  - step: work
    loop:
      in: "{{ batches[ctx.round] }}"
      iterator: x
      spec: {mode: parallel, max_in_flight: 4}
    tool:
      kind: python
      input: {x: "{{ x }}", round: "{{ ctx.round }}"}
      code: "result = {'x': x, 'round': round}"
    next:
      spec: {mode: exclusive}
      arcs:
        - step: keep
          when: "{{ ctx.round == 0 }}"
        - step: end
  - step: keep
    tool:
      kind: python
      input: {first: "{{ work }}"}
      code: "result = first"
    set:
      ctx.round: 1
    next:
      arcs:
        - step: work
  - step: end
    tool:
      kind: python
      input: {first: "{{ keep }}", second: "{{ work }}"}
      code: "result = {'first': first, 'second': second}"
""")


def test_reentering_a_loop_step_starts_a_fresh_loop_instance(runner: Runner) -> None:
    out = runner.run(REENTER)
    assert out.status == "COMPLETED", out.error
    assert out.steps["work"]["visits"] == 2
    first = {"results": [{"x": 1, "round": 0}, {"x": 2, "round": 0}, {"x": 3, "round": 0}],
             "stats": {"total": 3, "success": 3, "failed": 0}}
    second = {"results": [{"x": 10, "round": 1}, {"x": 20, "round": 1}],
              "stats": {"total": 2, "success": 2, "failed": 0}}
    assert out.result("end") == {"first": first, "second": second}
    assert out.result("work") == second
    done = loop_done_events(runner, out.execution_id, "work")
    assert len(done) == 2
    instances = [meta(e)["loop_instance"] for e in done]
    assert len(set(instances)) == 2
    assert [meta(e)["total"] for e in done] == [3, 2]
    rows = runner.sql("SELECT loop_instance, count(*) FROM noetl.loop_result WHERE execution_id = %s"
                      " GROUP BY loop_instance", (out.execution_id,))
    assert dict(rows) == {instances[0]: 3, instances[1]: 2}
    enters = [meta(e)["loop_instance"] for e in runner.events(out.execution_id)
              if e.event_type == "step.enter" and e.step == "work"]
    assert enters == instances


def test_loop_step_set_and_arcs_see_the_loop_results(runner: Runner) -> None:
    """The loop step's own `set` and arc `when`/`set` are evaluated when the loop is done:
    they must see the step's value {"results": [...], "stats": {...}} like any later
    template does. (A downstream step's `set` does see `work.results`.)"""
    out = runner.run(playbook("loopset", """workload:
  items: [1, 2, 3]
workflow:
  - step: work
    loop: {in: "{{ items }}", iterator: x}
    tool: {kind: python, input: {x: "{{ x }}"}, code: "result = x * 10"}
    set:
      ctx.collected: "{{ work.results }}"
      ctx.n_ok: "{{ work.stats.success }}"
    next:
      spec: {mode: exclusive}
      arcs:
        - step: three
          when: "{{ work.results | length == 3 }}"
        - step: other
  - step: three
    tool: {kind: python, input: {c: "{{ ctx.collected }}", n: "{{ ctx.n_ok }}"}, code: "result = {'c': c, 'n': n}"}
  - step: other
    tool: {kind: python, input: {c: "{{ ctx.collected }}", n: "{{ ctx.n_ok }}"}, code: "result = {'c': c, 'n': n}"}
"""))
    assert out.status == "COMPLETED", out.error
    assert out.result("work")["results"] == [10, 20, 30]
    assert "other" not in out.steps, f"the arc did not see work.results: other ran with {out.result('other')}"
    assert out.result("three") == {"c": [10, 20, 30], "n": 3}


SLOW = playbook("slowloop", """workload:
  n: 200
  seconds: 0.5
  dir: ""
workflow:
  - step: slow
    loop:
      in: "{{ n }}"
      iterator: i
      spec: {mode: parallel, max_in_flight: 8}
    tool:
      kind: python
      input: {i: "{{ i }}", seconds: "{{ seconds }}", dir: "{{ dir }}"}
      code: |
        import os, time
        if dir:
            with open(os.path.join(dir, f"{i}.pid"), "w") as f:
                f.write(str(os.getpid()))
        time.sleep(float(seconds))
        result = {"i": i}
""")


def test_cancel_during_a_parallel_loop_stops_dispatch(runner: Runner) -> None:
    sub = runner.submit(SLOW)
    eid = sub.execution_id
    until_sync(lambda: runner.sql("SELECT count(*) FROM noetl.loop_result WHERE execution_id = %s",
                                  (eid,))[0][0] >= 16, timeout=60, what="16 finished iterations")
    asked = time.monotonic()
    assert cancel(runner, eid)
    out = runner.wait(eid, timeout=30)
    MEASURED["cancel -> CANCELLED (read model) s"] = round(time.monotonic() - asked, 3)
    assert out.status == "CANCELLED", out.error
    assert out.steps["slow"]["status"] == "CANCELLED"
    at_terminal = command_counts(runner, eid)
    assert set(at_terminal) <= {"done", "cancelled"}, at_terminal  # nothing queued or claimed remains
    assert 1 <= at_terminal.get("cancelled", 0) <= 8

    # Iterations that were running when the cancel landed end (finish or are stopped);
    # wait until each is accounted for: its late result recorded as call.duplicate, or
    # the worker logged stopping it.
    running = [r[0] for r in runner.sql("SELECT command_id FROM noetl.command WHERE execution_id = %s"
                                        " AND status = 'cancelled' AND claimed_at IS NOT NULL", (eid,))]
    until_sync(lambda: worker_busy(runner.state) == 0, timeout=30, what="the worker to be idle")

    def settled() -> bool:
        dups = {e.command_id for e in runner.events(eid) if e.event_type == "call.duplicate"}
        log = worker_log(runner.state)
        stopped = {c for c in running if f"command stopped: cancelled execution_id={eid} command_id={c} " in log}
        MEASURED["running at cancel: finished late / stopped"] = (len(dups), len(stopped))
        return set(running) <= dups | stopped

    until_sync(settled, timeout=30, what="running iterations to finish or stop")
    after = command_counts(runner, eid)
    assert after == at_terminal, "commands were issued after the cancel"
    assert sum(after.values()) < 200
    counts = event_counts(runner, eid)
    assert counts.get("call.done", 0) == after.get("done", 0)
    assert counts.get("loop.done", 0) == 0 and counts.get("playbook.cancelled") == 1
    MEASURED["commands issued of 200 before cancel"] = sum(after.values())


def test_cancel_stops_running_iterations(runner: Runner, tmp_path: Path) -> None:
    """Running iterations (60 s each) are stopped and their python children killed. The
    api does not push cancels to workers yet: a worker learns at its next lease renewal
    (every NOETL_COMMAND_LEASE_SEC / 3), so the stop latency is bounded by that."""
    tmp_path.chmod(0o777)
    sub = runner.submit(SLOW.replace("max_in_flight: 8", "max_in_flight: 4"),
                        {"n": 20, "seconds": 60, "dir": str(tmp_path)})
    eid = sub.execution_id
    until_sync(lambda: len(list(tmp_path.glob("*.pid"))) == 4, timeout=30, what="4 running iterations")
    until_sync(lambda: all(p.read_text() for p in tmp_path.glob("*.pid")), timeout=5, what="pids written")
    pids = {p.stem: int(p.read_text()) for p in tmp_path.glob("*.pid")}
    assert all(_alive(pid) for pid in pids.values())
    asked = time.monotonic()
    assert cancel(runner, eid)
    assert runner.wait(eid, timeout=30).status == "CANCELLED"
    until_sync(lambda: not any(_alive(pid) for pid in pids.values()),
               timeout=20, what="the iterations' processes to exit")
    stop_latency = time.monotonic() - asked
    MEASURED["cancel -> running iterations killed s (lease renewal, no push)"] = round(stop_latency, 2)
    assert stop_latency < 10
    until_sync(lambda: worker_busy(runner.state) == 0, timeout=10, what="the worker to be idle")
    counts = event_counts(runner, eid)
    assert "call.done" not in counts and "call.duplicate" not in counts, counts
    log = worker_log(runner.state)
    # each running command (a batch of iterations: `:{first}+{count}`) wrote its first one's pid
    stopped = [i for i in pids if re.search(
        rf"command stopped: cancelled execution_id={eid} command_id={eid}:slow:1:{i}(\+\d+)? ", log)]
    assert len(stopped) == 4, f"worker log does not show the 4 stops: {stopped}"
    assert len(list(tmp_path.glob("*.pid"))) == 4  # nothing else started


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def test_zz_report_measurements() -> None:
    for what, value in MEASURED.items():
        print(f"\n{what}: {value}")
