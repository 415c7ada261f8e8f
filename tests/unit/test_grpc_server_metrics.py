"""The standard gRPC server metrics (noetl_common.grpcmetrics) on a loopback server with the
interceptors every role runs: go-grpc-prometheus names, labels and label values, and the
code each way a call can end is counted with."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY
from waiting import until

from noetl_common import grpcmetrics, grpcutil
from noetl_common.errors import NotFound
from noetl_proto.v1 import execution_pb2, execution_pb2_grpc

SERVICE = "noetl.v1.ExecutionService"


def handled(method: str, code: str, service: str = SERVICE, grpc_type: str = "unary") -> float:
    return REGISTRY.get_sample_value("grpc_server_handled_total", {
        "grpc_type": grpc_type, "grpc_service": service, "grpc_method": method, "grpc_code": code}) or 0.0


def started(method: str, service: str = SERVICE, grpc_type: str = "unary") -> float:
    return REGISTRY.get_sample_value("grpc_server_started_total", {
        "grpc_type": grpc_type, "grpc_service": service, "grpc_method": method}) or 0.0


def timed(method: str, service: str = SERVICE, grpc_type: str = "unary") -> float:
    return REGISTRY.get_sample_value("grpc_server_handling_seconds_count", {
        "grpc_type": grpc_type, "grpc_service": service, "grpc_method": method}) or 0.0


class Executions(execution_pb2_grpc.ExecutionServiceServicer):
    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def GetExecution(self, request: Any, context: Any) -> Any:
        if request.execution_id == 404:
            raise NotFound("no such execution")
        if request.execution_id == 500:
            raise RuntimeError("a bug")
        if request.execution_id == 409:
            context.set_code(grpc.StatusCode.ALREADY_EXISTS)  # set, not raised
            return execution_pb2.GetExecutionResponse()
        if request.execution_id == 1:
            self.entered.set()
            await asyncio.Event().wait()  # until cancelled
        return execution_pb2.GetExecutionResponse()

    async def WatchExecution(self, request: Any, context: Any) -> Any:
        for _ in range(3):
            yield execution_pb2.WatchExecutionResponse()


async def test_every_way_a_call_ends_is_counted_with_its_code() -> None:
    gate: list[str] = []
    server = grpc.aio.server(interceptors=[grpcmetrics.ServerMetricsInterceptor(), grpcutil.ErrorInterceptor(),
                                           grpcutil.GateInterceptor(lambda: gate[0] if gate else None)])
    servicer = Executions()
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    before = {code: handled("GetExecution", code) for code in grpcmetrics.CODE_NAMES.values()}
    before_started, before_timed = started("GetExecution"), timed("GetExecution")
    watched = handled("WatchExecution", "OK", grpc_type="server_stream")
    checks = handled("Check", "OK", service="grpc.health.v1.Health")
    reflected = handled("ServerReflectionInfo", "OK", service=reflection.SERVICE_NAME, grpc_type="bidi_stream")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = execution_pb2_grpc.ExecutionServiceStub(channel)
    try:
        await stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=7), timeout=5)
        for eid, code in ((404, grpc.StatusCode.NOT_FOUND), (500, grpc.StatusCode.INTERNAL),
                          (409, grpc.StatusCode.ALREADY_EXISTS)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=eid), timeout=5)
            assert err.value.code() == code
        gate.append("postgres unavailable: test")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=7), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.clear()
        # a client that goes away mid-call
        call = stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=1), timeout=30)
        await asyncio.wait_for(servicer.entered.wait(), 10)
        call.cancel()
        assert len([r async for r in stub.WatchExecution(execution_pb2.WatchExecutionRequest(execution_id=7),
                                                         timeout=5)]) == 3
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

        async def ask() -> Any:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for _ in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(ask(), timeout=5):
            pass
        # the server ends the cancelled call after the client moved on
        await until(lambda: handled("GetExecution", "Canceled") > before["Canceled"], timeout=10,
                    what="the cancelled call counted")
    finally:
        await channel.close()
        await server.stop(None)
    delta = {code: handled("GetExecution", code) - n for code, n in before.items()}
    assert {c: d for c, d in delta.items() if d} == {"OK": 1, "NotFound": 1, "Internal": 1, "AlreadyExists": 1,
                                                      "Unavailable": 1, "Canceled": 1}
    assert started("GetExecution") - before_started == 6 and timed("GetExecution") - before_timed == 6
    assert handled("WatchExecution", "OK", grpc_type="server_stream") == watched + 1
    assert handled("Check", "OK", service="grpc.health.v1.Health") == checks + 1
    assert handled("ServerReflectionInfo", "OK", service=reflection.SERVICE_NAME, grpc_type="bidi_stream") == \
        reflected + 1


class _Context:
    """The two things ``status_of`` asks of a servicer context."""

    def __init__(self, code: Any, remaining: float | None) -> None:
        self._code, self._remaining = code, remaining

    def code(self) -> Any:
        return self._code

    def time_remaining(self) -> float | None:
        return self._remaining


@pytest.mark.parametrize(("code", "remaining", "exc", "expected"), [
    (0, None, None, grpc.StatusCode.OK),  # grpc.aio's context holds an int 0 until a code is set
    (grpc.StatusCode.NOT_FOUND, None, grpc.aio.AbortError(), grpc.StatusCode.NOT_FOUND),
    (grpc.StatusCode.ALREADY_EXISTS, None, None, grpc.StatusCode.ALREADY_EXISTS),
    (5, None, None, grpc.StatusCode.NOT_FOUND),
    (0, None, RuntimeError("escaped"), grpc.StatusCode.UNKNOWN),
    (0, 12.0, asyncio.CancelledError(), grpc.StatusCode.CANCELLED),
    (0, None, asyncio.CancelledError(), grpc.StatusCode.CANCELLED),
    (0, -0.01, asyncio.CancelledError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (0, 0.0, GeneratorExit(), grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_the_status_a_call_ended_with(code: Any, remaining: float | None, exc: BaseException | None,
                                      expected: grpc.StatusCode) -> None:
    assert grpcmetrics.status_of(_Context(code, remaining), exc) == expected  # type: ignore[arg-type]


def test_code_names_are_grpc_gos() -> None:
    assert set(grpcmetrics.CODE_NAMES) == set(grpc.StatusCode)
    assert grpcmetrics.CODE_NAMES[grpc.StatusCode.CANCELLED] == "Canceled"
    assert set(grpcmetrics.SERVER_ERROR_CODES) < set(grpcmetrics.CODE_NAMES.values())
