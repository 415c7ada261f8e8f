"""execute_command end to end inside one process: a real python pool and the in-memory
result store (the Postgres store runs the same path in tests/integration)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from noetl_client import values
from noetl_common.errors import Unavailable
from noetl_common.redact import Redactor
from noetl_proto.v1 import messages_pb2
from noetl_store import MemoryResultStore, envelope_from_proto
from noetl_worker.runner import DEFER_MAX_BYTES, _small, execute_command
from noetl_worker.scope import template_names
from noetl_worker.tools import CommandSecrets, PythonPool, Tools
from noetl_worker.tools.credentials import Holder


@pytest.fixture(scope="module")
async def tools() -> AsyncIterator[Tools]:
    pool = PythonPool(2)
    await pool.start()
    t = Tools(python=pool)
    yield t
    await t.close()


def command(spec: dict[str, Any], context: dict[str, Any] | None = None, **kw: Any) -> messages_pb2.Command:
    ctx = {"execution_id": 123, "workload": {}, "ctx": {}, "steps": {}, "known_steps": [], "event": {},
           "iter": None, **(context or {})}
    return messages_pb2.Command(command_id="123:step:1", execution_id=123, shard_id=3, step=spec.get("step", "step"),
                                attempt=1, kind="python", spec_json=json.dumps(spec),
                                context_json=json.dumps(ctx), **kw)


def env_of(result: messages_pb2.CallResult) -> dict[str, Any]:
    return envelope_from_proto(result.envelope)


class CountingStore(MemoryResultStore):
    def __init__(self) -> None:
        super().__init__()
        self.requested: list[int] = []

    async def get_many(self, ref_ids: Iterable[int]) -> dict[int, Any]:
        ids = list(ref_ids)
        self.requested.extend(ids)
        return await super().get_many(ids)


class BrokenStore(MemoryResultStore):
    async def put(self, *args: Any, **kwargs: Any) -> Any:
        raise Unavailable("postgres unavailable: connection refused")


async def test_hello_world_step(tools: Tools) -> None:
    store = MemoryResultStore()
    spec = {"step": "test_step", "tool": {"kind": "python", "input": {"message": "{{ message }}"},
                                          "code": 'print(f"HELLO_WORLD: {message}")\n'
                                                  'result = {"status": "ok", "data": {"message": message}}\n'}}
    result = await execute_command(command(spec, {"workload": {"message": "Hello World"}}), store, tools,
                                   worker_id="w1")
    env = env_of(result)
    assert env["status"] == "ok" and env["context"] == {"status": "ok"}
    assert env["parent_ref"] is None and "error" not in env
    assert await store.get(env["reference"]["ref_id"]) == {"status": "ok", "data": {"message": "Hello World"}}
    assert (result.command_id, result.execution_id, result.step, result.attempt, result.worker_id) == (
        "123:step:1", 123, "test_step", 1, "w1")
    assert json.loads(result.set_json) == {"ctx": {}, "iter": {}}
    assert result.finished_at.seconds > 0


async def test_pipeline_chains_references_and_reports_set(tools: Tools) -> None:
    store = MemoryResultStore()
    spec = {"step": "set_var", "tool": [
        {"name": "first", "kind": "python", "code": "result = {'n': 1}"},
        {"name": "set_vars", "kind": "python", "input": {"prev": "{{ first.n }}"},
         "code": "result = {'test_counter': 41 + prev, 'message': 'Variable set successfully'}",
         "spec": {"policy": {"rules": [{"else": {"then": {"do": "continue", "set": {
             "ctx.test_counter": "{{ output.data.test_counter }}"}}}}]}}}]}
    result = await execute_command(command(spec), store, tools)
    env = env_of(result)
    assert env["status"] == "ok" and env["context"]["test_counter"] == 42
    last, parent = env["reference"]["ref_id"], env["parent_ref"]["ref_id"]
    assert store.parent_of(last) == parent and await store.get(parent) == {"n": 1}
    assert json.loads(result.set_json) == {"ctx": {"test_counter": 42}, "iter": {}}


async def test_only_referenced_step_results_are_resolved(tools: Tools) -> None:
    store = CountingStore()
    a = await store.put({"tag": "AAA_KEEP"}, execution_id=123, step="producer_a", command_id="x", task="t",
                        parent_ref_id=None)
    b = await store.put({"tag": "BBB_DROP"}, execution_id=123, step="producer_b", command_id="y", task="t",
                        parent_ref_id=None)
    steps = {"producer_a": {"status": "ok", "reference": a.to_json(), "context": {"tag": "AAA_KEEP"}},
             "producer_b": {"status": "ok", "reference": b.to_json(), "context": {"tag": "BBB_DROP"}}}
    spec = {"step": "consumer", "tool": {"kind": "python", "input": {
        "only_a": "{{ producer_a.tag }}", "missing": "{{ cold_path.x if cold_path else 'none' }}"},
        "code": "result = {'consumed': only_a, 'missing': missing, 'ctx_keys': sorted(context)}"}}
    context = {"steps": steps, "known_steps": ["producer_a", "producer_b", "consumer", "cold_path"]}
    result = await execute_command(command(spec, context), store, tools)
    value = await store.get(env_of(result)["reference"]["ref_id"])
    assert value["consumed"] == "AAA_KEEP" and value["missing"] == "none"
    assert store.requested == [a.ref_id]
    assert "producer_b" not in value["ctx_keys"]


def test_template_names_read_code_but_not_base64_code() -> None:
    spec = {"tool": {"kind": "python", "code": "# from {{ s0 }}\nresult = a", "code_b64": "{{ not_read }}",
                     "input": {"a": "{{ s1.v }}"}},
            "input": {"b": "{{ s2 }}"}, "workbook": {"w": {"kind": "noop", "input": {"c": "{{ s3 }}"}}}}
    assert template_names(spec) == {"s0", "s1", "s2", "s3"}


async def test_missing_reference_is_reference_not_available(tools: Tools) -> None:
    spec = {"step": "s", "tool": {"kind": "python", "input": {"v": "{{ gone }}"}, "code": "result = v"}}
    context = {"steps": {"gone": {"status": "ok", "reference": {"ref_id": 999, "type": "memory", "uri": ""}}}}
    env = env_of(await execute_command(command(spec, context), MemoryResultStore(), tools))
    assert env["status"] == "error" and env["error"]["code"] == "REFERENCE_NOT_AVAILABLE"
    assert "999" in env["error"]["message"]


async def test_store_failure_is_never_silent(tools: Tools, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that stays down past the retries (INFRA_RETRY_SEC) is REFERENCE_NOT_AVAILABLE."""
    import noetl_worker.runner as runner

    monkeypatch.setattr(runner, "INFRA_RETRY_SEC", 0.3)
    spec = {"step": "s", "tool": {"kind": "python", "code": "result = 1"}}
    env = env_of(await execute_command(command(spec), BrokenStore(), tools))
    assert env["status"] == "error" and env["reference"] is None
    assert env["error"]["code"] == "REFERENCE_NOT_AVAILABLE"
    assert "connection refused" in env["error"]["message"]


async def test_template_error_names_the_template(tools: Tools) -> None:
    spec = {"step": "s", "tool": {"kind": "python", "input": {"v": "{{ nope.x }}"}, "code": "result = v"}}
    env = env_of(await execute_command(command(spec), MemoryResultStore(), tools))
    assert env["error"]["code"] == "TEMPLATE_ERROR"
    assert "{{ nope.x }}" in env["error"]["message"]


async def test_python_error_carries_traceback_in_details(tools: Tools) -> None:
    spec = {"step": "s", "tool": {"kind": "python", "code": "raise Exception('Random failure (value: 3)')"}}
    result = await execute_command(command(spec), MemoryResultStore(), tools)
    env = env_of(result)
    traceback = env["error"].pop("traceback")
    assert env["error"] == {"code": "TOOL_ERROR", "message": "Random failure (value: 3)", "kind": "unknown",
                            "type": "unknown", "exception_type": "Exception", "retryable": False}
    assert "Traceback" in traceback and "Exception: Random failure (value: 3)" in traceback
    assert "Traceback" in values.from_struct(result.envelope.error.details)["traceback"]


async def test_python_errors_are_classified_the_way_upstream_policies_test_them(tools: Tools) -> None:
    for code, kind in (("int('x')", "schema"), ("import json; json.loads('{')", "parse"),
                       ("raise TimeoutError('slow')", "timeout"), ("raise ConnectionRefusedError('no')", "connection")):
        spec = {"step": "s", "tool": {"kind": "python", "code": code}}
        env = env_of(await execute_command(command(spec), MemoryResultStore(), tools))
        assert (env["error"]["kind"], env["error"]["type"]) == (kind, kind), code


async def test_workbook_task_defaults_overridden_by_caller_input(tools: Tools) -> None:
    """control_flow_workbook: `kind: workbook, name: compute_flag`."""
    workbook = {"compute_flag": {"name": "compute_flag", "tool": {
        "kind": "python", "input": {"temperature_c": None, "unit": "C"},
        "code": "is_hot = float(temperature_c) >= 25.0\n"
                "result = {'is_hot': is_hot, 'message': 'hot' if is_hot else 'cold', 'unit': unit}"}}}
    spec = {"step": "eval_flag", "tool": {"kind": "workbook", "name": "compute_flag",
                                          "input": {"temperature_c": "{{ temperature_c }}"}}, "workbook": workbook}
    env = env_of(await execute_command(command(spec, {"workload": {"temperature_c": 30}}), MemoryResultStore(), tools))
    assert env["context"] == {"is_hot": True, "message": "hot", "unit": "C"}


async def test_unknown_workbook_task(tools: Tools) -> None:
    spec = {"step": "s", "tool": {"kind": "workbook", "name": "nope"}, "workbook": {}}
    env = env_of(await execute_command(command(spec), MemoryResultStore(), tools))
    assert env["error"]["code"] == "INVALID_TASK" and "nope" in env["error"]["message"]


async def test_loop_iteration_scope_and_step_input(tools: Tools) -> None:
    spec = {"step": "start", "tool": {"kind": "python", "input": {},
                                      "code": "return {'doubled': input_data['num'] * 2, 'i': iter_num}"},
            "input": {"num": "{{ num }}", "iter_num": "{{ iter.num }}"}, "loop": {"iterator": "num"}}
    env = env_of(await execute_command(command(spec, {"iter": {"num": 4}}), MemoryResultStore(), tools))
    assert env["context"] == {"doubled": 8, "i": 4}


async def test_noop_and_unsupported_kind(tools: Tools) -> None:
    store = MemoryResultStore()
    env = env_of(await execute_command(command({"tool": {"kind": "noop", "input": {"x": "{{ ctx.a }}"}}},
                                               {"ctx": {"a": 5}}), store, tools))
    assert await store.get(env["reference"]["ref_id"]) == {"x": 5}
    env = env_of(await execute_command(command({"tool": {"kind": "duckdb"}}), store, tools))
    assert env["error"]["code"] == "INVALID_TASK" and "duckdb" in env["error"]["message"]


async def test_command_timeout_applies_per_task(tools: Tools) -> None:
    spec = {"step": "s", "tool": {"kind": "python", "code": "import time\ntime.sleep(10)"}}
    env = env_of(await execute_command(command(spec, timeout_seconds=0.3), MemoryResultStore(), tools))
    assert env["error"]["code"] == "TIMEOUT"
    assert env["error"]["message"] == "task exceeded its timeout of 0.3 s"


async def test_invalid_command_json(tools: Tools) -> None:
    bad = messages_pb2.Command(command_id="c", execution_id=1, step="s", spec_json="{nope", context_json="{}")
    env = env_of(await execute_command(bad, MemoryResultStore(), tools))
    assert env["error"]["code"] == "INVALID_COMMAND"
    env = env_of(await execute_command(command({"tool": []}), MemoryResultStore(), tools))
    assert env["error"]["code"] == "INVALID_COMMAND"


async def test_context_global_is_sent_only_when_code_names_it(tools: Tools) -> None:
    store = MemoryResultStore()
    uses = {"tool": {"kind": "python", "code": "result = sorted(context['workload'])"}}
    env = env_of(await execute_command(command(uses, {"workload": {"big": "x" * 1000}}), store, tools))
    assert await store.get(env["reference"]["ref_id"]) == ["big"]
    sneaky = "import builtins\nscope = getattr(builtins, 'glo' + 'bals')()\nresult = len(scope['con' + 'text'])"
    env = env_of(await execute_command(command({"tool": {"kind": "python", "code": sneaky}},
                                               {"workload": {"big": "x"}}), store, tools))
    assert env["context"] == {"value": 0}  # not named in the code: not shipped


def batch(code: str, items: list[Any], first: int = 10, *, mode: str = "parallel",
          tool: dict[str, Any] | None = None, context: dict[str, Any] | None = None) -> messages_pb2.Command:
    """A command that runs a batch of loop iterations, as the api hands it out."""
    spec = {"step": "each", "tool": tool or {"kind": "python", "code": code, "input": {
        "n": "{{ n }}", "i": "{{ loop_index }}", "idx": "{{ iter._index }}"}}}
    return command(spec, {"loop": {"instance": "each:1", "index": first, "count": len(items), "iterator": "n",
                                   "mode": mode},
                          "iter": {"n": items[0], "_index": first}, "loop_index": first, "batch_items": items,
                          **(context or {})})


class GatheringStore(MemoryResultStore):
    """Counts the puts in flight at once, and refuses the values listed in ``refuse``."""

    def __init__(self, refuse: frozenset[int] = frozenset(), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refuse = refuse
        self.in_flight = 0
        self.most = 0

    async def put(self, value: Any, **kwargs: Any) -> Any:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            if value in self.refuse:
                raise ValueError(f"cannot store {value}")
            return await super().put(value, **kwargs)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
async def test_a_parallel_batch_stores_its_results_together_before_it_reports(tools: Tools, mode: str) -> None:
    """A parallel batch's iterations do not wait for their own result's round trip: the
    results go to the store together (one statement in the Postgres store) when the batch
    ends; a sequential batch stores each before the next iteration starts."""
    store = GatheringStore()
    result = await execute_command(batch("result = n * 10", [1, 2, 3, 4], first=0, mode=mode), store, tools)
    values_ = [await store.get(envelope_from_proto(it.envelope)["reference"]["ref_id"]) for it in result.iterations]
    assert values_ == [10, 20, 30, 40]
    assert store.most == (4 if mode == "parallel" else 1)


async def test_a_batch_holds_back_small_results_only(tools: Tools) -> None:
    """A result larger than DEFER_MAX_BYTES is stored when its iteration ends, so a batch
    never holds many large results in memory at once."""
    store = GatheringStore()
    order: list[Any] = []
    put = store.put

    async def recording(value: Any, **kwargs: Any) -> Any:
        order.append(value if isinstance(value, int) else len(value))
        return await put(value, **kwargs)
    store.put = recording  # type: ignore[method-assign]
    code = f"result = 'x' * {DEFER_MAX_BYTES + 1} if n == 2 else n"
    result = await execute_command(batch(code, [1, 2, 3], first=0), store, tools)
    assert [envelope_from_proto(it.envelope)["status"] for it in result.iterations] == ["ok", "ok", "ok"]
    assert order == [DEFER_MAX_BYTES + 1, 1, 3]


async def test_a_held_back_result_is_stored_before_the_next_task_of_its_pipeline_runs(tools: Tools,
                                                                                       tmp_path: Any) -> None:
    """A result the store refuses stops its iteration's pipeline before the next task runs,
    held back or not (as when every result was stored at once)."""
    marks = tmp_path / "ran"
    tool = [{"name": "first", "kind": "python", "input": {"n": "{{ n }}"}, "code": "result = n * 10"},
            {"name": "second", "kind": "python", "input": {"n": "{{ n }}", "path": str(marks)},
             "code": "open(path, 'a').write(f'{n},')\nresult = n"}]
    store = GatheringStore(refuse=frozenset({20}))
    result = await execute_command(batch("", [1, 2, 3], first=0, tool=tool), store, tools)
    envs = [envelope_from_proto(it.envelope) for it in result.iterations]
    assert [e["status"] for e in envs] == ["ok", "error", "ok"]
    assert envs[1]["error"]["code"] == "REFERENCE_NOT_AVAILABLE"
    assert sorted(marks.read_text().strip(",").split(",")) == ["1", "3"]  # item 2's second task never ran


@pytest.mark.parametrize(("value", "small"), [
    (1, True), ("x" * 100, True), ({"a": [1, 2, {"b": "c"}]}, True), (None, True),
    ("x" * 20_000, False), (list(range(20_000)), False), ({str(i): i for i in range(5_000)}, False),
    ([["x" * 1000] * 10] * 10, False), ([[[[[[1]]]]]] * 100, True),
])
def test_small_estimates_the_encoded_size_within_its_budget(value: Any, small: bool) -> None:
    assert _small(value, DEFER_MAX_BYTES) is small
    if small:
        assert len(json.dumps(value)) <= DEFER_MAX_BYTES


async def test_a_result_of_a_batch_that_cannot_be_stored_fails_its_iteration_alone(tools: Tools) -> None:
    store = GatheringStore(refuse=frozenset({20}), max_bytes=64)
    code = "result = 'x' * 100 if n == 3 else n * 10"
    result = await execute_command(batch(code, [1, 2, 3, 4], first=0), store, tools)
    envs = [envelope_from_proto(it.envelope) for it in result.iterations]
    assert [e["status"] for e in envs] == ["ok", "error", "error", "ok"]
    assert envs[1]["error"]["code"] == "REFERENCE_NOT_AVAILABLE" and "cannot store 20" in envs[1]["error"]["message"]
    assert envs[2]["error"]["code"] == "RESULT_TOO_LARGE"
    assert [json.loads(it.set_json) for it in result.iterations][1] == {"ctx": {}, "iter": {}}
    assert {**env_of(result)["context"], "ms": 0} == {"count": 4, "failed": 2, "ms": 0}


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
async def test_a_sequential_batch_hands_each_iteration_ctx_as_the_previous_one_left_it(tools: Tools,
                                                                                       mode: str) -> None:
    """As the engine would between commands: ctx with the previous iteration's `set`
    applied, and the loop.next event after the first. A parallel batch's iterations all
    see the ctx and event the command was dispatched with."""
    tool = {"kind": "python", "input": {"n": "{{ n }}", "acc": "{{ ctx.acc }}", "ev": "{{ event.name }}"},
            "code": "result = {'acc': acc + [n], 'ev': ev}",
            "spec": {"policy": {"rules": [{"else": {"then": {"do": "continue",
                                                             "set": {"ctx.acc": "{{ output.data.acc }}"}}}}]}}}
    store = MemoryResultStore()
    ctx = {"acc": [0], "other": "kept"}
    result = await execute_command(batch("", [1, 2, 3], first=0, mode=mode, tool=tool,
                                         context={"ctx": ctx, "event": {"name": "step.enter", "step": "each"}}),
                                   store, tools)
    values_ = [await store.get(envelope_from_proto(it.envelope)["reference"]["ref_id"]) for it in result.iterations]
    sets = [json.loads(it.set_json)["ctx"] for it in result.iterations]
    if mode == "sequential":
        assert values_ == [{"acc": [0, 1], "ev": "step.enter"}, {"acc": [0, 1, 2], "ev": "loop.next"},
                           {"acc": [0, 1, 2, 3], "ev": "loop.next"}]
    else:
        assert values_ == [{"acc": [0, n], "ev": "step.enter"} for n in (1, 2, 3)]
    assert sets == [{"acc": v["acc"]} for v in values_]  # what the engine applies, in index order
    assert ctx == {"acc": [0], "other": "kept"}  # the command's own snapshot is left as it was


async def test_a_batch_runs_each_item_with_its_own_scope_and_stored_result(tools: Tools) -> None:
    store = MemoryResultStore()
    result = await execute_command(batch("result = {'n': n, 'i': i, 'idx': idx}", [3, 4, 5]),
                                   store, tools)
    assert env_of(result)["status"] == "ok" and {**env_of(result)["context"], "ms": 0} == {"count": 3, "failed": 0, "ms": 0}
    assert [it.index for it in result.iterations] == [10, 11, 12]
    values_ = [await store.get(envelope_from_proto(it.envelope)["reference"]["ref_id"]) for it in result.iterations]
    assert values_ == [{"n": 3, "i": 10, "idx": 10}, {"n": 4, "i": 11, "idx": 11}, {"n": 5, "i": 12, "idx": 12}]


async def test_a_failed_iteration_fails_alone_and_its_secrets_are_masked(tools: Tools) -> None:
    secret = "s3cr3t-value-xyz"
    secrets = CommandSecrets(None, Holder("123:each:1:0+3", 1, 123, "each"), Redactor([secret]))
    code = f"if n == 2:\n    raise ValueError('bad {secret}')\nresult = n"
    result = await execute_command(batch(code, [1, 2, 3], first=0), MemoryResultStore(), tools, secrets=secrets)
    envs = [envelope_from_proto(it.envelope) for it in result.iterations]
    assert [e["status"] for e in envs] == ["ok", "error", "ok"]
    assert env_of(result)["error"]["code"] == "ITERATIONS_FAILED"
    assert "bad" in envs[1]["error"]["message"] and secret not in str(result)


async def test_a_batch_stops_starting_iterations_when_its_budget_is_spent(tools: Tools) -> None:
    code = "import time\ntime.sleep(0.1)\nresult = n"
    result = await execute_command(batch(code, [0, 1, 2, 3, 4, 5], first=0), MemoryResultStore(), tools,
                                   batch_budget_sec=0.15)
    ran = [it.index for it in result.iterations]
    assert 1 <= len(ran) < 6 and ran == list(range(len(ran)))  # a prefix, at least one: the rest go back
    took = env_of(result)["context"]
    assert {**took, "ms": 0} == {"count": len(ran), "failed": 0, "ms": 0}
    assert took["ms"] >= 100 * len(ran)  # its wall time (loops.observe_pace): each iteration slept 0.1 s


# what each iteration reports: its child, its place in that child's sequence, its item, when it ran
TRACE = ("import os, sys, time\nsys.seq = getattr(sys, 'seq', 0) + 1\nt0 = time.monotonic()\ntime.sleep(0.002)\n"
         "return [os.getpid(), sys.seq, n, t0, time.monotonic()]")


async def traced_iterations(result: messages_pb2.CallResult, store: MemoryResultStore) -> list[list[Any]]:
    envs = [envelope_from_proto(it.envelope) for it in result.iterations]
    assert all(e["status"] == "ok" for e in envs), envs
    return [await store.get(e["reference"]["ref_id"]) for e in envs]


async def test_a_parallel_batch_of_python_iterations_runs_in_one_child_one_at_a_time_in_index_order(
        tools: Tools) -> None:
    """Their worker-side work overlaps (noetl_worker.runner._overlapped); their tasks do not."""
    store = MemoryResultStore()
    result = await execute_command(batch(TRACE, list(range(12)), first=0), store, tools)
    runs = await traced_iterations(result, store)
    assert [it.index for it in result.iterations] == list(range(12))
    assert len({pid for pid, *_ in runs}) == 1
    seqs = [seq for _, seq, *_ in runs]
    assert seqs == list(range(seqs[0], seqs[0] + 12)) and [r[2] for r in runs] == list(range(12))
    assert all(later[3] >= earlier[4] for earlier, later in itertools.pairwise(runs))


async def test_a_batch_with_a_task_other_than_python_runs_its_iterations_one_after_another(tools: Tools) -> None:
    """Only python (and noop) tasks queue in one child: other tools would run side by side."""
    store = MemoryResultStore()
    tool = [{"name": "a", "kind": "noop", "input": {"n": "{{ n }}"}},
            {"name": "b", "kind": "postgres", "query": "SELECT 1"},
            {"name": "c", "kind": "python", "code": TRACE, "input": {"n": "{{ n }}"}}]
    spec_calls: list[bool] = []
    original = tools.run_task

    async def spy(task: Any, scope: Any, **kw: Any) -> Any:
        spec_calls.append(kw["call"].python_lane is not None)
        return await original(task, scope, **kw)

    tools.run_task = spy  # type: ignore[method-assign]
    try:
        await execute_command(batch("", [0, 1, 2], first=0, tool=tool), store, tools)  # type: ignore[arg-type]
    finally:
        del tools.run_task
    assert spec_calls and not any(spec_calls)


async def test_a_python_batchs_clock_starts_when_it_has_a_child(tools: Tools) -> None:
    """Its budget and its reported pace leave out the wait for a child of the pool: with
    every child busy, a batch still runs its iterations and reports their own time."""
    pool = tools.python
    assert pool is not None
    held = [await pool._take() for _ in range(pool.alive)]  # every child busy for 0.4 s

    def give_back() -> None:
        while held:
            pool._give_back(held.pop())

    release = asyncio.get_running_loop().call_later(0.4, give_back)
    try:
        result = await execute_command(batch("result = n", list(range(6)), first=0), MemoryResultStore(), tools,
                                       batch_budget_sec=0.25)
    finally:
        release.cancel()
        give_back()
    assert [it.index for it in result.iterations] == list(range(6))  # the wait spent none of the budget
    assert env_of(result)["context"]["ms"] < 300  # the wait is not the iterations' pace
