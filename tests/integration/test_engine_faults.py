"""The engine (``ShardEngine``) against real Postgres and NATS JetStream, on a fake shard
of its own, when its inputs or its stream go wrong:

* a poison input (a fault point that raises for one execution's inputs, every time) is
  split out of its batch and quarantined after three attempts: recorded durably with its
  error, its execution failed (``ENGINE_INPUT_QUARANTINED``), counted, listed by
  ``ListQuarantined``; inputs of other executions in the same batch go on; an undecodable
  message is quarantined in its place;
* a stream behind the engine's recorded position (messages lost by a restarted server, a
  recreated stream) is detected at takeover: the engine resumes at the stream's end and
  new inputs are consumed, not skipped;
* a cancellation is committed to Postgres before it is acknowledged: with NATS unable to
  carry the nudge, CancelExecution still answers accepted and the engine's sweep applies
  it;
* a checkpoint barrier behind a backlog of inputs is folded ahead of it (seed 004's
  checkpoint age counts that wait), once, and the positions the engine records still
  replay every input.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY
from waiting import until

from noetl_api.catalog import Catalog
from noetl_api.engine.shard import MAX_BATCH, EngineDeps, ShardEngine
from noetl_api.queries import Queries
from noetl_api.servicers import ExecutionServicer
from noetl_common import faults, natsio
from noetl_common.coalesce import ShardRounds
from noetl_common.config import CommandSettings, ExecutionSettings
from noetl_common.db import Column, Pool
from noetl_common.errors import NotFound
from noetl_common.ids import SnowflakeGenerator
from noetl_common.shards import ShardOwnership
from noetl_proto.v1 import execution_pb2, messages_pb2
from noetl_store import MemoryResultStore

pytestmark = pytest.mark.integration

IDS = SnowflakeGenerator(node_id=1018)
OWNER = 6_100_000_000 + random.randrange(1_000_000)
EPOCH = 3

PLAYBOOK = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: engine_faults, path: tests/engine_faults}
workflow:
  - step: start
    tool: {kind: noop}
"""


def metric(name: str, shard: int) -> float:
    return REGISTRY.get_sample_value(name, {"shard": str(shard)}) or 0.0


@dataclass
class Cell:
    pool: Pool
    nc: NATS
    shard: int = field(default_factory=lambda: 200_000 + random.randrange(1_000_000))
    executions: list[int] = field(default_factory=list)
    engine: tuple[ShardEngine, asyncio.Future[Any]] | None = None
    catalog_id: int = 0

    async def setup(self) -> None:
        entry, _ = await Catalog(self.pool).register(PLAYBOOK)
        self.catalog_id = entry.catalog_id
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
                " VALUES ('api', %s, %s, %s, now() + interval '1 minute')", (self.shard, OWNER, EPOCH))

    async def start_engine(self, sweeps: ShardRounds[int, bool] | None = None) -> ShardEngine:
        own = ShardOwnership(self.pool, "api", lease_sec=60.0, margin_sec=5.0)
        own.runtime_id = OWNER
        assert await own.renew({self.shard: EPOCH}) == ({self.shard: EPOCH}, set())
        deps = EngineDeps(self.pool, self.nc, self.nc.jetstream(), Catalog(self.pool), MemoryResultStore(), own,
                          CommandSettings(), ExecutionSettings(sweep_interval_sec=0.2))
        if sweeps is not None:
            deps.sweeps = sweeps
        engine = ShardEngine(deps, self.shard, EPOCH)
        self.engine = (engine, asyncio.ensure_future(engine.run()))
        return engine

    async def stop_engine(self) -> None:
        if self.engine is not None:
            engine, task = self.engine
            engine.stop()
            await asyncio.wait_for(task, timeout=15)
            self.engine = None

    async def request(self, nudge: bool = True) -> int:
        eid = IDS.next_id()
        self.executions.append(eid)
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload,"
                               " timeout_sec) VALUES (%s, %s, %s, '{}', 600)", (eid, self.shard, self.catalog_id))
        if nudge:
            await self.publish(natsio.KIND_SUBMIT, messages_pb2.EngineInput(
                submitted=messages_pb2.ExecutionSubmitted(execution_id=eid)).SerializeToString())
        return eid

    async def publish(self, kind: str, data: bytes) -> None:
        await natsio.publish(self.nc.jetstream(), natsio.events_subject(self.shard, kind), data)

    async def rows(self, query: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query, params)
            out = list(await cur.fetchall())
            await conn.commit()
        return out

    async def status(self, eid: int) -> str | None:
        found = await self.rows("SELECT status FROM noetl.engine_state WHERE execution_id = %s", (eid,))
        return found[0]["status"] if found else None

    async def cleanup(self) -> None:
        await self.stop_engine()
        async with self.pool.connection() as conn, conn.transaction():
            for table in ("event", "quarantine", "cancel_request"):
                await conn.execute(f"DELETE FROM noetl.{table} WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.command WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.engine_state WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.execution_request WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.shard_lease WHERE role = 'api' AND shard_id = %s", (self.shard,))


@pytest.fixture
async def cell(pool: Pool, nc: NATS) -> AsyncIterator[Cell]:
    c = Cell(pool, nc)
    await c.setup()
    try:
        yield c
    finally:
        await c.cleanup()


def fault_armed(point: str, key: object) -> bool:
    """Whether this process (the engine's) now fails at ``point`` for ``key``: the file
    is re-read at most every faults.READ_EVERY_SEC. Only for never-consumed (``*``) lines."""
    try:
        faults.check(point, key)
    except faults.InjectedFault:
        return True
    return False


@pytest.fixture
def armed(tmp_path: Path) -> Iterator[Path]:
    """This process's fault points armed from a file of the test's."""
    path = tmp_path / "faults"
    path.touch()
    faults.configure(str(path))
    try:
        yield path
    finally:
        faults.configure("")


async def test_a_poison_input_is_quarantined_and_the_rest_of_the_shard_goes_on(cell: Cell, armed: Path) -> None:
    await cell.start_engine()
    poisoned = await cell.request()
    await until(lambda: cell.status(poisoned), what="the execution to start", timeout=20)
    before = metric("noetl_engine_quarantined_total", cell.shard)
    # from now on every input of `poisoned` makes the engine raise (a bug on its data)
    await asyncio.to_thread(armed.write_text, f"engine.input {poisoned} *\n")
    await until(lambda: fault_armed("engine.input", poisoned), timeout=10, what="the fault armed in this process")
    await cell.publish(natsio.KIND_CANCEL, messages_pb2.EngineInput(cancel=messages_pb2.CancelRequested(
        execution_id=poisoned, reason="test")).SerializeToString())
    healthy = await cell.request()  # in the same batch or the next: it starts all the same
    await cell.publish(natsio.KIND_CALL, b"\xff\x00 not a protobuf")

    await until(lambda: _is(cell.rows("SELECT count(*) AS n FROM noetl.quarantine WHERE shard_id = %s",
                                      (cell.shard,)), [{"n": 2}]), timeout=30,
                what="the poison and the garbage quarantined")
    found = await cell.rows("SELECT * FROM noetl.quarantine WHERE shard_id = %s", (cell.shard,))
    kinds = {r["input_kind"]: r for r in found}
    assert set(kinds) == {"cancel", "undecodable"}, kinds
    poison = kinds["cancel"]
    assert poison["execution_id"] == poisoned and poison["attempts"] == 3
    assert "injected fault at engine.input" in poison["error"] and poison["stream_seq"] > 0
    assert messages_pb2.EngineInput.FromString(bytes(poison["input"])).cancel.execution_id == poisoned
    assert kinds["undecodable"]["execution_id"] == 0
    # its execution was failed in the same transaction, naming why
    assert await cell.status(poisoned) == "failed"
    failed = await cell.rows("SELECT result FROM noetl.event WHERE execution_id = %s AND event_type = 'playbook.failed'",
                             (poisoned,))
    assert len(failed) == 1 and "ENGINE_INPUT_QUARANTINED" in failed[0]["result"]["error"]["message"]
    # the rest of the shard went on
    await until(lambda: cell.status(healthy), what="the healthy execution to start", timeout=20)
    assert metric("noetl_engine_quarantined_total", cell.shard) == before + 2
    listed = await Queries(cell.pool, MemoryResultStore()).quarantined(poisoned, 10)
    assert [r["input_kind"] for r in listed] == ["cancel"]


async def test_an_execution_whose_start_is_poisoned_reads_failed_and_is_not_swept_again(cell: Cell, armed: Path) -> None:
    doomed = IDS.next_id()
    await asyncio.to_thread(armed.write_text, f"engine.input {doomed} *\n")
    await until(lambda: fault_armed("engine.input", doomed), timeout=10, what="the fault armed in this process")
    await cell.start_engine()
    cell.executions.append(doomed)
    async with cell.pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload,"
                           " timeout_sec) VALUES (%s, %s, %s, '{}', 600)", (doomed, cell.shard, cell.catalog_id))
    # no nudge: the sweep finds it, fails on it, quarantines it once, and then skips it
    rows = await until(lambda: cell.rows("SELECT * FROM noetl.quarantine WHERE execution_id = %s", (doomed,)),
                       what="the start quarantined", timeout=30)
    assert rows[0]["input_kind"] == "submitted" and rows[0]["stream_seq"] is None
    await asyncio.sleep(1.0)  # a sleep, not a wait: five sweeps later there is still one record
    assert len(await cell.rows("SELECT 1 FROM noetl.quarantine WHERE execution_id = %s", (doomed,))) == 1
    queries = Queries(cell.pool, MemoryResultStore())
    row = await queries.execution(doomed)
    assert row["status"] == "FAILED" and "ENGINE_INPUT_QUARANTINED" in row["error"]
    unknown = IDS.next_id()
    with pytest.raises(NotFound, match=f"execution {unknown} not found"):
        await queries.execution(unknown)


async def test_engine_resumes_at_the_end_of_a_stream_that_went_back(cell: Cell) -> None:
    js = cell.nc.jetstream()
    last = int((await js.stream_info(natsio.EVENTS_STREAM)).state.last_seq)
    # the shard's engine had recorded a position the stream no longer reaches
    async with cell.pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE noetl.shard_lease SET stream_seq = %s WHERE role = 'api' AND shard_id = %s",
                           (last + 1000, cell.shard))
    before = metric("noetl_engine_stream_resets_total", cell.shard)
    await cell.start_engine()
    eid = await cell.request()  # lands at a position below the recorded one
    await until(lambda: cell.status(eid), what="the execution submitted after the reset to start", timeout=20)
    assert metric("noetl_engine_stream_resets_total", cell.shard) == before + 1
    lease = (await cell.rows("SELECT stream_seq FROM noetl.shard_lease WHERE role = 'api' AND shard_id = %s",
                             (cell.shard,)))[0]
    now_last = int((await js.stream_info(natsio.EVENTS_STREAM)).state.last_seq)
    assert lease["stream_seq"] <= now_last, (lease, now_last)


async def test_a_cancel_is_in_postgres_before_it_is_acknowledged(cell: Cell, nats_url: str) -> None:
    await cell.start_engine()
    eid = await cell.request()
    await until(lambda: cell.status(eid), what="the execution to start", timeout=20)
    # a NATS connection that is closed: the nudge cannot be published
    dead = await natsio.connect(nats_url, name="test-dead-nats")
    await dead.close()
    servicer = ExecutionServicer(None, Queries(cell.pool, MemoryResultStore()), dead, dead.jetstream())
    resp = await servicer.CancelExecution(execution_pb2.CancelExecutionRequest(execution_id=eid, reason="durable"),
                                          None)  # type: ignore[arg-type]
    assert resp.accepted
    # committed before the answer, applied by the engine's sweep, then gone
    await until(lambda: _is(cell.status(eid), "cancelled"), what="the sweep to apply the cancel", timeout=20)
    assert await cell.rows("SELECT 1 FROM noetl.cancel_request WHERE execution_id = %s", (eid,)) == []
    cancelled = await cell.rows("SELECT result FROM noetl.event WHERE execution_id = %s"
                                " AND event_type = 'playbook.cancelled'", (eid,))
    assert len(cancelled) == 1 and cancelled[0]["result"]["error"]["message"] == "durable"


async def _is(value: Awaitable[Any], wanted: Any) -> bool:
    return await value == wanted


@pytest.mark.parametrize("candidates", ["read", "failing"])
async def test_a_submission_whose_nudge_was_lost_is_started_by_the_sweep(cell: Cell, candidates: str) -> None:
    """The sweep starts a committed submission nobody nudged: found by the shared read of
    the shards with something to sweep (``sweep_rounds``), or, when that read fails, by
    the shard's own full sweep."""
    asked: list[list[int]] = []

    async def broken(shards: list[int]) -> dict[int, bool]:
        asked.append(shards)
        raise OSError("connection refused")

    await cell.start_engine(ShardRounds(broken, False) if candidates == "failing" else None)
    eid = await cell.request(nudge=False)
    await until(lambda: cell.status(eid), what="the swept submission to start", timeout=20)
    if candidates == "failing":
        assert asked, "the shared read was asked (and failed) before the full sweep"


async def test_a_checkpoint_barrier_goes_ahead_of_a_backlog(cell: Cell) -> None:
    # three batches of submissions, then a barrier, all in the stream before the engine starts
    ids = [IDS.next_id() for _ in range(3 * MAX_BATCH)]
    cell.executions += ids
    async with cell.pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload,"
                           " timeout_sec) SELECT e, %s, %s, '{}', 600 FROM unnest(%t::bigint[]) AS e",
                           (cell.shard, cell.catalog_id, Column(ids)))
    for start in range(0, len(ids), 100):
        await asyncio.gather(*(cell.publish(natsio.KIND_SUBMIT, messages_pb2.EngineInput(
            submitted=messages_pb2.ExecutionSubmitted(execution_id=eid)).SerializeToString())
            for eid in ids[start:start + 100]))
    epoch = IDS.next_id()
    barrier = messages_pb2.EngineInput(barrier=messages_pb2.CheckpointBarrier(shard_id=cell.shard,
                                                                              checkpoint_epoch=epoch))
    await cell.publish(natsio.KIND_BARRIER, barrier.SerializeToString())
    await cell.start_engine()

    async def folded() -> bool:
        found = await cell.rows("SELECT (SELECT count(*) FROM noetl.engine_state WHERE shard_id = %s) AS n,"
                                " (SELECT count(*) FROM noetl.event WHERE shard_id = %s AND event_type = %s) AS b",
                                (cell.shard, cell.shard, "checkpoint.committed"))
        return found[0]["n"] == len(ids) and found[0]["b"] > 0

    await until(folded, timeout=120, what="every execution of the backlog started and the barrier appended")
    marks = await cell.rows("SELECT shard_seq, meta FROM noetl.event WHERE shard_id = %s AND event_type = %s",
                            (cell.shard, "checkpoint.committed"))
    assert len(marks) == 1 and marks[0]["meta"]["checkpoint_epoch"] == epoch, marks
    firsts = await cell.rows("SELECT execution_id, min(shard_seq) AS first FROM noetl.event WHERE shard_id = %s"
                             " AND execution_id = ANY(%t::bigint[]) GROUP BY execution_id", (cell.shard, Column(ids)))
    assert len(firsts) == len(ids)
    # published after all of them, it was folded before some: it did not wait for the backlog
    behind = sum(1 for r in firsts if r["first"] > marks[0]["shard_seq"])
    assert behind > 0, "the barrier was folded after the whole backlog"
    lease = (await cell.rows("SELECT stream_seq, barrier_epoch, barrier_seq FROM noetl.shard_lease"
                             " WHERE role = 'api' AND shard_id = %s", (cell.shard,)))[0]
    assert (lease["barrier_epoch"], lease["barrier_seq"]) == (epoch, marks[0]["shard_seq"])
    # the recorded position covers the whole backlog: nothing is replayed past it or skipped
    last = int((await cell.nc.jetstream().stream_info(natsio.EVENTS_STREAM)).state.last_seq)
    assert lease["stream_seq"] <= last

    # delivered again (a replay after a crash, a checkpointer asking twice): dropped by its epoch
    await cell.publish(natsio.KIND_BARRIER, barrier.SerializeToString())
    late = await cell.request()
    await until(lambda: cell.status(late), timeout=30, what="an execution submitted after the repeat")
    again = await cell.rows("SELECT count(*) AS n FROM noetl.event WHERE shard_id = %s AND event_type = %s",
                            (cell.shard, "checkpoint.committed"))
    assert again[0]["n"] == 1
