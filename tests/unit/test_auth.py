"""Identity on every RPC (noetl_common.auth): every method of every service has its
roles; a real in-process gRPC server answers UNAUTHENTICATED / PERMISSION_DENIED before
the handler runs; claim tokens bind a command attempt to its worker."""

from __future__ import annotations

import importlib
import pkgutil

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import noetl_proto.v1
from noetl_common import auth
from noetl_proto.v1 import execution_pb2, execution_pb2_grpc

# every service of every proto file: a new service is checked without being listed here
SERVICES = [(module, name)
            for info in pkgutil.iter_modules(noetl_proto.v1.__path__) if info.name.endswith("_pb2")
            for module in [importlib.import_module(f"noetl_proto.v1.{info.name}")]
            for name in module.DESCRIPTOR.services_by_name]


def all_methods() -> list[str]:
    out = []
    for module, name in SERVICES:
        svc = module.DESCRIPTOR.services_by_name[name]
        out += [f"/{svc.full_name}/{m.name}" for m in svc.methods]
    return out


def test_every_rpc_of_every_service_has_its_roles() -> None:
    assert {name for _, name in SERVICES} >= {"ExecutionService", "WorkerService", "ConcurrencyService"}
    missing = [m for m in all_methods() if m not in auth.METHOD_ROLES]
    assert not missing, f"methods nobody may call (add them to auth.METHOD_ROLES): {missing}"
    stale = set(auth.METHOD_ROLES) - set(all_methods())
    assert not stale, f"METHOD_ROLES names methods that do not exist: {stale}"
    # the sharpest edges, spelled out
    ex, cred, worker = "/noetl.v1.ExecutionService/", "/noetl.v1.CredentialService/", "/noetl.v1.WorkerService/"
    assert auth.Role.READ not in auth.METHOD_ROLES[ex + "SubmitExecution"]
    assert auth.METHOD_ROLES[cred + "PutCredential"] == {auth.Role.ADMIN}
    assert auth.METHOD_ROLES[cred + "ListCredentials"] == {auth.Role.ADMIN}
    assert all(auth.METHOD_ROLES[worker + m] == {auth.Role.WORKER} for m in ("ClaimCommand", "ClaimCommands",
                                                                             "RenewLease", "GetCredential"))
    assert auth.Role.WORKER not in auth.METHOD_ROLES["/noetl.v1.AuthService/CreateToken"]
    sched = "/noetl.v1.ScheduleService/"
    assert all(auth.METHOD_ROLES[sched + m] == {auth.Role.ADMIN} for m in ("AddSchedule", "PauseSchedule",
                                                                           "ResumeSchedule", "DeleteSchedule"))


def test_tokens_and_claim_tokens() -> None:
    token = auth.new_token()
    assert token.startswith("noetl_") and len(token) >= 40 and token != auth.new_token()
    assert auth.token_sha256(token) != token and len(auth.token_sha256(token)) == 64
    key = b"k" * 32
    t = auth.claim_token(key, "7:s:1", 2, "worker-0")
    assert auth.claim_token_valid(key, t, "7:s:1", 2, "worker-0")
    for args in (("7:s:1", 3, "worker-0"), ("7:s:1", 2, "worker-1"), ("7:s:2", 2, "worker-0")):
        assert not auth.claim_token_valid(key, t, *args), args
    assert not auth.claim_token_valid(b"x" * 32, t, "7:s:1", 2, "worker-0")
    with pytest.raises(Exception, match="unknown role"):
        auth.parse_role("root")


class Echo(execution_pb2_grpc.ExecutionServiceServicer):
    seen: list[auth.Identity | None] = []

    async def GetExecution(self, request, context):  # type: ignore[no-untyped-def]
        Echo.seen.append(auth.current.get())
        return execution_pb2.GetExecutionResponse()

    async def SubmitExecution(self, request, context):  # type: ignore[no-untyped-def]
        Echo.seen.append(auth.current.get())
        return execution_pb2.SubmitExecutionResponse(execution_id=1)


async def test_the_interceptor_refuses_before_the_handler_runs() -> None:
    good = {"tok-read": auth.Identity(1, "r", auth.Role.READ), "tok-submit": auth.Identity(2, "s", auth.Role.SUBMIT)}

    async def verify(token: str) -> auth.Identity | None:
        return good.get(token)

    server = grpc.aio.server(interceptors=[auth.AuthInterceptor(verify)])
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(Echo(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Echo.seen = []
    try:
        async def call(token: str, method: str = "GetExecution") -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 interceptors=auth.client_interceptors(token)) as ch:
                stub = execution_pb2_grpc.ExecutionServiceStub(ch)
                try:
                    if method == "GetExecution":
                        await stub.GetExecution(execution_pb2.GetExecutionRequest(), timeout=5)
                    else:
                        await stub.SubmitExecution(execution_pb2.SubmitExecutionRequest(), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

        assert await call("") == grpc.StatusCode.UNAUTHENTICATED
        assert await call("noetl_not-a-token") == grpc.StatusCode.UNAUTHENTICATED
        assert await call("tok-read", "SubmitExecution") == grpc.StatusCode.PERMISSION_DENIED
        assert Echo.seen == [], "a handler ran for a refused call"
        assert await call("tok-read") == grpc.StatusCode.OK
        assert await call("tok-submit", "SubmitExecution") == grpc.StatusCode.OK
        assert Echo.seen == [good["tok-read"], good["tok-submit"]]
        # health stays open
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await server.stop(None)
