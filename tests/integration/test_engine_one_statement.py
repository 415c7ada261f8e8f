"""The engine's one-statement batches (``ShardEngine._process_fast``, ``leases.fenced_batch``)
against real Postgres and NATS JetStream, on a fake shard of its own, with the test as the
worker (it publishes each command's result):

* a worker's result for a running execution whose state the engine has at hand commits as
  ONE statement; the events, states and commands it writes are those of the transaction
  path (gap-free ``shard_seq`` from the lease row's ``event_seq``);
* when the engine's idea of its lease row is stale (here: ``event_seq`` moved behind its
  back), the one statement writes nothing, and the batch is folded again in the
  transaction, which numbers its events from what Postgres holds;
* a batch whose writes depend on each other (a cancellation) takes the transaction.

The sweep runs once, at the start (a long interval): the test publishes every input.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY
from waiting import until

from noetl_api.catalog import Catalog
from noetl_api.engine.shard import EngineDeps, ShardEngine
from noetl_common import natsio
from noetl_common.config import CommandSettings, ExecutionSettings
from noetl_common.db import Pool
from noetl_common.ids import SnowflakeGenerator
from noetl_common.shards import ShardOwnership
from noetl_db import requests
from noetl_proto.v1 import messages_pb2
from noetl_store import MemoryResultStore, envelope_to_proto

pytestmark = pytest.mark.integration

IDS = SnowflakeGenerator(node_id=1017)
OWNER = 6_200_000_000 + random.randrange(1_000_000)
EPOCH = 4

PLAYBOOK = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: one_statement, path: tests/one_statement}
workflow:
  - step: a
    tool: {kind: noop}
    next: {arcs: [{step: b}]}
  - step: b
    tool: {kind: noop}
    next: {arcs: [{step: c}]}
  - step: c
    tool: {kind: noop}
"""


def batches(shard: int, path: str) -> float:
    return REGISTRY.get_sample_value("noetl_engine_batches_total", {"shard": str(shard), "path": path}) or 0.0


@dataclass
class Shard:
    pool: Pool
    nc: NATS
    shard: int = field(default_factory=lambda: 300_000 + random.randrange(1_000_000))
    catalog_id: int = 0
    engine: tuple[ShardEngine, asyncio.Future[Any]] | None = None

    async def setup(self) -> None:
        self.catalog_id = (await Catalog(self.pool).register(PLAYBOOK))[0].catalog_id
        await self.sql("INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
                       " VALUES ('api', %s, %s, %s, now() + interval '1 minute')", (self.shard, OWNER, EPOCH))
        own = ShardOwnership(self.pool, "api", lease_sec=60.0, margin_sec=5.0)
        own.runtime_id = OWNER
        assert await own.renew({self.shard: EPOCH}) == ({self.shard: EPOCH}, set())
        deps = EngineDeps(self.pool, self.nc, self.nc.jetstream(), Catalog(self.pool), MemoryResultStore(), own,
                          CommandSettings(handoff=False), ExecutionSettings(sweep_interval_sec=60))
        engine = ShardEngine(deps, self.shard, EPOCH)
        self.engine = (engine, asyncio.ensure_future(engine.run()))

    async def sql(self, query: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query, params)
            out = list(await cur.fetchall()) if cur.description else []
            await conn.commit()
        return out

    async def submit(self) -> int:
        eid = IDS.next_id()
        await self.sql("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload,"
                       " timeout_sec) VALUES (%s, %s, %s, '{}', 600)", (eid, self.shard, self.catalog_id))
        await self.publish(natsio.KIND_SUBMIT, messages_pb2.EngineInput(
            submitted=messages_pb2.ExecutionSubmitted(execution_id=eid)))
        return eid

    async def hand(self) -> int:
        """A submission as this api's Submitter makes it: committed, then handed to the
        engine in process with its row."""
        eid = IDS.next_id()
        async with self.pool.connection() as conn:
            row = await requests.insert_submission_row(
                conn, execution_id=eid, shard_id=self.shard, catalog_id=self.catalog_id, payload="{}",
                idempotency_key=None, parent_execution_id=None, parent_step=None, timeout_sec=600,
                traceparent=None, depth=0, workload_ref_id=None, payload_bytes=2, submitted_by=None, rerun_of=None,
                rerun_from=None, priority=None)
            await conn.commit()
        assert row is not None and self.engine is not None
        assert self.engine[0].take_submission(eid, {**row, "path": "tests/one_statement", "version": 1})
        return eid

    async def publish(self, kind: str, msg: messages_pb2.EngineInput) -> None:
        await natsio.publish(self.nc.jetstream(), natsio.events_subject(self.shard, kind), msg.SerializeToString())

    async def command(self, eid: int, step: str) -> dict[str, Any]:
        async def issued() -> dict[str, Any] | None:
            assert self.engine is not None and not self.engine[1].done(), "the engine stopped"
            found = await self.sql("SELECT command_id, attempt FROM noetl.command WHERE execution_id = %s"
                                   " AND step = %s", (eid, step))
            return found[0] if found else None

        return await until(issued, timeout=15, what=f"the command of step {step}")

    async def result(self, eid: int, step: str) -> None:
        """Run the step's command as a worker would (a noop: no result)."""
        c = await self.command(eid, step)
        env = {"status": "ok", "reference": None, "parent_ref": None, "context": {}}
        await self.publish(natsio.KIND_CALL, messages_pb2.EngineInput(call_result=messages_pb2.CallResult(
            command_id=c["command_id"], execution_id=eid, step=step, attempt=c["attempt"], worker_id="w-test",
            envelope=envelope_to_proto(env))))

    async def status(self, eid: int) -> str | None:
        found = await self.sql("SELECT status FROM noetl.engine_state WHERE execution_id = %s", (eid,))
        return found[0]["status"] if found else None

    async def cleanup(self) -> None:
        if self.engine is not None:
            engine, task = self.engine
            engine.stop()
            await asyncio.wait_for(task, timeout=15)
        for table in ("event", "command", "engine_state", "cancel_request", "execution_request"):
            await self.sql(f"DELETE FROM noetl.{table} WHERE shard_id = %s", (self.shard,))
        await self.sql("DELETE FROM noetl.shard_lease WHERE role = 'api' AND shard_id = %s", (self.shard,))


@pytest.fixture
async def shard(pool: Pool, nc: NATS) -> AsyncIterator[Shard]:
    s = Shard(pool, nc)
    await s.setup()
    try:
        yield s
    finally:
        await s.cleanup()


async def test_results_commit_as_one_statement_and_a_stale_lease_view_takes_the_transaction(shard: Shard) -> None:
    one, missed = batches(shard.shard, "one statement"), batches(shard.shard, "gate missed")
    eid = await shard.submit()
    await shard.result(eid, "a")
    await shard.command(eid, "b")
    # (a nudge that arrives after the sweep started the execution is a batch of its own too)
    assert batches(shard.shard, "one statement") >= one + 1, "a's result: one statement"
    one = batches(shard.shard, "one statement")
    # behind the engine's back, the lease row's event_seq moves (nothing else could write at
    # this epoch; the engine must still never number events from a stale idea of it)
    await shard.sql("UPDATE noetl.shard_lease SET event_seq = event_seq + 5 WHERE role = 'api' AND shard_id = %s",
                    (shard.shard,))
    await shard.result(eid, "b")
    await shard.command(eid, "c")
    assert batches(shard.shard, "gate missed") == missed + 1
    await shard.result(eid, "c")
    await until(lambda: shard.status(eid), timeout=15, what="the execution's state")

    async def completed() -> bool:
        return await shard.status(eid) == "completed"

    await until(completed, timeout=15, what="the execution completed")
    assert batches(shard.shard, "one statement") == one + 1, "c's result: one statement again"
    seqs = [r["shard_seq"] for r in await shard.sql(
        "SELECT shard_seq FROM noetl.event WHERE shard_id = %s ORDER BY shard_seq", (shard.shard,))]
    gap = next(i for i in range(1, len(seqs)) if seqs[i] != seqs[i - 1] + 1)
    assert seqs[gap] == seqs[gap - 1] + 6, f"numbered from what Postgres held after the miss: {seqs}"
    assert seqs[gap + 1:] == list(range(seqs[gap] + 1, seqs[gap] + len(seqs) - gap)), seqs
    lease = (await shard.sql("SELECT event_seq FROM noetl.shard_lease WHERE role = 'api' AND shard_id = %s",
                             (shard.shard,)))[0]
    assert lease["event_seq"] == seqs[-1]
    kinds = [r["event_type"] for r in await shard.sql(
        "SELECT event_type FROM noetl.event WHERE execution_id = %s ORDER BY shard_seq", (eid,))]
    assert kinds.count("call.done") == 3 and kinds[-1] == "playbook.completed", kinds
    done = await shard.sql("SELECT step, status FROM noetl.command WHERE execution_id = %s ORDER BY step", (eid,))
    assert [(r["step"], r["status"]) for r in done] == [("a", "done"), ("b", "done"), ("c", "done")]


async def test_a_cancellation_takes_the_transaction(shard: Shard) -> None:
    eid = await shard.submit()
    await shard.command(eid, "a")
    dependent = batches(shard.shard, "dependent writes")
    await shard.sql("INSERT INTO noetl.cancel_request (execution_id, shard_id, reason) VALUES (%s, %s, 'test')",
                    (eid, shard.shard))
    await shard.publish(natsio.KIND_CANCEL, messages_pb2.EngineInput(
        cancel=messages_pb2.CancelRequested(execution_id=eid, reason="test")))

    async def cancelled() -> bool:
        return await shard.status(eid) == "cancelled"

    await until(cancelled, timeout=15, what="the execution cancelled")
    assert batches(shard.shard, "dependent writes") == dependent + 1
    assert await shard.sql("SELECT 1 FROM noetl.cancel_request WHERE execution_id = %s", (eid,)) == [], \
        "the transaction applied the cancellation"


async def test_a_submission_handed_with_its_row_starts_in_one_statement_and_only_once(shard: Shard) -> None:
    """This api's own submission comes with its request row: its start reads nothing and
    commits as one statement, which checks that the execution has no state yet; handed
    again (here after the engine forgot it), that check fails, nothing is written, and the
    transaction sees the duplicate."""
    await shard.command(await shard.hand(), "a")  # the engine's first batch reads its lease row's positions
    one, missed = batches(shard.shard, "one statement"), batches(shard.shard, "gate missed")
    eid = await shard.hand()
    await shard.command(eid, "a")
    assert batches(shard.shard, "one statement") == one + 1
    assert shard.engine is not None
    engine = shard.engine[0]
    engine._cache.pop(eid, None)  # as if evicted: the next hand-over looks fresh
    row = (await shard.sql("SELECT r.*, c.path, c.version FROM noetl.execution_request r JOIN noetl.catalog c"
                           " USING (catalog_id) WHERE r.execution_id = %s", (eid,)))[0]
    assert engine.take_submission(eid, row)

    async def missed_once() -> bool:
        return batches(shard.shard, "gate missed") == missed + 1

    await until(missed_once, timeout=15, what="the second start refused by its check")
    started = await shard.sql("SELECT count(*) AS n FROM noetl.event WHERE execution_id = %s"
                              " AND event_type = 'playbook.started'", (eid,))
    assert started[0]["n"] == 1
    for step in ("a", "b", "c"):
        await shard.result(eid, step)

    async def completed() -> bool:
        return await shard.status(eid) == "completed"

    await until(completed, timeout=15, what="the execution completed")
