"""The checkpointer against real Postgres and NATS JetStream, with the real engine
(``ShardEngine``) and projector (``ShardProjector``) of the same fake shard in process.

``ShardCheckpointer`` asks the engine for a barrier (``CheckpointBarrier`` on
``noetl.events.{shard}.barrier``) only when the shard's log grew past the last sealed
epoch; the engine appends ``checkpoint.committed`` once per epoch; the checkpointer seals
the epoch in ``noetl.checkpoint`` only once the projection has passed the barrier, in one
statement fenced on its own lease: a stale epoch (or another member) writes nothing.

The log grows through the engine's own statements (fence -> append -> finish_batch on the
api lease row), so test writes and the running engine's batches serialise on that row
exactly as two engine batches do. Each test owns a shard id nobody else uses and deletes
what it wrote. Nothing here depends on ``noetl_checkpoint_age_seconds``'s value."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from waiting import until

from noetl_api.catalog import Catalog
from noetl_api.engine.shard import EngineDeps, ShardEngine
from noetl_checkpointer.worker import ShardCheckpointer, seal_rounds
from noetl_common import natsio
from noetl_common.config import CommandSettings, ExecutionSettings
from noetl_common.db import Pool
from noetl_common.errors import LeaseLost
from noetl_common.ids import SnowflakeGenerator
from noetl_common.shards import ShardOwnership
from noetl_db import events as event_log
from noetl_db import leases
from noetl_projector.worker import ShardProjector
from noetl_proto.v1 import messages_pb2
from noetl_store import MemoryResultStore

pytestmark = pytest.mark.integration

EXECUTIONS = SnowflakeGenerator(node_id=1020)
EPOCHS = SnowflakeGenerator(node_id=1019)  # checkpoint epochs are snowflakes of the checkpointer's node
ENGINE_OWNER = 7_100_000_000 + random.randrange(1_000_000)  # fake members
PROJECTOR_OWNER = ENGINE_OWNER + 1
CHECKPOINTER_OWNER = ENGINE_OWNER + 2
ENGINE_EPOCH = 1
PROJECTOR_EPOCH = 1
EPOCH = 5  # the checkpointer's lease epoch


@dataclass
class Cell:
    """One fake shard with its own engine (running), projector and checkpointer leases."""

    pool: Pool
    nc: NATS
    shard: int = field(default_factory=lambda: 300_000 + random.randrange(1_000_000))
    executions: list[int] = field(default_factory=list)
    tasks: list[tuple[Any, asyncio.Future[Any]]] = field(default_factory=list)

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    # ------------------------------------------------------------ setup

    async def lease(self, role: str, owner: int, epoch: int) -> None:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
                " VALUES (%s, %s, %s, %s, now() + interval '1 minute')"
                " ON CONFLICT (role, shard_id) DO UPDATE SET owner_runtime_id = EXCLUDED.owner_runtime_id,"
                " epoch = EXCLUDED.epoch, leased_until = EXCLUDED.leased_until",
                (role, self.shard, owner, epoch))

    async def ownership(self, role: str, owner: int, epoch: int) -> ShardOwnership:
        own = ShardOwnership(self.pool, role, lease_sec=60.0, margin_sec=5.0)
        own.runtime_id = owner
        assert await own.renew({self.shard: epoch}) == ({self.shard: epoch}, set())
        return own

    async def start_engine(self) -> None:
        await self.lease("api", ENGINE_OWNER, ENGINE_EPOCH)
        deps = EngineDeps(self.pool, self.nc, self.js, Catalog(self.pool), MemoryResultStore(),
                          await self.ownership("api", ENGINE_OWNER, ENGINE_EPOCH), CommandSettings(),
                          ExecutionSettings())
        self.spawn(ShardEngine(deps, self.shard, ENGINE_EPOCH))

    def spawn(self, worker: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(worker.run())
        self.tasks.append((worker, task))
        return task

    async def projector(self, batch_size: int = 100) -> ShardProjector:
        await self.lease("projector", PROJECTOR_OWNER, PROJECTOR_EPOCH)
        own = await self.ownership("projector", PROJECTOR_OWNER, PROJECTOR_EPOCH)
        return ShardProjector(self.pool, self.nc, own, self.shard, PROJECTOR_EPOCH, batch_size=batch_size,
                              poll_sec=0.2)

    async def checkpointer(self, *, epoch: int = EPOCH, owner: int = CHECKPOINTER_OWNER,
                           interval_sec: float = 0.05) -> ShardCheckpointer:
        own = ShardOwnership(self.pool, "checkpointer", lease_sec=60.0, margin_sec=5.0)
        own.runtime_id = owner
        return ShardCheckpointer(self.pool, self.js, own, EPOCHS, self.shard, epoch, interval_sec=interval_sec)

    # ------------------------------------------------------------ the log

    async def grow(self, n: int) -> int:
        """Append ``n`` events the way an engine batch does; returns the new last shard_seq."""
        async with self.pool.connection() as conn, conn.transaction():
            lease = await leases.fence(conn, "api", self.shard, ENGINE_OWNER, ENGINE_EPOCH, stream_seq=0)
            seq = int(lease["event_seq"])
            rows = []
            for _ in range(n):
                seq += 1
                eid = EXECUTIONS.next_id()
                self.executions.append(eid)
                meta = {"catalog_id": 1, "path": "tests/checkpointer", "version": 1, "parent_execution_id": None,
                        "requested_at": datetime.now(UTC).isoformat(), "epoch_id": int(lease["barrier_epoch"]),
                        "lease_epoch": ENGINE_EPOCH}
                rows.append((eid, self.shard, seq, "playbook.started", None, None, None, json.dumps(meta)))
            await event_log.append_events(conn, rows)
            await leases.finish_engine_batch(conn, "api", self.shard, seq, 0, int(lease["barrier_epoch"]),
                                          int(lease["barrier_seq"]))
        return seq

    # ------------------------------------------------------------ observations

    async def rows(self, query: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(query, params)
            out = list(await cur.fetchall())
            await conn.commit()
        return out

    async def engine_lease(self) -> dict[str, Any]:
        found = await self.rows("SELECT event_seq, barrier_epoch, barrier_seq FROM noetl.shard_lease"
                                " WHERE role = 'api' AND shard_id = %s", (self.shard,))
        return found[0]

    async def sealed(self) -> list[tuple[int, int]]:
        """(epoch, last_shard_seq) of every sealed checkpoint of the shard, oldest first."""
        found = await self.rows("SELECT epoch, last_shard_seq FROM noetl.checkpoint WHERE shard_id = %s"
                                " ORDER BY epoch", (self.shard,))
        return [(int(r["epoch"]), int(r["last_shard_seq"])) for r in found]

    async def barriers(self) -> list[tuple[int, int]]:
        """(shard_seq, checkpoint epoch) of every ``checkpoint.committed`` in the shard's log."""
        found = await self.rows("SELECT shard_seq, (meta->>'checkpoint_epoch')::bigint AS epoch FROM noetl.event"
                                " WHERE shard_id = %s AND event_type = 'checkpoint.committed' ORDER BY shard_seq",
                                (self.shard,))
        return [(int(r["shard_seq"]), int(r["epoch"])) for r in found]

    async def watermark(self) -> int:
        found = await self.rows("SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s",
                                (self.shard,))
        return int(found[0]["last_shard_seq"]) if found else 0

    async def last_request(self) -> tuple[int, messages_pb2.CheckpointBarrier] | None:
        """(stream seq, message) of the latest barrier request stored for the shard, or None."""
        try:
            msg = await self.js.get_last_msg(natsio.EVENTS_STREAM, natsio.events_subject(self.shard,
                                                                                          natsio.KIND_BARRIER))
        except NotFoundError:
            return None
        assert msg.data is not None and msg.seq is not None
        return msg.seq, messages_pb2.EngineInput.FromString(msg.data).barrier

    async def engine_appended(self, epoch: int) -> int:
        """Wait until the engine appended the barrier of ``epoch``; returns its shard_seq."""
        async def applied() -> int | None:
            lease = await self.engine_lease()
            return int(lease["barrier_seq"]) if int(lease["barrier_epoch"]) == epoch else None

        return await until(applied, what=f"the engine to append the barrier of epoch {epoch}", timeout=15)

    async def cleanup(self) -> None:
        for worker, task in self.tasks:
            worker.stop()
            await asyncio.wait_for(task, timeout=15)
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("DELETE FROM noetl.event WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.execution_step WHERE execution_id = ANY(%s)", (self.executions,))
            await conn.execute("DELETE FROM noetl.execution WHERE execution_id = ANY(%s)", (self.executions,))
            await conn.execute("DELETE FROM noetl.checkpoint WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.projection_checkpoint WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.shard_lease WHERE shard_id = %s"
                               " AND role IN ('api', 'projector', 'checkpointer')", (self.shard,))
        await self.js.purge_stream(natsio.EVENTS_STREAM, subject=natsio.events_filter(self.shard))


@pytest.fixture
async def cell(pool: Pool, nc: NATS) -> AsyncIterator[Cell]:
    c = Cell(pool, nc)
    try:
        await c.start_engine()
        await c.lease("checkpointer", CHECKPOINTER_OWNER, EPOCH)
        yield c
    finally:
        await c.cleanup()


async def project_all(projector: ShardProjector) -> None:
    for _ in range(100):
        if await projector.project_once() == 0:
            return
    raise AssertionError("projection did not drain")


async def test_an_idle_shard_is_never_barriered(cell: Cell) -> None:
    checkpointer = await cell.checkpointer()
    for _ in range(5):
        assert await checkpointer.tick() == "idle"
    assert await cell.last_request() is None, "a barrier was requested for a shard whose log is empty"
    assert await cell.sealed() == [] and await cell.barriers() == []
    assert (await cell.engine_lease())["event_seq"] == 0


async def test_ticks_read_together_and_only_a_shard_with_work_takes_the_fenced_round(cell: Cell) -> None:
    """The ticks' first read is shared (``seal_rounds``): two shards' in one read. An idle
    shard then skips its fenced transaction (a member whose lease is gone is not even
    fenced: it would write nothing); a shard whose log grew takes it and asks for a barrier."""
    states = seal_rounds(cell.pool)
    checkpointer = await cell.checkpointer()
    checkpointer.states = states
    other = ShardCheckpointer(cell.pool, cell.js, checkpointer.ownership, EPOCHS, cell.shard + 1, EPOCH,
                              interval_sec=0.05, states=states)
    stale = await cell.checkpointer(epoch=EPOCH + 5)  # no lease of that epoch: a fenced tick raises
    stale.states = states
    assert await asyncio.gather(checkpointer.tick_unless_idle(), other.tick_unless_idle(),
                                stale.tick_unless_idle()) == ["idle", "idle", "idle"]
    assert states.reads == 1
    assert await cell.last_request() is None
    await cell.grow(2)
    assert await checkpointer.tick_unless_idle() == "requested"
    with pytest.raises(LeaseLost):
        await stale.tick_unless_idle()


async def test_barrier_only_when_the_log_grew_and_sealed_once_projected(cell: Cell) -> None:
    checkpointer = await cell.checkpointer()
    projector = await cell.projector(batch_size=2)
    assert await cell.grow(3) == 3

    # the log grew: one barrier request for this shard
    assert await checkpointer.tick() == "requested"
    request = await cell.last_request()
    assert request is not None
    first_seq, first = request
    assert first.shard_id == cell.shard and first.checkpoint_epoch > 0
    # the engine appends checkpoint.committed after the 3 events, once
    assert await cell.engine_appended(first.checkpoint_epoch) == 4
    assert await cell.barriers() == [(4, first.checkpoint_epoch)]

    # not sealed while the projection has not passed the barrier
    assert await checkpointer.tick() == "waiting"
    assert await projector.project_once() == 2 and await cell.watermark() == 2
    assert await checkpointer.tick() == "waiting"
    assert await cell.sealed() == []
    assert await projector.project_once() == 2 and await cell.watermark() == 4

    # projected past the barrier: sealed at the barrier's shard_seq
    assert await checkpointer.tick() == "sealed"
    assert await cell.sealed() == [(first.checkpoint_epoch, 4)]

    # fully sealed and nothing new: no further request, no further barrier, no further seal
    for _ in range(3):
        assert await checkpointer.tick() == "idle"
    assert (await cell.last_request() or (0, None))[0] == first_seq
    assert await cell.barriers() == [(4, first.checkpoint_epoch)]
    assert await cell.sealed() == [(first.checkpoint_epoch, 4)]

    # the log grows again: a new, later epoch, sealed after its own barrier
    assert await cell.grow(2) == 6
    assert await checkpointer.tick() == "requested"
    request = await cell.last_request()
    assert request is not None and request[0] > first_seq
    second = request[1]
    assert second.checkpoint_epoch > first.checkpoint_epoch
    assert await cell.engine_appended(second.checkpoint_epoch) == 7
    await project_all(projector)
    assert await checkpointer.tick() == "sealed"
    assert await cell.sealed() == [(first.checkpoint_epoch, 4), (second.checkpoint_epoch, 7)]
    assert await cell.barriers() == [(4, first.checkpoint_epoch), (7, second.checkpoint_epoch)]
    assert await checkpointer.tick() == "idle"


async def test_a_stale_epoch_writes_nothing(cell: Cell) -> None:
    projector = await cell.projector()
    stale = await cell.checkpointer(epoch=EPOCH)
    await cell.grow(2)
    await cell.lease("checkpointer", CHECKPOINTER_OWNER, EPOCH + 1)  # reassigned (to us again, new epoch)

    # a stale member neither asks for a barrier ...
    with pytest.raises(LeaseLost):
        await stale.tick()
    assert await cell.last_request() is None
    # ... nor can another member use the current epoch
    with pytest.raises(LeaseLost):
        await (await cell.checkpointer(epoch=EPOCH + 1, owner=CHECKPOINTER_OWNER + 10)).tick()
    assert await cell.last_request() is None

    current = await cell.checkpointer(epoch=EPOCH + 1)
    assert await current.tick() == "requested"
    request = await cell.last_request()
    assert request is not None
    barrier_seq = await cell.engine_appended(request[1].checkpoint_epoch)
    await project_all(projector)
    assert await cell.watermark() >= barrier_seq

    # ... nor seals an epoch that is ready to be sealed
    with pytest.raises(LeaseLost):
        await stale.tick()
    assert await cell.sealed() == []

    # a stale member that still trusts its lease in memory is stopped by the fence
    own = await cell.ownership("checkpointer", CHECKPOINTER_OWNER, EPOCH + 1)
    await cell.lease("checkpointer", CHECKPOINTER_OWNER, EPOCH + 2)
    zombie = ShardCheckpointer(cell.pool, cell.js, own, EPOCHS, cell.shard, EPOCH + 1, interval_sec=0.05)
    await asyncio.wait_for(zombie.run(), timeout=15)  # returns: LeaseLost on its first tick
    assert await cell.sealed() == []

    assert await (await cell.checkpointer(epoch=EPOCH + 2)).tick() == "sealed"
    assert await cell.sealed() == [(request[1].checkpoint_epoch, barrier_seq)]


async def test_run_loop_seals_every_growth_and_leaves_an_idle_shard_alone(cell: Cell) -> None:
    projector = await cell.projector()
    cell.spawn(projector)
    checkpointer = await cell.checkpointer(interval_sec=0.05)
    own = await cell.ownership("checkpointer", CHECKPOINTER_OWNER, EPOCH)
    checkpointer.ownership = own
    running = cell.spawn(checkpointer)

    async def fully_sealed() -> bool:
        assert not running.done(), "the checkpointer loop stopped"
        sealed = await cell.sealed()
        return bool(sealed) and sealed[-1][1] == (await cell.engine_lease())["event_seq"]

    for n in (3, 1, 4):
        grown_to = await cell.grow(n)
        await until(fully_sealed, what=f"the shard sealed past shard_seq {grown_to}", timeout=15)
        assert (await cell.sealed())[-1][1] == grown_to + 1  # the barrier right after the growth

    # idle now: during many intervals nothing is requested, appended or sealed
    before = (await cell.last_request(), await cell.barriers(), await cell.sealed(), await cell.engine_lease())
    await asyncio.sleep(1.0)  # a sleep, not a wait: 20 checkpoint intervals in which nothing may happen
    after = (await cell.last_request(), await cell.barriers(), await cell.sealed(), await cell.engine_lease())
    assert after == before
    assert not running.done()

    # one barrier per epoch, each sealed exactly at its own shard_seq, epochs increasing
    barriers, sealed = after[1], after[2]
    assert [(epoch, seq) for seq, epoch in barriers] == sealed
    assert [e for e, _ in sealed] == sorted({e for e, _ in sealed})
    assert len(sealed) == 3
    assert await cell.watermark() >= sealed[-1][1]
