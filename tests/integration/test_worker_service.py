"""The worker against real Postgres and NATS JetStream.

``execute_command`` with the Postgres result store, then the whole service loop:
notices on NOETL_COMMANDS, claims against a stand-in for the api's WorkerService (a
small gRPC servicer in this file: the real one lives in the api role), results on
``noetl.events.{shard}.call``."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import nats
import pytest
from psycopg_pool import AsyncConnectionPool
from waiting import until

from noetl_common import natsio
from noetl_common.config import CommandSettings, CoreSettings, LimitSettings, ShardSettings, WorkerSettings
from noetl_proto.v1 import messages_pb2, worker_pb2, worker_pb2_grpc
from noetl_store import PostgresResultStore, envelope_from_proto
from noetl_worker.runner import execute_command
from noetl_worker.service import CLAIM_RETRY_SEC, WorkerService
from noetl_worker.tools import PythonPool, Tools

pytestmark = pytest.mark.integration

_ids = itertools.count(1)


def make_command(code: str, *, shard: int = 5, input: dict[str, Any] | None = None,
                 context: dict[str, Any] | None = None, tool: Any = None) -> messages_pb2.Command:
    n = next(_ids)
    execution_id = 8_000_000_000 + n
    spec = {"step": f"step{n}", "tool": tool or {"kind": "python", "code": code, "input": input or {}}}
    ctx = {"execution_id": execution_id, "workload": {"message": "hi"}, "ctx": {}, "steps": {},
           "known_steps": [], "event": {}, "iter": None, **(context or {})}
    return messages_pb2.Command(command_id=f"{execution_id}:step{n}:1", execution_id=execution_id, shard_id=shard,
                                step=f"step{n}", attempt=1, kind="python", spec_json=json.dumps(spec),
                                context_json=json.dumps(ctx))


# ---------------------------------------------------------------- execute_command + Postgres store


async def test_execute_command_with_postgres_store(pool: AsyncConnectionPool) -> None:
    store = PostgresResultStore(pool)
    async with PythonPool(1) as python:
        tools = Tools(python=python)
        first = await execute_command(make_command("result = {'status': 'initialized', 'n': 1}"), store, tools)
        ref = envelope_from_proto(first.envelope)["reference"]
        context = {"steps": {"start": {"status": "ok", "reference": ref, "context": {"status": "initialized"}}},
                   "known_steps": ["start"]}
        tool = [{"name": "a", "kind": "python", "input": {"n": "{{ start.n }}"}, "code": "return n + 1"},
                {"name": "b", "kind": "python", "input": {"m": "{{ a }}"}, "code": "return {'m': m * 10}"}]
        second = await execute_command(make_command("", context=context, tool=tool), store, tools, worker_id="w")
    env = envelope_from_proto(second.envelope)
    assert env["status"] == "ok" and env["context"] == {"m": 20}
    assert await store.get(env["reference"]["ref_id"]) == {"m": 20}
    chain = await store.chain(env["reference"]["ref_id"])
    assert [r.ref_id for r in chain] == [env["reference"]["ref_id"], env["parent_ref"]["ref_id"]]
    assert await store.get(env["parent_ref"]["ref_id"]) == 2


# ---------------------------------------------------------------- the service loop


class FakeApi(worker_pb2_grpc.WorkerServiceServicer):
    """Stand-in for the api's WorkerService: first claim wins; scripted failures."""

    def __init__(self) -> None:
        self.commands: dict[str, messages_pb2.Command] = {}
        self.claimed: dict[str, str] = {}
        self.claims: list[str] = []
        self.unavailable: dict[str, int] = {}  # command_id -> claims to answer UNAVAILABLE
        self.stop: set[str] = set()
        self.renewals: list[str] = []

    async def ClaimCommand(self, request: worker_pb2.ClaimCommandRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ClaimCommandResponse:
        self.claims.append(request.command_id)
        if self.unavailable.get(request.command_id, 0) > 0:
            self.unavailable[request.command_id] -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine busy")
        command = self.commands.get(request.command_id)
        if command is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown command")
        if request.command_id in self.claimed:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "already claimed")
        self.claimed[request.command_id] = request.worker_id
        return worker_pb2.ClaimCommandResponse(command=command)

    async def RenewLease(self, request: worker_pb2.RenewLeaseRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.RenewLeaseResponse:
        self.renewals.append(request.command_id)
        stop = request.command_id in self.stop
        return worker_pb2.RenewLeaseResponse(stop=stop, stop_reason="cancelled" if stop else "")


class StandaloneWorker(WorkerService):
    joins = False  # no shard-manager in this test


class Harness:
    def __init__(self, api: FakeApi, svc: WorkerService, nc: Any, results: asyncio.Queue[Any]) -> None:
        self.api, self.svc, self.nc, self.results = api, svc, nc, results

    async def submit(self, command: messages_pb2.Command) -> None:
        self.api.commands[command.command_id] = command
        await self.notify(command)

    async def notify(self, command: messages_pb2.Command) -> None:
        notice = messages_pb2.CommandNotice(command_id=command.command_id, execution_id=command.execution_id,
                                            shard_id=command.shard_id, attempt=command.attempt, kind=command.kind)
        await natsio.publish(self.nc.jetstream(), natsio.commands_subject('default', 'normal', command.shard_id),
                             notice.SerializeToString(), msg_id=f"{command.command_id}#{command.attempt}")

    async def result_for(self, command_id: str, limit: float = 10) -> messages_pb2.CallResult:
        async with asyncio.timeout(limit):
            while True:
                subject, msg = await self.results.get()
                if msg.call_result.command_id == command_id:
                    assert subject == natsio.events_subject(5, natsio.KIND_CALL)
                    return msg.call_result


@pytest.fixture
async def harness(request: pytest.FixtureRequest, pg_dsn: str, nats_url: str) -> AsyncIterator[Harness]:
    """A running worker (no shard-manager) against the fake api; ``indirect`` params give
    it a Tools factory instead of the real tools, or a dict of ``tools``, ``worker``
    (WorkerSettings) and ``limits`` (LimitSettings)."""
    param = getattr(request, "param", None)
    options: dict[str, Any] = param if isinstance(param, dict) else {"tools": param}
    tools_factory = options.get("tools")
    api = FakeApi()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(api, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    core = CoreSettings(postgres_dsn=pg_dsn, nats_url=nats_url, api_target=f"127.0.0.1:{port}",
                        instance="test-worker-1", shutdown_grace_sec=3)
    svc = StandaloneWorker(core, ShardSettings(), CommandSettings(lease_sec=0.6),
                           options.get("worker") or WorkerSettings(concurrency=2, python_pool=2),
                           tools=tools_factory() if tools_factory else None, limits=options.get("limits"))
    nc = await nats.connect(nats_url)
    await natsio.ensure_streams(nc.jetstream())  # the api's part: workers wait for the streams
    running = asyncio.ensure_future(svc.run())
    await until(lambda: len(svc._slots) == 2 or running.done(), timeout=30, what="the worker's two slots",
                interval=0.02)
    assert not running.done()

    results: asyncio.Queue[Any] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        results.put_nowait((msg.subject, messages_pb2.EngineInput.FromString(msg.data)))

    await nc.subscribe("noetl.events.*.call", cb=on_event)
    yield Harness(api, svc, nc, results)
    svc.request_stop()
    await asyncio.wait_for(running, timeout=20)
    assert svc.tools is not None and (svc.tools.python is None or svc.tools.python.alive == 0)
    await nc.drain()
    await server.stop(0)


async def test_claims_runs_persists_and_publishes(harness: Harness, pool: AsyncConnectionPool) -> None:
    command = make_command("print('side output')\nresult = {'status': 'ok', 'msg': message}", input={
        "message": "{{ message }}"})
    await harness.submit(command)
    result = await harness.result_for(command.command_id)
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "ok" and env["context"] == {"status": "ok", "msg": "hi"}
    assert result.worker_id == "test-worker-1" and result.attempt == 1
    assert await PostgresResultStore(pool).get(env["reference"]["ref_id"]) == {"status": "ok", "msg": "hi"}
    assert harness.api.claimed[command.command_id] == "test-worker-1"


async def test_duplicate_notice_is_dropped_after_failed_claim(harness: Harness) -> None:
    command = make_command("result = 1")
    await harness.submit(command)
    await harness.result_for(command.command_id)
    before = harness.api.claims.count(command.command_id)
    await harness.notify(messages_pb2.Command(command_id=command.command_id, execution_id=command.execution_id,
                                              shard_id=command.shard_id, attempt=2, kind="python"))
    await until(lambda: harness.api.claims.count(command.command_id) == before + 1, timeout=10,
                what="the duplicate notice claimed", interval=0.02)
    await asyncio.sleep(0.3)  # a sleep, not a wait: time for a wrong result or a redelivery to show
    assert harness.results.empty()
    assert harness.api.claims.count(command.command_id) == before + 1  # acked: not redelivered


async def test_unavailable_claim_is_retried(harness: Harness) -> None:
    command = make_command("result = 'eventually'")
    harness.api.unavailable[command.command_id] = 1
    await harness.submit(command)
    result = await harness.result_for(command.command_id)
    assert envelope_from_proto(result.envelope)["context"] == {"value": "eventually"}
    assert harness.api.claims.count(command.command_id) == 2


async def test_a_claim_still_unavailable_after_its_retries_is_redelivered(harness: Harness) -> None:
    command = make_command("result = 'redelivered'")
    tries = len(CLAIM_RETRY_SEC) + 1
    harness.api.unavailable[command.command_id] = tries  # every try of the first delivery fails
    await harness.submit(command)
    result = await harness.result_for(command.command_id, limit=20)
    assert envelope_from_proto(result.envelope)["context"] == {"value": "redelivered"}
    assert harness.api.claims.count(command.command_id) == tries + 1  # the redelivered notice's claim


async def test_stop_from_renew_lease_cancels_and_publishes_nothing(harness: Harness) -> None:
    command = make_command("import time\ntime.sleep(30)\nresult = 'never'")
    harness.api.stop.add(command.command_id)
    await harness.submit(command)
    await until(lambda: command.command_id in harness.api.renewals, timeout=10, what="a lease renewal",
                interval=0.02)
    follow = make_command("result = 'after stop'")
    await harness.submit(follow)
    result = await harness.result_for(follow.command_id)
    assert envelope_from_proto(result.envelope)["context"] == {"value": "after stop"}
    await asyncio.sleep(0.3)  # a sleep, not a wait: time for the stopped command's result to wrongly show
    assert harness.results.empty()


async def test_lease_is_renewed_while_running(harness: Harness) -> None:
    command = make_command("import time\ntime.sleep(0.7)\nresult = 'slow'")
    await harness.submit(command)
    result = await harness.result_for(command.command_id)
    assert envelope_from_proto(result.envelope)["context"] == {"value": "slow"}
    assert harness.api.renewals.count(command.command_id) >= 2


async def test_shutdown_lets_running_commands_finish(harness: Harness) -> None:
    command = make_command("import time\ntime.sleep(0.5)\nresult = 'finished'")
    await harness.submit(command)
    await until(lambda: command.command_id in harness.api.claimed, timeout=10, what="the command claimed",
                interval=0.02)
    harness.svc.request_stop()
    result = await harness.result_for(command.command_id)
    assert envelope_from_proto(result.envelope)["context"] == {"value": "finished"}


class CrashingTools(Tools):
    async def run_task(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug in a tool")


@pytest.mark.parametrize("harness", [CrashingTools], indirect=True)
async def test_worker_bug_is_reported_and_the_slot_survives(harness: Harness) -> None:
    for _ in range(3):  # more commands than slots: the slots keep working
        command = make_command("result = 1")
        await harness.submit(command)
        env = envelope_from_proto((await harness.result_for(command.command_id)).envelope)
        assert env["status"] == "error" and env["error"]["code"] == "WORKER_ERROR"
        assert "bug in a tool" in env["error"]["message"]


# ---------------------------------------------------------------- limits (issue 11)

MIB = 1024 * 1024
LIMITED = {"worker": WorkerSettings(concurrency=2, python_pool=1, python_memory_mb=256),
           "limits": LimitSettings(result_bytes=MIB)}


@pytest.mark.parametrize("harness", [LIMITED], indirect=True)
async def test_hostile_tasks_fail_alone_within_the_worker_limits(harness: Harness, pool: AsyncConnectionPool) -> None:
    """NOETL_WORKER_PYTHON_MEMORY_MB and NOETL_LIMIT_RESULT_BYTES as the service wires them:
    a memory hog fails with MEMORY_LIMIT, a python result past the limit and a noop result
    the Postgres store refuses fail with RESULT_TOO_LARGE (not retryable, nothing stored),
    and the next command runs normally on the same worker."""
    async def run(command: messages_pb2.Command) -> dict[str, Any]:
        await harness.submit(command)
        return envelope_from_proto((await harness.result_for(command.command_id, limit=60)).envelope)

    hog = await run(make_command("b = bytearray(1024 * 1024 * 1024)\nresult = len(b)"))
    assert hog["status"] == "error" and hog["error"]["code"] == "MEMORY_LIMIT"
    assert hog["error"]["message"] == "python task exceeded its memory limit NOETL_WORKER_PYTHON_MEMORY_MB=256"

    big = make_command("return 'x' * (2 * 1024 * 1024)")
    env = await run(big)
    assert env["error"]["code"] == "RESULT_TOO_LARGE" and env["error"]["retryable"] is False
    assert env["error"]["message"] == (f"result of task '{big.step}' is {2 * MIB + 2} bytes; "
                                       f"limit NOETL_LIMIT_RESULT_BYTES={MIB}")

    echo = make_command("", tool=[{"name": "keep", "kind": "noop", "input": {"n": 1}},
                                  {"name": "blob", "kind": "noop", "input": {"blob": "z" * (2 * MIB)}}])
    env = await run(echo)
    assert env["error"]["code"] == "RESULT_TOO_LARGE" and env["error"]["retryable"] is False
    assert env["error"]["message"] == (f"result of task 'blob' is {2 * MIB + 11} bytes; "
                                       f"limit NOETL_LIMIT_RESULT_BYTES={MIB}")
    assert env["reference"] is None
    assert await PostgresResultStore(pool).get(env["parent_ref"]["ref_id"]) == {"n": 1}
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT task FROM noetl.result_ref WHERE command_id = %s", (echo.command_id,))
        assert [r["task"] for r in await cur.fetchall()] == ["keep"]

    fine = await run(make_command("return 'fine'"))
    assert fine["status"] == "ok" and fine["context"] == {"value": "fine"}


@pytest.mark.parametrize("harness", [{"worker": WorkerSettings(concurrency=2, python_pool=1,
                                                               python_tasks_per_child=2)}], indirect=True)
async def test_python_interpreters_are_replaced_after_the_tasks_per_child_setting(
        harness: Harness, pool: AsyncConnectionPool) -> None:
    """NOETL_WORKER_PYTHON_TASKS_PER_CHILD as the service wires it: 2 tasks, then a new interpreter."""
    pids = []
    for _ in range(4):
        command = make_command("import os\nreturn os.getpid()")
        await harness.submit(command)
        env = envelope_from_proto((await harness.result_for(command.command_id)).envelope)
        assert env["status"] == "ok", env
        pids.append(await PostgresResultStore(pool).get(env["reference"]["ref_id"]))
    assert pids[0] == pids[1] != pids[2] == pids[3], pids
