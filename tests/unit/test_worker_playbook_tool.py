"""The playbook tool (sub-playbooks) against a stand-in ExecutionService served by an
in-process gRPC server: idempotent submit, following the child, choosing its result,
failures, cancel on stop, timeouts, the polling fallback."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from conformance_data import playbook
from google.protobuf.timestamp_pb2 import Timestamp
from waiting import until

from noetl_api.catalog import parse
from noetl_api.static_checks import playbook_refs
from noetl_api.submissions import Submitter
from noetl_client import values
from noetl_common.errors import NotFound, PlaybookInvalid, ToolError
from noetl_proto.v1 import common_pb2, execution_pb2, execution_pb2_grpc, messages_pb2
from noetl_store import MemoryResultStore, envelope_from_proto
from noetl_worker.runner import execute_command
from noetl_worker.tools import PlaybookTool, Tools
from noetl_worker.tools.playbook import pick_result

RUNNING = common_pb2.EXECUTION_STATUS_RUNNING
COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
FAILED = common_pb2.EXECUTION_STATUS_FAILED
CANCELLED = common_pb2.EXECUTION_STATUS_CANCELLED
TERMINAL = (COMPLETED, FAILED, CANCELLED)


def step(name: str, value: Any = None, *, ended: int = 0,
         status: int = common_pb2.STEP_STATUS_COMPLETED) -> execution_pb2.StepState:
    state = execution_pb2.StepState(name=name, status=status,  # type: ignore[arg-type]
                                    ended_at=Timestamp(seconds=1_700_000_000 + ended))
    if value is not None:
        state.result.CopyFrom(values.to_value(value))
    return state


SCORER_STEPS = [step("start", {"status": "initialized"}, ended=1),
                step("finalize_result", {"user_name": "Alice", "profile_score": 42.5,
                                         "score_category": "Mid-Level"}, ended=2),
                step("end", ended=3)]


class FakeExecutions(execution_pb2_grpc.ExecutionServiceServicer):
    """Children live in memory. ``script(child_id)`` runs after each new submission."""

    def __init__(self) -> None:
        self.submits: list[execution_pb2.SubmitExecutionRequest] = []
        self.by_key: dict[str, int] = {}
        self.executions: dict[int, execution_pb2.Execution] = {}
        self.cancels: list[execution_pb2.CancelExecutionRequest] = []
        self.gets = 0
        self.watchers = 0
        self.watch_unimplemented = False
        self.on_get: Callable[[int], None] = lambda child: None
        self.reject: grpc.StatusCode | None = None
        self.script: Callable[[int], None] = lambda child: None
        self.changed = asyncio.Event()
        self._ids = itertools.count(5001)

    def finish(self, child: int, status: int, steps: list[execution_pb2.StepState] = (),  # type: ignore[assignment]
               error: str = "") -> None:
        ex = self.executions[child]
        ex.status = status  # type: ignore[assignment]
        ex.error = error
        del ex.steps[:]
        ex.steps.extend(steps)
        self.changed.set()

    async def SubmitExecution(self, request: execution_pb2.SubmitExecutionRequest,
                              context: grpc.aio.ServicerContext) -> execution_pb2.SubmitExecutionResponse:
        self.submits.append(request)
        if self.reject is not None:
            await context.abort(self.reject, f"playbook {request.ref.path!r} not found")
        key = request.idempotency_key
        if key and key in self.by_key:
            child = self.by_key[key]
            return execution_pb2.SubmitExecutionResponse(execution_id=child, deduplicated=True)
        child = next(self._ids)
        if key:
            self.by_key[key] = child
        self.executions[child] = execution_pb2.Execution(
            execution_id=child, status=RUNNING, playbook_path=request.ref.path,
            parent_execution_id=request.parent_execution_id)
        self.script(child)
        return execution_pb2.SubmitExecutionResponse(execution_id=child, playbook_path=request.ref.path)

    def _view(self, child: int, include_results: bool) -> execution_pb2.Execution:
        ex = execution_pb2.Execution()
        ex.CopyFrom(self.executions[child])
        if not include_results:
            for s in ex.steps:
                s.ClearField("result")
        return ex

    async def GetExecution(self, request: execution_pb2.GetExecutionRequest,
                           context: grpc.aio.ServicerContext) -> execution_pb2.GetExecutionResponse:
        self.gets += 1
        if request.execution_id not in self.executions:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such execution")
        self.on_get(request.execution_id)
        return execution_pb2.GetExecutionResponse(execution=self._view(request.execution_id, request.include_results))

    async def WatchExecution(self, request: execution_pb2.WatchExecutionRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[execution_pb2.WatchExecutionResponse]:
        if self.watch_unimplemented:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no streams here")
        self.watchers += 1
        while True:
            self.changed.clear()
            view = self._view(request.execution_id, request.include_results)
            yield execution_pb2.WatchExecutionResponse(execution=view)
            if view.status in TERMINAL:
                return
            await self.changed.wait()

    async def CancelExecution(self, request: execution_pb2.CancelExecutionRequest,
                              context: grpc.aio.ServicerContext) -> execution_pb2.CancelExecutionResponse:
        self.cancels.append(request)
        self.finish(request.execution_id, CANCELLED, error=request.reason)
        return execution_pb2.CancelExecutionResponse(accepted=True)


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeExecutions, Tools]]:
    fake = FakeExecutions()
    server = grpc.aio.server()
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    tools = Tools(playbook=PlaybookTool(execution_pb2_grpc.ExecutionServiceStub(channel), poll_sec=0.01,
                                        poll_cap_sec=0.05))
    yield fake, tools
    await tools.close()
    await channel.close()
    await server.stop(0)


def command(tool: Any, *, iter_scope: Any = None, attempt: int = 1, timeout: float = 0.0) -> messages_pb2.Command:
    ctx = {"execution_id": 123, "workload": {}, "ctx": {}, "steps": {}, "known_steps": [], "event": {},
           "iter": iter_scope}
    return messages_pb2.Command(command_id="123:process_users:1:0", execution_id=123, shard_id=3,
                                step="process_users", attempt=attempt, kind="pipeline",
                                spec_json=json.dumps({"step": "process_users", "tool": tool}),
                                context_json=json.dumps(ctx), timeout_seconds=timeout)


SAVE_PROFILE = {"name": "save_profile", "kind": "playbook", "path": "fixtures/child",
                "return_step": "finalize_result",
                "input": {"user_data": "{{ user }}", "execution_context": "{{ execution_id }}"}}
STORE_RESULT = {"name": "store_result", "kind": "noop",
                "input": {"score": "{{ save_profile.profile_score }}", "who": "{{ user.name }}"}}
ALICE = {"user": {"name": "Alice", "age": 28}, "_index": 0}


async def test_pipeline_runs_the_child_and_later_tasks_read_its_value(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    fake.script = lambda child: fake.finish(child, COMPLETED, SCORER_STEPS)
    store = MemoryResultStore()
    result = await execute_command(command([SAVE_PROFILE, STORE_RESULT], iter_scope=ALICE), store, tools)
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "ok", env
    assert await store.get(env["reference"]["ref_id"]) == {"score": 42.5, "who": "Alice"}
    assert (await store.get(env["parent_ref"]["ref_id"]))["score_category"] == "Mid-Level"
    [submit] = fake.submits
    assert submit.ref.path == "fixtures/child" and submit.ref.version == 0
    assert values.from_struct(submit.payload) == {"user_data": {"name": "Alice", "age": 28}, "execution_context": 123}
    assert submit.parent_execution_id == 123 and submit.timeout_seconds == 0
    assert submit.idempotency_key == "123:process_users:1:0#save_profile"


async def test_a_reissued_command_reattaches_to_the_same_child(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    fake.script = lambda child: fake.finish(child, COMPLETED, SCORER_STEPS)
    for attempt in (1, 2):
        env = envelope_from_proto((await execute_command(
            command([SAVE_PROFILE], iter_scope=ALICE, attempt=attempt), MemoryResultStore(), tools)).envelope)
        assert env["status"] == "ok" and env["context"]["profile_score"] == 42.5
    assert [s.idempotency_key for s in fake.submits] == ["123:process_users:1:0#save_profile"] * 2
    assert len(fake.executions) == 1


async def test_policy_retries_start_a_new_child_with_their_own_key(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    outcomes = iter([FAILED, COMPLETED])
    fake.script = lambda child: fake.finish(child, next(outcomes), SCORER_STEPS, error="flaky")
    task = {**SAVE_PROFILE, "spec": {"policy": {"rules": [
        {"when": "{{ output.status == 'error' }}", "then": {"do": "retry", "attempts": 2, "backoff": "none"}}]}}}
    env = envelope_from_proto((await execute_command(command([task], iter_scope=ALICE), MemoryResultStore(),
                                                     tools)).envelope)
    assert env["status"] == "ok"
    assert [s.idempotency_key for s in fake.submits] == [
        "123:process_users:1:0#save_profile", "123:process_users:1:0#save_profile#2"]


async def test_child_failure_names_the_child_and_its_error(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    fake.script = lambda child: fake.finish(child, FAILED, error="step 'score_age': ValueError: bad age")
    env = envelope_from_proto((await execute_command(command([SAVE_PROFILE], iter_scope=ALICE),
                                                     MemoryResultStore(), tools)).envelope)
    assert env["status"] == "error" and env["error"]["code"] == "PLAYBOOK_FAILED"
    message = env["error"]["message"]
    assert "5001" in message and "failed" in message and "bad age" in message and "fixtures/child" in message


async def test_return_step_that_did_not_complete_is_an_error(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    fake.script = lambda child: fake.finish(child, COMPLETED, [step("start", {"a": 1})])
    env = envelope_from_proto((await execute_command(command([SAVE_PROFILE], iter_scope=ALICE),
                                                     MemoryResultStore(), tools)).envelope)
    assert env["status"] == "error" and "return_step 'finalize_result'" in env["error"]["message"]
    assert "did not run" in env["error"]["message"]


async def test_a_cancelled_command_cancels_its_child(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    cancelled = asyncio.Event()
    task = asyncio.ensure_future(execute_command(command([SAVE_PROFILE], iter_scope=ALICE), MemoryResultStore(),
                                                 tools, cancelled=cancelled))
    await until(lambda: fake.watchers > 0, timeout=5, what="the tool watching its child", interval=0.02)
    cancelled.set()  # what the worker does on a "cancelled" stop, before cancelling the task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(c.execution_id, c.reason) for c in fake.cancels] == [
        (5001, "parent command 123:process_users:1:0 was cancelled")]


async def test_a_lost_lease_leaves_the_child_for_the_next_attempt(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    task = asyncio.ensure_future(execute_command(command([SAVE_PROFILE], iter_scope=ALICE), MemoryResultStore(),
                                                 tools, cancelled=asyncio.Event()))
    await until(lambda: fake.watchers > 0, timeout=5, what="the tool watching its child", interval=0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.cancels == [] and fake.executions[5001].status == RUNNING


async def test_timeout_cancels_the_child(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    env = envelope_from_proto((await execute_command(command([SAVE_PROFILE], iter_scope=ALICE, timeout=0.3),
                                                     MemoryResultStore(), tools)).envelope)
    assert env["status"] == "error" and env["error"]["code"] == "TIMEOUT"
    assert "child execution 5001" in env["error"]["message"]
    assert [c.execution_id for c in fake.cancels] == [5001]
    assert fake.submits[0].timeout_seconds == pytest.approx(0.3)  # the child gets the task's timeout


async def test_polls_when_the_watch_stream_is_unavailable(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    fake.watch_unimplemented = True
    fake.on_get = lambda child: fake.finish(child, COMPLETED, SCORER_STEPS) if fake.gets == 3 else None
    env = envelope_from_proto((await execute_command(command([SAVE_PROFILE], iter_scope=ALICE),
                                                     MemoryResultStore(), tools)).envelope)
    assert env["status"] == "ok" and env["context"]["user_name"] == "Alice"
    assert fake.gets >= 4 and fake.watchers == 0


async def test_a_child_not_in_the_catalog_is_a_task_error(api: tuple[FakeExecutions, Tools]) -> None:
    fake, tools = api
    fake.reject = grpc.StatusCode.NOT_FOUND
    env = envelope_from_proto((await execute_command(command([SAVE_PROFILE], iter_scope=ALICE),
                                                     MemoryResultStore(), tools)).envelope)
    assert env["status"] == "error" and env["error"]["code"] == "INVALID_TASK"
    assert "sub-playbook 'fixtures/child' was rejected" in env["error"]["message"]
    assert len(fake.submits) == 1  # not retried


async def test_a_task_without_path_is_invalid(api: tuple[FakeExecutions, Tools]) -> None:
    _, tools = api
    env = envelope_from_proto((await execute_command(command([{"name": "p", "kind": "playbook"}]),
                                                     MemoryResultStore(), tools)).envelope)
    assert env["status"] == "error" and "needs `path`" in env["error"]["message"]


def test_default_result_is_end_else_the_last_step_to_complete() -> None:
    ex = execution_pb2.Execution(execution_id=9, steps=[step("a", {"v": "a"}, ended=5), step("end", {"v": "end"},
                                                                                             ended=1)])
    assert pick_result(ex, None) == {"v": "end"}
    ex = execution_pb2.Execution(execution_id=9, steps=[
        step("a", {"v": "a"}, ended=5), step("b", {"v": "b"}, ended=9), step("c", {"v": "c"}, ended=7),
        step("end", ended=10), step("d", {"v": "d"}, ended=11, status=common_pb2.STEP_STATUS_FAILED)])
    assert pick_result(ex, None) == {"v": "b"}
    assert pick_result(ex, "c") == {"v": "c"}
    assert pick_result(ex, "end") is None
    assert pick_result(execution_pb2.Execution(), None) is None
    with pytest.raises(ToolError, match=r"return_step 'd' .* did not complete \(failed\)"):
        pick_result(ex, "d")


# ---------------------------------------------------------------- submit-time check of literal paths



class FakeCatalog:
    def __init__(self, paths: set[str]) -> None:
        self.paths = paths

    async def get(self, path: str, version: int = 0) -> Any:
        if path not in self.paths:
            raise NotFound(f"playbook {path!r} not found")
        return object()


def test_literal_sub_playbook_paths_are_listed() -> None:
    pb = parse(playbook("playbook_composition/playbook_composition.yaml").read_text())
    assert playbook_refs(pb) == [("workflow[2].tool[0].path",
                                  "fixtures/playbooks/playbook_composition/user_profile_scorer", 0)]
    templated = parse("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t}\nworkload: {p: x}\n"
                      "workflow:\n  - step: a\n    tool: {kind: playbook, path: '{{ p }}'}\n")
    assert playbook_refs(templated) == []


async def test_submit_rejects_a_sub_playbook_missing_from_the_catalog() -> None:
    pb = parse(playbook("playbook_composition/playbook_composition.yaml").read_text())
    submitter = Submitter(None, FakeCatalog(set()), None, None, shard_count=1,  # type: ignore[arg-type]
                          default_timeout_sec=60)
    with pytest.raises(PlaybookInvalid) as info:
        await submitter._check_playbook_refs(pb)
    assert info.value.path == "workflow[2].tool[0].path"
    assert str(info.value) == ("workflow[2].tool[0].path: sub-playbook "
                               "'fixtures/playbooks/playbook_composition/user_profile_scorer' is not in the catalog"
                               " (register it first)")
    ok = Submitter(None, FakeCatalog({"fixtures/playbooks/playbook_composition/user_profile_scorer"}),  # type: ignore[arg-type]
                   None, None, shard_count=1, default_timeout_sec=60)  # type: ignore[arg-type]
    await ok._check_playbook_refs(pb)
