"""Identity on every call, against the roles as processes (issue 12, acceptance): every
RPC of every service, called without a token, with a bad token and with a token of a
role that may not call it, is refused with the right code and writes nothing; a read
token cannot submit; a worker token cannot submit a top-level execution or read
credentials; the worker API is not served on the client port; a result without its
claim's token is not accepted; a Leave without the member's secret evicts nobody."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from chaos import Db
from harness import Runner
from waiting import until_sync

from noetl_cli.supervise import open_channel
from noetl_common import auth, natsio
from noetl_proto.v1 import (
    auth_pb2,
    catalog_pb2,
    common_pb2,
    execution_pb2,
    messages_pb2,
    schedule_pb2,
    shard_manager_pb2,
    worker_pb2,
)

pytestmark = pytest.mark.e2e

SERVICES = [(auth_pb2, "AuthService", "api"), (catalog_pb2, "CatalogService", "api"),
            (catalog_pb2, "CredentialService", "api"), (execution_pb2, "ExecutionService", "api"),
            (worker_pb2, "WorkerService", "worker_api"), (shard_manager_pb2, "ShardManagerService", "shard_manager"),
            (schedule_pb2, "ScheduleService", "api")]
ROLE_ORDER = (auth.Role.READ, auth.Role.SUBMIT, auth.Role.WORKER, auth.Role.SERVICE, auth.Role.ADMIN)
TABLES = ("execution_request", "catalog", "credential", "api_token", "runtime", "cancel_request", "result_ref",
          "schedule")


def methods() -> list[tuple[str, Any, Any, bool, str]]:
    """(full method, request class, response class, server streaming, where it is served)."""
    out = []
    for module, name, where in SERVICES:
        svc = module.DESCRIPTOR.services_by_name[name]
        for m in svc.methods:
            req = getattr(module, m.input_type.name, None) or _message(m.input_type)
            resp = getattr(module, m.output_type.name, None) or _message(m.output_type)
            out.append((f"/{svc.full_name}/{m.name}", req, resp, m.server_streaming, where))
    return out


def _message(descriptor: Any) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


CA = ""  # the stack's CA (set by the module fixture)


def call(target: str, method: str, req: Any, resp: Any, streaming: bool, token: str) -> grpc.StatusCode:
    md = [("authorization", f"Bearer {token}")] if token else []
    with open_channel(target, CA) as ch:
        try:
            if streaming:
                for _ in ch.unary_stream(method, request_serializer=req.SerializeToString,
                                         response_deserializer=resp.FromString)(req(), metadata=md, timeout=10):
                    break
            else:
                ch.unary_unary(method, request_serializer=req.SerializeToString,
                               response_deserializer=resp.FromString)(req(), metadata=md, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def tokens(runner: Runner) -> dict[auth.Role, str]:
    global CA
    CA = runner.state.ca_file
    out = {}
    for role in ROLE_ORDER:
        resp = runner.api.tokens.CreateToken(auth_pb2.CreateTokenRequest(
            role=role.value, name=f"sec-{role.value}-{uuid.uuid4().hex[:6]}"), timeout=10)
        out[role] = resp.token
    return out


def counts(db: Db) -> dict[str, int]:
    return {t: int(db.value(f"SELECT count(*) FROM noetl.{t}")) for t in TABLES}


def test_every_rpc_refuses_no_token_a_bad_token_and_a_wrong_role(runner: Runner, db: Db,
                                                                 tokens: dict[auth.Role, str]) -> None:
    state = runner.state
    targets = {"api": state.api.split(",")[-1].removeprefix("ipv4:"),
               "worker_api": state.worker_api.split(",")[-1].removeprefix("ipv4:"),
               "shard_manager": state.shard_manager.split(",")[-1].removeprefix("ipv4:")}
    before = counts(db)
    wrong_codes = []
    for method, req, resp, streaming, where in methods():
        target = targets[where]
        assert call(target, method, req, resp, streaming, "") == grpc.StatusCode.UNAUTHENTICATED, method
        bad = "noetl_" + uuid.uuid4().hex * 2
        assert call(target, method, req, resp, streaming, bad) == grpc.StatusCode.UNAUTHENTICATED, method
        allowed = auth.METHOD_ROLES[method]
        wrong = next(r for r in ROLE_ORDER if r not in allowed)
        code = call(target, method, req, resp, streaming, tokens[wrong])
        if code != grpc.StatusCode.PERMISSION_DENIED:
            wrong_codes.append((method, wrong.value, code))
    assert not wrong_codes, f"a token of a role not allowed got through: {wrong_codes}"
    assert counts(db) == before, "a refused call wrote something"


def test_what_each_role_may_not_do(runner: Runner, tokens: dict[auth.Role, str]) -> None:
    api = runner.state.api.split(",")[-1].removeprefix("ipv4:")
    submit = execution_pb2.SubmitExecutionRequest(playbook_yaml=(
        "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: sec, path: tests/sec}\n"
        "workflow:\n  - step: start\n    tool: {kind: noop}\n"))
    md = lambda role: [("authorization", f"Bearer {tokens[role]}")]  # noqa: E731
    with open_channel(api, runner.state.ca_file) as ch:
        from noetl_proto.v1 import catalog_pb2_grpc, execution_pb2_grpc, worker_pb2_grpc

        ex = execution_pb2_grpc.ExecutionServiceStub(ch)
        # a read token cannot submit; a worker token cannot submit a top-level execution
        for role in (auth.Role.READ, auth.Role.WORKER):
            with pytest.raises(grpc.RpcError) as info:
                ex.SubmitExecution(submit, metadata=md(role), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, role  # type: ignore[attr-defined]
        # a worker token cannot read credentials
        with pytest.raises(grpc.RpcError) as info:
            catalog_pb2_grpc.CredentialServiceStub(ch).ListCredentials(catalog_pb2.ListCredentialsRequest(),
                                                                        metadata=md(auth.Role.WORKER), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        # the worker API is not on the client port at all
        with pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.WorkerServiceStub(ch).ClaimCommand(worker_pb2.ClaimCommandRequest(
                command_id="1:x:1", worker_id="w", attempt=1), metadata=md(auth.Role.WORKER), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
        # a submit token submits, and cancels its own execution but not another token's
        mine = ex.SubmitExecution(submit, metadata=md(auth.Role.SUBMIT), timeout=10).execution_id
        ex.CancelExecution(execution_pb2.CancelExecutionRequest(execution_id=mine), metadata=md(auth.Role.SUBMIT),
                           timeout=10)
        theirs = runner.submit(submit.playbook_yaml).execution_id  # the admin's
        with pytest.raises(grpc.RpcError) as info:
            ex.CancelExecution(execution_pb2.CancelExecutionRequest(execution_id=theirs),
                               metadata=md(auth.Role.SUBMIT), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


SLOW = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sec_slow, path: tests/sec_slow}
workflow:
  - step: start
    tool: {kind: python, code: "import time\\ntime.sleep(3)\\nresult = 'real'"}
"""


def test_a_result_without_its_claim_token_is_not_accepted(runner: Runner, db: Db) -> None:
    eid = runner.submit(SLOW).execution_id
    row = until_sync(lambda: db.one("SELECT command_id, shard_id, attempt, worker_id FROM noetl.command"
                                    " WHERE execution_id = %s AND status = 'claimed'", (eid,)),
                     timeout=30, what="the claim")
    forged = messages_pb2.CallResult(
        command_id=row["command_id"], execution_id=eid, step="start", attempt=row["attempt"],
        worker_id=row["worker_id"], claim_token="0" * 40,
        envelope=common_pb2.ResultEnvelope(status="ok"), set_json=json.dumps({"ctx": {}, "iter": {}}))
    import asyncio

    async def publish() -> None:
        nc = await runner.state.nats_connect("test-forger")
        try:
            await natsio.publish(nc.jetstream(), natsio.events_subject(row["shard_id"], natsio.KIND_CALL),
                                 messages_pb2.EngineInput(call_result=forged).SerializeToString())
        finally:
            await nc.close()

    asyncio.run(publish())
    out = runner.wait(eid, 60)
    assert out.status == "COMPLETED" and out.result("start") == "real", "the forged result was accepted"
    assert db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s AND event_type = 'call.done'",
                    (eid,)) == 1


def test_a_leave_without_the_member_secret_evicts_nobody(runner: Runner, db: Db,
                                                          tokens: dict[auth.Role, str]) -> None:
    victim = db.one("SELECT runtime_id FROM noetl.runtime WHERE role = 'worker' AND status = 'alive'"
                    " ORDER BY runtime_id DESC LIMIT 1")
    assert victim is not None
    target = runner.state.shard_manager.split(",")[-1].removeprefix("ipv4:")
    from noetl_proto.v1 import shard_manager_pb2_grpc

    with open_channel(target, runner.state.ca_file) as ch:
        stub = shard_manager_pb2_grpc.ShardManagerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Leave(shard_manager_pb2.LeaveRequest(runtime_id=victim["runtime_id"], member_secret="guess"),
                       metadata=[("authorization", f"Bearer {tokens[auth.Role.SERVICE]}")], timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        # a worker token may join only as a worker
        with pytest.raises(grpc.RpcError) as info:
            stub.Join(shard_manager_pb2.JoinRequest(role="api", instance="intruder", pid=1),
                      metadata=[("authorization", f"Bearer {tokens[auth.Role.WORKER]}")], timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert db.value("SELECT status FROM noetl.runtime WHERE runtime_id = %s", (victim["runtime_id"],)) == "alive"


def test_a_plaintext_connection_to_any_grpc_port_fails(runner: Runner) -> None:
    """Every role serves TLS only: a client speaking plaintext HTTP/2 gets nothing, not even
    a health answer."""
    from noetl_cli.supervise import health_check

    addresses = [p.grpc for p in runner.state.processes()] + [p.worker_grpc for p in runner.state.processes("api")]
    assert all(addresses)
    for address in addresses:
        assert health_check(address, timeout=3) == "UNREACHABLE", address
        assert health_check(address, timeout=3, ca_file=runner.state.ca_file) == "SERVING", address


SNOOP = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sec_snoop, path: tests/sec_snoop}
workflow:
  - step: start
    tool:
      kind: python
      code: |
        import os
        with open(f"/proc/{os.getppid()}/environ", "rb") as fh:
            parent = fh.read().decode(errors="replace").split("\\0")
        result = {"parent": parent, "own": [f"{k}={v}" for k, v in os.environ.items()], "ppid": os.getppid()}
"""


def test_a_task_finds_no_secret_in_the_workers_environment(runner: Runner, db: Db) -> None:
    """The worker re-executed itself with its secrets out of its startup environment, so
    /proc/<worker>/environ and the task's own environment hold no DSN, token or key."""
    out = runner.run(SNOOP, timeout=60)
    assert out.status == "COMPLETED", out.error
    seen = out.result("start")
    workers = {p.pid for p in runner.state.processes("worker")}
    assert seen["ppid"] in workers, "the task's parent is not the worker"
    secrets_ = [runner.state.postgres_dsn, *runner.state.tokens.values()]
    for where in ("parent", "own"):
        text = "\n".join(seen[where])
        assert "NOETL_POSTGRES_DSN" not in text and "NOETL_AUTH_TOKEN" not in text, (where, text[:2000])
        leaked = [s for s in secrets_ if s and s in text]
        assert not leaked, f"{where}: a secret is readable by task code"
    # read from outside too (this test runs as the stack's user): the startup environment holds none
    environ = Path(f"/proc/{seen['ppid']}/environ").read_bytes().decode(errors="replace")
    assert not [s for s in secrets_ if s and s in environ]
