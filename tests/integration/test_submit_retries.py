"""SubmitExecution is repeated only when it carries an idempotency key, by the project's
own callers over their real channels, against a real gRPC server.

The server here is an ExecutionService whose first SubmitExecution commits the execution
and then answers UNAVAILABLE (a replica that died after committing, before answering: the
case that makes a blind retry start a second execution). It counts calls and dedupes
keys as the api does (a repeated key answers the first execution, deduplicated)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from noetl_cli import client
from noetl_cli.apichannel import Api, CannotServe
from noetl_client import values
from noetl_common import grpcclient, grpcutil
from noetl_common.errors import Unavailable
from noetl_common.retry import retry_keyed
from noetl_proto.v1 import common_pb2, execution_pb2, execution_pb2_grpc
from noetl_worker.tools import PlaybookTool

pytestmark = pytest.mark.integration

COMPLETED = common_pb2.EXECUTION_STATUS_COMPLETED
PLAYBOOK = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t, path: t}\nworkflow: []\n"


class LosesTheFirstAnswer(execution_pb2_grpc.ExecutionServiceServicer):
    def __init__(self) -> None:
        self.submits: list[execution_pb2.SubmitExecutionRequest] = []
        self.executions: dict[int, execution_pb2.SubmitExecutionRequest] = {}
        self.by_key: dict[str, int] = {}
        self.gets = 0
        self.get_failures = 0  # GetExecution calls to answer UNAVAILABLE first

    async def SubmitExecution(self, request: execution_pb2.SubmitExecutionRequest,
                              context: grpc.aio.ServicerContext) -> execution_pb2.SubmitExecutionResponse:
        self.submits.append(request)
        key = request.idempotency_key
        if key and key in self.by_key:
            return execution_pb2.SubmitExecutionResponse(execution_id=self.by_key[key], deduplicated=True)
        execution_id = 7000 + len(self.executions)
        self.executions[execution_id] = request
        if key:
            self.by_key[key] = execution_id
        if len(self.submits) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away before answering")
        return execution_pb2.SubmitExecutionResponse(execution_id=execution_id, playbook_path="t")

    def _execution(self, execution_id: int) -> execution_pb2.Execution:
        return execution_pb2.Execution(execution_id=execution_id, status=COMPLETED, steps=[execution_pb2.StepState(
            name="end", status=common_pb2.STEP_STATUS_COMPLETED, result=values.to_value({"child": execution_id}))])

    async def GetExecution(self, request: execution_pb2.GetExecutionRequest,
                           context: grpc.aio.ServicerContext) -> execution_pb2.GetExecutionResponse:
        self.gets += 1
        if self.gets <= self.get_failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away")
        return execution_pb2.GetExecutionResponse(execution=self._execution(request.execution_id))

    async def WatchExecution(self, request: execution_pb2.WatchExecutionRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[execution_pb2.WatchExecutionResponse]:
        yield execution_pb2.WatchExecutionResponse(execution=self._execution(request.execution_id))


@pytest.fixture
async def api() -> AsyncIterator[tuple[str, LosesTheFirstAnswer]]:
    servicer = LosesTheFirstAnswer()
    server = grpc.aio.server()
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(0)


def request(key: str = "") -> execution_pb2.SubmitExecutionRequest:
    return execution_pb2.SubmitExecutionRequest(playbook_yaml=PLAYBOOK, idempotency_key=key)


# ---------------------------------------------------------------- the roles' channel (grpcutil.channel)


async def test_the_channel_never_repeats_a_submission(api: tuple[str, LosesTheFirstAnswer]) -> None:
    target, servicer = api
    async with grpcutil.channel(target) as channel:
        stub = execution_pb2_grpc.ExecutionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.SubmitExecution(request(), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(servicer.submits) == 1 and len(servicer.executions) == 1


async def test_the_channel_repeats_an_idempotent_read(api: tuple[str, LosesTheFirstAnswer]) -> None:
    target, servicer = api
    servicer.get_failures = 1
    async with grpcutil.channel(target) as channel:
        stub = execution_pb2_grpc.ExecutionServiceStub(channel)
        answer = await stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=7000), timeout=10)
    assert answer.execution.execution_id == 7000 and servicer.gets == 2


async def test_a_submission_without_a_key_is_not_retried(api: tuple[str, LosesTheFirstAnswer]) -> None:
    target, servicer = api
    async with grpcutil.channel(target) as channel:
        stub = grpcclient.translating(execution_pb2_grpc.ExecutionServiceStub(channel))
        unkeyed = request()
        with pytest.raises(Unavailable, match="went away"):
            await retry_keyed("submit", unkeyed, lambda: stub.SubmitExecution(unkeyed, timeout=10), attempts=4)
    assert len(servicer.submits) == 1 and len(servicer.executions) == 1


async def test_a_submission_with_a_key_is_retried_into_one_execution(api: tuple[str, LosesTheFirstAnswer]) -> None:
    target, servicer = api
    async with grpcutil.channel(target) as channel:
        stub = grpcclient.translating(execution_pb2_grpc.ExecutionServiceStub(channel))
        keyed = request("k-1")
        answer = await retry_keyed("submit", keyed, lambda: stub.SubmitExecution(keyed, timeout=10), attempts=4)
    assert [s.idempotency_key for s in servicer.submits] == ["k-1", "k-1"]
    assert list(servicer.executions) == [answer.execution_id] and answer.deduplicated


async def test_the_workers_sub_playbook_submission_is_keyed_and_retried(api: tuple[str, LosesTheFirstAnswer]) -> None:
    target, servicer = api
    async with grpcutil.channel(target) as channel:
        tool = PlaybookTool(execution_pb2_grpc.ExecutionServiceStub(channel), poll_sec=0.01, poll_cap_sec=0.05)
        outcome = await tool.run({"path": "fixtures/child"}, {"x": 1}, call=None)
    assert outcome.ok, outcome
    [execution_id] = servicer.executions
    assert outcome.data == {"child": execution_id}
    keys = [s.idempotency_key for s in servicer.submits]
    assert len(keys) == 2 and keys[0] == keys[1] != ""  # a fresh key, the same on its retry


# ---------------------------------------------------------------- the CLI's blocking channel


async def test_the_cli_does_not_retry_a_submission_without_a_key(api: tuple[str, LosesTheFirstAnswer]) -> None:
    target, servicer = api

    def submit() -> Any:
        with Api(target, "--api") as cli:
            return cli.call_keyed(cli.executions.SubmitExecution, request())

    with pytest.raises(CannotServe, match="went away"):
        await asyncio.to_thread(submit)
    assert len(servicer.submits) == 1


async def test_the_cli_always_sends_a_key_and_retries_into_one_execution(
        api: tuple[str, LosesTheFirstAnswer], capsys: pytest.CaptureFixture[str]) -> None:
    target, servicer = api

    def run() -> int:
        with Api(target, "--api") as cli:
            return client.run(cli, PLAYBOOK, detach=True)

    assert await asyncio.to_thread(run) == 0
    [execution_id] = servicer.executions
    out = capsys.readouterr()
    assert out.out.strip() == str(execution_id)
    assert "deduplicated" not in out.err  # the repeat of its own submission is not the user's business
    keys = [s.idempotency_key for s in servicer.submits]
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0].startswith("cli-")
