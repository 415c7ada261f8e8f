"""The retry classifier of each dependency (noetl_common.retry): which of its exceptions are
transient (waiting and calling again can succeed) and which are not; their union
``is_transient``; the translations that follow them (natsio, the S3 client, grpcclient);
``retry_keyed``, which repeats a submission only when it carries an idempotency key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import psycopg
import pytest
from nats import errors as nats_errors
from nats.js import errors as js_errors
from psycopg_pool import PoolTimeout

from noetl_common import grpcclient, natsio
from noetl_common.errors import (
    ConfigError,
    Conflict,
    InvalidInput,
    LeaseLost,
    NoetlError,
    NotFound,
    Overloaded,
    PermissionDenied,
    Unavailable,
    Unimplemented,
)
from noetl_common.retry import (
    CLASSIFIERS,
    grpc_transient,
    is_transient,
    nats_transient,
    postgres_transient,
    retry_keyed,
    s3_status_transient,
    s3_transient,
)
from noetl_proto.v1 import execution_pb2, execution_pb2_grpc

E = psycopg.errors
REQUEST = httpx.Request("GET", "http://s3.test/bucket/key")


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details or code.name)


TRANSIENT: dict[str, list[BaseException]] = {
    "grpc": [rpc_error(grpc.StatusCode.UNAVAILABLE), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED),
             Unavailable("translated UNAVAILABLE")],
    "postgres": [psycopg.OperationalError("server closed the connection unexpectedly"),
                 E.AdminShutdown("terminating connection due to administrator command"),
                 E.CannotConnectNow("the database system is starting up"),
                 E.ConnectionFailure("connection failure"),
                 E.SerializationFailure("could not serialize access"), E.DeadlockDetected("deadlock detected"),
                 E.LockNotAvailable("could not obtain lock"), E.QueryCanceled("statement timeout"),
                 E.TooManyConnections("too many clients"), PoolTimeout("couldn't get a connection after 5 sec")],
    "nats": [nats_errors.ConnectionClosedError(), nats_errors.NoServersError(), nats_errors.TimeoutError(),
             nats_errors.NoRespondersError(), nats_errors.StaleConnectionError(),
             nats_errors.ConnectionReconnectingError(), nats_errors.OutboundBufferLimitError(),
             js_errors.ServiceUnavailableError(), js_errors.ServerError(),
             js_errors.NotFoundError(description="stream not found"),  # the api creates it
             js_errors.BadRequestError(code=400, description="filtered consumer not unique"),  # until the api
             js_errors.NoStreamResponseError()],                                               # drops the old one
    "s3": [httpx.ConnectError("connection refused", request=REQUEST),
           httpx.ReadTimeout("timed out", request=REQUEST), httpx.ConnectTimeout("timed out", request=REQUEST),
           httpx.ReadError("connection reset", request=REQUEST),
           httpx.RemoteProtocolError("peer closed connection without sending a complete message", request=REQUEST)],
}

PERMANENT: dict[str, list[BaseException]] = {
    "grpc": [rpc_error(c) for c in grpc.StatusCode if c not in (grpc.StatusCode.UNAVAILABLE,
                                                                 grpc.StatusCode.DEADLINE_EXCEEDED)],
    "postgres": [E.UniqueViolation("duplicate key"), E.ForeignKeyViolation("violates foreign key"),
                 E.InvalidTextRepresentation("invalid input syntax"), E.UndefinedTable("relation does not exist"),
                 E.InsufficientPrivilege("permission denied"), psycopg.ProgrammingError("bad query"),
                 psycopg.InterfaceError("bad use")],
    "nats": [nats_errors.AuthorizationError(), nats_errors.MaxPayloadError(), nats_errors.BadSubjectError(),
             nats_errors.InvalidUserCredentialsError(), nats_errors.SecureConnRequiredError()],
    "s3": [httpx.UnsupportedProtocol("ftp://", request=REQUEST), httpx.LocalProtocolError("bad header"),
           httpx.ProxyError("proxy refused", request=REQUEST), ValueError("not an S3 error")],
}


@pytest.mark.parametrize("dependency", sorted(CLASSIFIERS))
def test_each_dependency_has_one_classifier(dependency: str) -> None:
    classify = CLASSIFIERS[dependency]
    for exc in TRANSIENT[dependency]:
        assert classify(exc), f"{dependency}: {exc!r} should be transient"
        assert is_transient(exc), f"is_transient: {exc!r}"
    for exc in PERMANENT[dependency]:
        assert not classify(exc), f"{dependency}: {exc!r} should be permanent"
        assert not is_transient(exc), f"is_transient: {exc!r}"


def test_the_classifiers_are_the_modules_functions() -> None:
    assert CLASSIFIERS == {"grpc": grpc_transient, "postgres": postgres_transient, "nats": nats_transient,
                           "s3": s3_transient}


def test_s3_statuses() -> None:
    assert [s for s in (200, 400, 401, 403, 404, 409, 429, 500, 502, 503, 504) if s3_status_transient(s)] == [
        429, 500, 502, 503, 504]


def test_translated_errors_are_transient_by_what_they_were_raised_from() -> None:
    assert is_transient(Unavailable("postgres unavailable"))
    wrapped = NoetlError("store error")
    wrapped.__cause__ = psycopg.OperationalError("reset")
    assert is_transient(wrapped)
    lost = NotFound("no such command")
    lost.__cause__ = rpc_error(grpc.StatusCode.NOT_FOUND)
    assert not is_transient(lost)
    refused = ConfigError("nats: authorization violation")
    refused.__cause__ = nats_errors.ConnectionClosedError()
    assert not is_transient(refused)  # wrong settings do not pass by waiting
    for exc in (InvalidInput("bad"), Conflict("race"), LeaseLost("gone"), Overloaded("busy"), NoetlError("bug")):
        assert not is_transient(exc), exc


def test_grpc_status_codes_become_the_projects_errors() -> None:
    expected = {grpc.StatusCode.UNAVAILABLE: Unavailable, grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
                grpc.StatusCode.NOT_FOUND: NotFound, grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
                grpc.StatusCode.FAILED_PRECONDITION: Conflict, grpc.StatusCode.ABORTED: LeaseLost,
                grpc.StatusCode.PERMISSION_DENIED: PermissionDenied, grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
                grpc.StatusCode.UNIMPLEMENTED: Unimplemented, grpc.StatusCode.INTERNAL: NoetlError}
    for code, kind in expected.items():
        err = grpcclient.translate(rpc_error(code, "what the server said"))
        assert type(err) is kind and str(err) == "what the server said", code
        assert grpc_transient(err) == (code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))


def test_nats_errors_become_unavailable_only_when_transient() -> None:
    for exc in TRANSIENT["nats"]:
        assert type(natsio.translate(exc)) is Unavailable, exc
    for exc in PERMANENT["nats"]:
        assert type(natsio.translate(exc)) is NoetlError, exc
    assert type(natsio.translate(ConnectionResetError())) is Unavailable


# ---------------------------------------------------------------- retry_keyed


class Flaky:
    def __init__(self, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "submitted"


async def test_retry_keyed_repeats_only_a_request_with_a_key() -> None:
    keyed = execution_pb2.SubmitExecutionRequest(idempotency_key="k")
    call = Flaky(Unavailable("replica died"), Unavailable("replica died"))
    assert await retry_keyed("submit", keyed, call, attempts=5, initial=0.001, cap=0.002) == "submitted"
    assert call.calls == 3

    call = Flaky(Unavailable("replica died"))
    with pytest.raises(Unavailable):
        await retry_keyed("submit", execution_pb2.SubmitExecutionRequest(), call, attempts=5, initial=0.001)
    assert call.calls == 1

    call = Flaky(InvalidInput("bad playbook"))
    with pytest.raises(InvalidInput):
        await retry_keyed("submit", keyed, call, attempts=5, initial=0.001)
    assert call.calls == 1

    call = Flaky(*[Unavailable("down")] * 10)
    with pytest.raises(Unavailable):
        await retry_keyed("submit", keyed, call, attempts=3, initial=0.001, cap=0.002)
    assert call.calls == 3


# ---------------------------------------------------------------- the translating stub


class Answers(execution_pb2_grpc.ExecutionServiceServicer):
    async def GetExecution(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"execution {request.execution_id} not found")

    async def CancelExecution(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return execution_pb2.CancelExecutionResponse(accepted=True)

    async def ListExecutions(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "an older api")

    async def WatchExecution(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        yield execution_pb2.WatchExecutionResponse(execution=execution_pb2.Execution(execution_id=1))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica stopped")


async def test_a_translating_stub_raises_the_projects_errors() -> None:
    server = grpc.aio.server()
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(Answers(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = grpcclient.translating(execution_pb2_grpc.ExecutionServiceStub(channel))
            assert grpcclient.translating(stub) is stub
            assert (await stub.CancelExecution(execution_pb2.CancelExecutionRequest(execution_id=1))).accepted
            with pytest.raises(NotFound, match="execution 7 not found") as lost:
                await stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=7), timeout=5)
            assert isinstance(lost.value.__cause__, grpc.RpcError)
            seen = []
            stream = stub.WatchExecution(execution_pb2.WatchExecutionRequest(execution_id=1))
            with pytest.raises(Unavailable, match="the replica stopped"):
                async for answer in stream:
                    seen.append(answer.execution.execution_id)
            assert seen == [1]
            with pytest.raises(Unimplemented, match="an older api"):
                await stub.ListExecutions(execution_pb2.ListExecutionsRequest(), timeout=5)
            stream = stub.WatchExecution(execution_pb2.WatchExecutionRequest(execution_id=1))
            async for _ in stream:
                assert stream.cancel()  # as a follower does once it has what it waited for
                break
    finally:
        await server.stop(0)
