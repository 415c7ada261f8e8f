"""The reaper's scheduler (noetl_reaper.scheduler) against real Postgres and a real gRPC
server standing in for the api's ExecutionService: fired ticks are submitted with their
idempotency keys; an unreachable api leaves them pending (retried with the same key); a
refusal is recorded and not retried; a second submission of a key answers the same
execution and changes nothing."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import grpc
import pytest

from noetl_client import values
from noetl_common import grpcutil
from noetl_common.config import ScheduleSettings
from noetl_common.db import Pool, autocommit
from noetl_common.errors import InvalidInput, Unavailable
from noetl_common.schedules import CatchUp, Spec
from noetl_db.schedules import ScheduleStore, idempotency_key
from noetl_proto.v1 import execution_pb2, execution_pb2_grpc
from noetl_reaper.scheduler import ShardScheduler

pytestmark = pytest.mark.integration

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
OWNER = 9_100_001


class Api(execution_pb2_grpc.ExecutionServiceServicer):
    """Answers like the api's Submitter: one execution per idempotency key."""

    def __init__(self) -> None:
        self.by_key: dict[str, int] = {}
        self.requests: list[execution_pb2.SubmitExecutionRequest] = []
        self.down = False
        self.refuse = ""

    async def SubmitExecution(self, request: execution_pb2.SubmitExecutionRequest,
                              context: grpc.aio.ServicerContext) -> execution_pb2.SubmitExecutionResponse:
        self.requests.append(request)
        if self.down:
            raise Unavailable("the api is starting")
        if self.refuse and self.refuse in request.ref.path:
            raise InvalidInput(f"playbook {request.ref.path!r} not found")
        seen = request.idempotency_key in self.by_key
        eid = self.by_key.setdefault(request.idempotency_key, 1000 + len(self.by_key))
        return execution_pb2.SubmitExecutionResponse(execution_id=eid, deduplicated=seen)


@pytest.fixture
async def api() -> AsyncIterator[tuple[Api, execution_pb2_grpc.ExecutionServiceStub]]:
    servicer = Api()
    server = grpc.aio.server(interceptors=[grpcutil.ErrorInterceptor()])
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, execution_pb2_grpc.ExecutionServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def _scheduler(pool: Pool, stub: execution_pb2_grpc.ExecutionServiceStub,
                     path: str = "tests/sched") -> tuple[ShardScheduler, ScheduleStore, int]:
    store = ScheduleStore(pool, shard_count=16)
    shard = 1_400_000 + random.randrange(1_000_000)
    row = await store.add(name=f"s-{uuid.uuid4().hex[:10]}", path=path, version=3, payload={"n": 1},
                          spec=Spec(interval_ms=1000), catch_up=CatchUp.ALL, paused=False, created_by=None, now=T0)
    async with autocommit(pool) as conn:
        await conn.execute("UPDATE noetl.schedule SET shard_id = %s WHERE schedule_id = %s",
                           (shard, row["schedule_id"]))
        await conn.execute("INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
                           " VALUES ('reaper', %s, %s, 1, now() + interval '1 hour')", (shard, OWNER))
    settings = ScheduleSettings.model_construct(min_interval_sec=1.0, misfire_grace_sec=5.0, poll_sec=1.0,
                                                submit_timeout_sec=5.0)
    return ShardScheduler(store, stub, shard, 1, OWNER, settings), store, row["schedule_id"]


async def test_ticks_are_submitted_with_their_keys_and_retried_while_the_api_is_down(
        pool: Pool, api: tuple[Api, execution_pb2_grpc.ExecutionServiceStub]) -> None:
    servicer, stub = api
    scheduler, store, sid = await _scheduler(pool, stub)
    await store.fire_due(scheduler.shard, OWNER, 1, grace_sec=5, now=T0 + timedelta(seconds=2.5))
    servicer.down = True
    assert await scheduler.submit_pending() == 0
    assert len((await store.pending([scheduler.shard])).get(scheduler.shard, [])) == 2  # still to do, same keys next time
    servicer.down = False
    assert await scheduler.submit_pending() == 2
    keys = [idempotency_key(sid, T0 + timedelta(seconds=s)) for s in (1, 2)]
    assert [r.idempotency_key for r in servicer.requests] == [keys[0], keys[0], keys[1]]
    assert [(r.ref.path, r.ref.version, values.from_struct(r.payload)) for r in servicer.requests] == [
        ("tests/sched", 3, {"n": 1})] * 3
    assert [t["execution_id"] for t in await store.ticks(sid)] == [servicer.by_key[k] for k in keys]
    # a crash before the write-back: the same key again answers the same execution
    async with autocommit(pool) as conn:
        await conn.execute("UPDATE noetl.schedule_tick SET execution_id = NULL WHERE schedule_id = %s", (sid,))
    assert await scheduler.submit_pending() == 2
    assert [t["execution_id"] for t in await store.ticks(sid)] == [servicer.by_key[k] for k in keys]
    assert len(servicer.by_key) == 2


async def test_a_refused_tick_is_recorded_and_not_retried(
        pool: Pool, api: tuple[Api, execution_pb2_grpc.ExecutionServiceStub]) -> None:
    servicer, stub = api
    scheduler, store, sid = await _scheduler(pool, stub, path="tests/gone")
    servicer.refuse = "gone"
    await store.fire_due(scheduler.shard, OWNER, 1, grace_sec=5, now=T0 + timedelta(seconds=1.5))
    assert await scheduler.submit_pending() == 1
    assert await scheduler.submit_pending() == 0
    assert len(servicer.requests) == 1
    assert [t["error"] for t in await store.ticks(sid)] == [
        "INVALID_ARGUMENT: playbook 'tests/gone' not found"]
