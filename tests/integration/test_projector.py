"""The projector against real Postgres and NATS: events of a fake shard, appended the way
the engine appends them (gap-free ``shard_seq``, v3 envelopes), folded by
``ShardProjector.project_once`` into ``noetl.execution`` / ``noetl.execution_step``
under the projector's fenced lease, with the watermark in ``noetl.projection_checkpoint``.

Each test owns a shard id nobody else uses and deletes what it wrote."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from waiting import until, until_set

from noetl_common import natsio
from noetl_common.coalesce import ShardRounds
from noetl_common.db import Pool, make_pool
from noetl_common.errors import LeaseLost, Unavailable
from noetl_common.ids import SnowflakeGenerator
from noetl_common.shards import ShardOwnership
from noetl_db import read_models
from noetl_projector import worker
from noetl_projector.worker import ShardProjector, projection_polls

pytestmark = pytest.mark.integration

SNOWFLAKES = SnowflakeGenerator(node_id=1022)
RUNTIME_ID = 9_000_000_000 + random.randrange(1_000_000)  # a fake projector member
EPOCH = 3


def ok(ref_id: int, **context: Any) -> dict[str, Any]:
    return {"status": "ok", "reference": {"ref_id": ref_id, "type": "db", "uri": f"pg://result_payload/{ref_id}"},
            "parent_ref": None, "context": context}


def failed(message: str, code: str = "TOOL_ERROR") -> dict[str, Any]:
    return {"status": "error", "reference": None, "parent_ref": None, "context": {},
            "error": {"code": code, "message": message, "kind": "RuntimeError", "retryable": False}}


@dataclass
class Shard:
    """A fake shard: appends events as the engine would and owns the projector lease."""

    pool: Pool
    shard: int = field(default_factory=lambda: 100_000 + random.randrange(1_000_000))
    seq: int = 0
    base: datetime = field(default_factory=lambda: datetime.now(UTC) - timedelta(minutes=1))
    executions: list[int] = field(default_factory=list)
    visits: dict[tuple[int, str], int] = field(default_factory=dict)

    def at(self, seq: int) -> datetime:
        return self.base + timedelta(milliseconds=10 * seq)

    def execution(self) -> int:
        self.executions.append(SNOWFLAKES.next_id())
        return self.executions[-1]

    async def append(self, *events: tuple[int, str, str | None, dict[str, Any] | None, dict[str, Any]]) -> None:
        rows = []
        for eid, kind, step, result, meta in events:
            self.seq += 1
            command_id = None
            if step is not None:  # the command of the step's current visit, as the engine names it
                if kind == "step.enter":
                    self.visits[(eid, step)] = int(meta["visit"])
                command_id = f"{eid}:{step}:{self.visits[(eid, step)]}"
            rows.append((eid, self.shard, self.seq, kind, step, command_id,
                         json.dumps(result) if result is not None else None, json.dumps(meta), self.at(self.seq)))
        async with self.pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type, step, command_id, result,"
                " meta, created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)", rows)

    async def own(self, epoch: int, owner: int = RUNTIME_ID) -> None:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
                " VALUES ('projector', %s, %s, %s, now() + interval '1 minute')"
                " ON CONFLICT (role, shard_id) DO UPDATE SET owner_runtime_id = EXCLUDED.owner_runtime_id,"
                " epoch = EXCLUDED.epoch, leased_until = EXCLUDED.leased_until", (self.shard, owner, epoch))

    def projector(self, nc: NATS, *, epoch: int = EPOCH, batch_size: int = 100,
                  runtime_id: int = RUNTIME_ID, polls: ShardRounds[int, bool] | None = None,
                  poll_sec: float = 1.0, window_sec: float = 0.0) -> ShardProjector:
        ownership = ShardOwnership(self.pool, "projector", lease_sec=60.0, margin_sec=5.0)
        ownership.runtime_id = runtime_id
        return ShardProjector(self.pool, nc, ownership, self.shard, epoch, batch_size=batch_size,
                              poll_sec=poll_sec, polls=polls, window_sec=window_sec)

    async def rows(self, sql: str, params: Any) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, params)
            out = await cur.fetchall()
            await conn.commit()
        return out

    async def views(self) -> dict[str, Any]:
        """The read models and the watermark of this shard (``updated_at`` left out)."""
        executions = await self.rows("SELECT * FROM noetl.execution WHERE execution_id = ANY(%s)"
                                     " ORDER BY execution_id", (self.executions,))
        steps = await self.rows("SELECT * FROM noetl.execution_step WHERE execution_id = ANY(%s)"
                                " ORDER BY execution_id, step", (self.executions,))
        return {"executions": [{k: v for k, v in r.items() if k != "updated_at"} for r in executions],
                "steps": steps, "watermark": await self.watermark()}

    async def watermark(self) -> int | None:
        found = await self.rows("SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s",
                                (self.shard,))
        return found[0]["last_shard_seq"] if found else None

    async def reset(self, *, views: bool) -> None:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("UPDATE noetl.projection_checkpoint SET last_shard_seq = 0 WHERE shard_id = %s",
                               (self.shard,))
            if views:
                await conn.execute("DELETE FROM noetl.execution_step WHERE execution_id = ANY(%s)", (self.executions,))
                await conn.execute("DELETE FROM noetl.execution WHERE execution_id = ANY(%s)", (self.executions,))

    async def cleanup(self) -> None:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("DELETE FROM noetl.event WHERE execution_id = ANY(%s)", (self.executions,))
            await conn.execute("DELETE FROM noetl.execution_step WHERE execution_id = ANY(%s)", (self.executions,))
            await conn.execute("DELETE FROM noetl.execution WHERE execution_id = ANY(%s)", (self.executions,))
            await conn.execute("DELETE FROM noetl.projection_checkpoint WHERE shard_id = %s", (self.shard,))
            await conn.execute("DELETE FROM noetl.shard_lease WHERE role = 'projector' AND shard_id = %s",
                               (self.shard,))


@dataclass
class History:
    shard: Shard
    done: int  # completes after a retried step
    failed: int  # a parent of nothing, fails
    running: int  # still running
    requested_at: datetime


@pytest.fixture
async def history(pool: Pool) -> AsyncIterator[History]:
    """Three interleaved executions on one shard, 14 events."""
    sh = Shard(pool)
    e1, e2, e3 = sh.execution(), sh.execution(), sh.execution()
    requested = sh.base - timedelta(seconds=5)
    started = {"catalog_id": 42, "path": "tests/projector", "version": 3, "parent_execution_id": None,
               "requested_at": requested.isoformat()}
    try:
        await sh.append(
            (e1, "playbook.started", None, None, started),                                        # 1
            (e1, "step.enter", "start", None, {"visit": 1, "attempt": 1, "kind": "python"}),      # 2
            (e2, "playbook.started", None, None, {**started, "path": "tests/fails", "version": 1,
                                                  "parent_execution_id": e1}),                   # 3
            (e1, "call.done", "start", ok(101, status="initialized"), {"attempt": 1}),            # 4
            (e2, "step.enter", "boom", None, {"visit": 1, "attempt": 1}),                         # 5
            (e1, "step.enter", "fetch", None, {"visit": 1, "attempt": 1}),                        # 6
            (e2, "call.error", "boom", failed("boom failed"), {"attempt": 1}),                    # 7
            (e1, "call.error", "fetch", failed("timed out"), {"attempt": 1}),                     # 8
            (e2, "playbook.failed", None, failed("step boom failed", "EXECUTION_FAILED"), {}),    # 9
            (e1, "step.enter", "fetch", None, {"visit": 2, "attempt": 1}),                        # 10
            (e3, "playbook.started", None, None, {**started, "path": "tests/slow"}),             # 11
            (e1, "call.done", "fetch", ok(102, rows=2), {"attempt": 1}),                          # 12
            (e3, "step.enter", "wait", None, {"visit": 1, "attempt": 1}),                         # 13
            (e1, "playbook.completed", None, None, {}),                                           # 14
        )
        await sh.own(EPOCH)
        yield History(sh, e1, e2, e3, requested)
    finally:
        await sh.cleanup()


async def project_all(projector: ShardProjector) -> list[int]:
    """Run ``project_once`` until the shard is drained; returns each call's count."""
    counts = []
    while True:
        counts.append(await projector.project_once())
        if counts[-1] == 0:
            return counts
        assert len(counts) < 100


async def test_projects_executions_steps_and_watermark(history: History, nc: NATS) -> None:
    sh = history.shard
    hinted: set[str] = set()
    all_hinted = asyncio.Event()
    wanted = {natsio.progress_subject(e) for e in sh.executions}

    async def on_hint(msg: Any) -> None:
        hinted.add(msg.subject)
        if wanted <= hinted:
            all_hinted.set()

    sub = await nc.subscribe("noetl.progress.*", cb=on_hint)
    try:
        assert await sh.projector(nc).project_once() == 14
        await until_set(all_hinted, timeout=10, what="one hint per touched execution")
    finally:
        await sub.unsubscribe()
    assert await sh.projector(nc).project_once() == 0

    views = await sh.views()
    ex = {r["execution_id"]: r for r in views["executions"]}
    assert ex[history.done] == {
        "execution_id": history.done, "shard_id": sh.shard, "catalog_id": 42, "playbook_path": "tests/projector",
        "playbook_version": 3, "parent_execution_id": None, "status": "COMPLETED", "error": None,
        "created_at": history.requested_at, "started_at": sh.at(1), "ended_at": sh.at(14), "last_shard_seq": 14,
        "rerun_of": None}
    assert ex[history.failed]["status"] == "FAILED" and ex[history.failed]["error"] == "step boom failed"
    assert ex[history.failed]["parent_execution_id"] == history.done
    assert ex[history.failed]["playbook_path"] == "tests/fails" and ex[history.failed]["last_shard_seq"] == 9
    assert ex[history.running]["status"] == "RUNNING" and ex[history.running]["ended_at"] is None
    assert ex[history.running]["last_shard_seq"] == 13

    steps = {(r["execution_id"], r["step"]): r for r in views["steps"]}
    assert steps[(history.done, "start")] == {
        "execution_id": history.done, "step": "start", "status": "COMPLETED", "visits": 1, "attempts": 1,
        "result_ref_id": 101, "error": None, "started_at": sh.at(2), "ended_at": sh.at(4),
        "loop_total": None, "loop_done": 0, "loop_failed": 0}  # not a loop
    assert steps[(history.done, "fetch")] == {
        "execution_id": history.done, "step": "fetch", "status": "COMPLETED", "visits": 2, "attempts": 1,
        "result_ref_id": 102, "error": None, "started_at": sh.at(10), "ended_at": sh.at(12),
        "loop_total": None, "loop_done": 0, "loop_failed": 0}
    boom = steps[(history.failed, "boom")]
    assert (boom["status"], boom["error"], boom["result_ref_id"], boom["ended_at"]) == (
        "FAILED", "boom failed", None, sh.at(7))
    wait = steps[(history.running, "wait")]
    assert (wait["status"], wait["visits"], wait["ended_at"]) == ("RUNNING", 1, None)
    assert len(steps) == 4

    checkpoint = await sh.rows("SELECT * FROM noetl.projection_checkpoint WHERE shard_id = %s", (sh.shard,))
    assert checkpoint[0]["last_shard_seq"] == 14
    assert checkpoint[0]["last_projected_at"] is not None and checkpoint[0]["lag_ms"] >= 50_000


async def test_reprojecting_from_zero_changes_nothing(history: History, nc: NATS) -> None:
    sh = history.shard
    await project_all(sh.projector(nc))
    first = await sh.views()

    await sh.reset(views=False)  # the watermark goes back; the views keep their own last_shard_seq
    assert await sh.watermark() == 0
    assert await project_all(sh.projector(nc)) == [14, 0]
    assert await sh.views() == first


async def test_small_batches_fold_to_the_same_state(history: History, nc: NATS) -> None:
    sh = history.shard
    await project_all(sh.projector(nc))
    one_batch = await sh.views()

    await sh.reset(views=True)  # a fresh fold, two events per transaction
    assert (await sh.views())["executions"] == []
    projector = sh.projector(nc, batch_size=2)
    marks = []
    while await projector.project_once():
        marks.append(await sh.watermark())
    assert marks == [2, 4, 6, 8, 10, 12, 14]
    assert await sh.views() == one_batch


async def test_a_running_executions_later_batches_read_no_read_model_rows(history: History, nc: NATS,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The projector keeps the views it committed: a batch loads only executions it has not
    seen and that do not start in it (and, after a batch that failed, every one again); the
    rows come out as a fresh fold's. After its first batch (a transaction, which fences)
    each batch is one statement."""
    sh = history.shard
    await project_all(sh.projector(nc))
    expected = await sh.views()
    await sh.reset(views=True)
    loaded: list[list[int]] = []
    real_load, real_gated = read_models.load_views, worker.gated
    fail_next = False

    async def load_views(conn: Any, shard: int, ids: Any) -> Any:
        loaded.append(sorted(ids))
        return await real_load(conn, shard, ids)

    async def gated(conn: Any, gates: Any, writes: Any) -> bool:
        nonlocal fail_next
        if fail_next:
            fail_next = False
            raise Unavailable("injected: the batch's statement failed")
        return await real_gated(conn, gates, writes)

    monkeypatch.setattr(read_models, "load_views", load_views)
    monkeypatch.setattr(worker, "gated", gated)
    projector = sh.projector(nc, batch_size=2)
    assert await projector.project_once() == 2  # events 1-2: e1 (the transaction loads what it has not seen)
    assert await projector.project_once() == 2  # 3-4: e2 starts in the batch, e1 is kept
    assert loaded == [[history.done]]
    fail_next = True
    with pytest.raises(Unavailable):
        await projector.project_once()  # 5-6 fail: the kept views are dropped
    assert await projector.project_once() == 2  # 5-6 again: e1 and e2 read again
    assert loaded[-1] == sorted([history.done, history.failed])
    assert await project_all(projector) == [2, 2, 2, 2, 0]
    # e2 ended (event 9) and was let go; e1 was kept to its end, e3 started in a batch
    assert len(loaded) == 2
    assert await sh.views() == expected


async def test_a_batch_whose_watermark_moved_writes_nothing_and_takes_the_transaction(
        history: History, nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one statement's gates: the watermark it read past must still be the shard's
    (else nothing is written and the batch runs again in a transaction, from the real one)."""
    sh = history.shard
    projector = sh.projector(nc, batch_size=4)
    assert await projector.project_once() == 4  # the transaction: 1-4
    assert await projector.project_once() == 4  # one statement: 5-8
    async with sh.pool.connection() as conn:  # behind the projector's back
        await conn.execute("UPDATE noetl.projection_checkpoint SET last_shard_seq = 10 WHERE shard_id = %s",
                           (sh.shard,))
        await conn.commit()
    real_read = read_models.read_past
    reads: list[int] = []

    async def read_past(conn: Any, shard: int, limit: int) -> Any:
        watermark, events = await real_read(conn, shard, limit)
        reads.append(watermark)
        return 8, events  # the projector's stale idea of it

    monkeypatch.setattr(read_models, "read_past", read_past)
    assert await projector.project_once() == 4  # 11-14, after the gate refused the stale one
    assert reads == [10]
    assert await sh.watermark() == 14


async def test_stale_epoch_raises_lease_lost_and_writes_nothing(history: History, nc: NATS) -> None:
    sh = history.shard
    await project_all(sh.projector(nc))
    await sh.append((history.running, "call.done", "wait", ok(103), {"attempt": 1}),     # 15
                    (history.running, "playbook.completed", None, None, {}))             # 16
    before = await sh.views()

    await sh.own(EPOCH + 1)  # the shard was reassigned (to us again, at a new epoch)
    with pytest.raises(LeaseLost):
        await sh.projector(nc, epoch=EPOCH).project_once()
    with pytest.raises(LeaseLost):  # and another member cannot write under our epoch
        await sh.projector(nc, epoch=EPOCH + 1, runtime_id=RUNTIME_ID + 1).project_once()
    assert await sh.views() == before

    assert await project_all(sh.projector(nc, epoch=EPOCH + 1)) == [2, 0]
    after = {r["execution_id"]: r for r in (await sh.views())["executions"]}
    assert after[history.running]["status"] == "COMPLETED" and after[history.running]["last_shard_seq"] == 16


async def test_events_older_than_24_days_still_project(history: History, nc: NATS) -> None:
    """The lag of a long-stalled (or rebuilt) shard does not fit an int4 of milliseconds."""
    sh = history.shard
    await project_all(sh.projector(nc))
    sh.base = datetime.now(UTC) - timedelta(days=30)
    await sh.append((history.running, "call.done", "wait", ok(104), {"attempt": 1}))
    assert await sh.projector(nc).project_once() == 1
    checkpoint = await sh.rows("SELECT * FROM noetl.projection_checkpoint WHERE shard_id = %s", (sh.shard,))
    assert checkpoint[0]["last_shard_seq"] == 15 and checkpoint[0]["lag_ms"] == 2**31 - 1


async def test_run_loop_survives_a_lost_database_connection(history: History, nc: NATS, pg_dsn: str,
                                                          pool: Pool) -> None:
    """A dropped connection is a transient failure: the shard's loop retries, it does not die."""
    sh = history.shard
    own_pool = make_pool(pg_dsn, min_size=1, max_size=1, name="test-projector-run")
    await own_pool.open(wait=True, timeout=30)
    projector = sh.projector(nc)
    projector.pool = own_pool
    assert await projector.ownership.renew({sh.shard: EPOCH}) == ({sh.shard: EPOCH}, set())
    running = asyncio.ensure_future(projector.run())

    async def status_of(eid: int) -> str | None:
        found = await sh.rows("SELECT status FROM noetl.execution WHERE execution_id = %s", (eid,))
        return found[0]["status"] if found else None

    async def projected(eid: int, status: str) -> None:
        async def reached() -> bool:
            if running.done():  # not ignored: the loop died, there is nothing to wait for
                raise RuntimeError(f"the projector's loop ended: {running!r}")
            seen = await status_of(eid)
            assert seen == status, f"execution {eid} is {seen}"
            return True

        await until(reached, timeout=15, what=f"execution {eid} projected {status}", ignoring=AssertionError)

    try:
        await projected(history.done, "COMPLETED")
        async with own_pool.connection() as conn:
            backend = conn.info.backend_pid
        async with pool.connection() as conn:
            await conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
            await conn.commit()
        await sh.append((history.running, "call.done", "wait", ok(103), {"attempt": 1}),
                        (history.running, "playbook.completed", None, None, {}))
        await nc.publish(natsio.projector_subject(sh.shard), b"")
        await projected(history.running, "COMPLETED")
    finally:
        projector.stop()
        await asyncio.wait_for(running, timeout=10)
        await own_pool.close()


def recording_polls(pool: Pool) -> tuple[ShardRounds[int, bool], list[list[int]]]:
    """``projection_polls`` that also records the shards each of its reads asked for."""
    polls, asked = projection_polls(pool), []
    read = polls._read

    async def recording(shards: list[int]) -> Mapping[int, bool]:
        asked.append(sorted(shards))
        return await read(shards)

    polls._read = recording
    return polls, asked


async def test_the_slow_polls_of_a_processs_shards_are_one_read(history: History, nc: NATS, pool: Pool) -> None:
    """No hints: the slow poll finds new events, and the loops of two shards of one process
    poll together (one read for both); the fenced round runs only for the shard behind."""
    a = history.shard
    b = Shard(pool, shard=a.shard + 1)
    await b.own(EPOCH)
    polls, asked = recording_polls(pool)
    pa, pb = a.projector(nc, polls=polls), b.projector(nc, polls=polls)
    for p in (pa, pb):
        assert await p.ownership.renew({p.shard: EPOCH}) == ({p.shard: EPOCH}, set())
    runs = [asyncio.ensure_future(p.run()) for p in (pa, pb)]
    try:
        await until(lambda: a.watermark(), timeout=15, what="shard a projected at start")
        eid = b.execution()
        await b.append((eid, "playbook.started", None, None, {"catalog_id": 42, "path": "tests/polled", "version": 1,
                                                               "parent_execution_id": None}))

        async def polled_b() -> bool:
            assert not any(r.done() for r in runs), "a projector loop ended"
            return await b.watermark() == 1

        await until(polled_b, timeout=15, what="shard b's event found by the slow poll (no hint)")
        assert asked, "the slow polls went through projection_polls"
        # the loops poll on shared boundaries: their polls went out together
        assert sorted([a.shard, b.shard]) in asked, asked
    finally:
        for p in (pa, pb):
            p.stop()
        await asyncio.wait_for(asyncio.gather(*runs), timeout=10)
        await b.cleanup()


async def test_hinted_events_gather_for_the_batch_window_unless_the_hint_says_now(history: History,
                                                                                   nc: NATS) -> None:
    """The engine's plain hint lets events gather for the window (one batch for what arrives
    meanwhile); ``PROJECT_NOW`` (an execution ended, a barrier) projects at once. The
    windows here are long (no poll backstop within the test) so that the order, not a
    duration, is what is checked."""
    sh = history.shard
    projector = sh.projector(nc, poll_sec=600.0, window_sec=6.0)
    assert await projector.ownership.renew({sh.shard: EPOCH}) == ({sh.shard: EPOCH}, set())
    running = asyncio.ensure_future(projector.run())
    try:
        await until(lambda: sh.watermark(), timeout=15, what="the history projected at start")
        assert await sh.watermark() == 14
        await sh.append((history.running, "call.done", "wait", ok(103), {"attempt": 1}))
        await nc.publish(natsio.projector_subject(sh.shard), b"")
        await nc.flush()
        await asyncio.sleep(0.5)
        assert await sh.watermark() == 14, "a plain hint waits for the window"
        await sh.append((history.running, "playbook.completed", None, None, {}))
        await nc.publish(natsio.projector_subject(sh.shard), natsio.PROJECT_NOW)

        async def both() -> bool:
            assert not running.done(), "the projector's loop ended"
            return await sh.watermark() == 16

        # well before the 6 s window of the first hint runs out
        await until(both, timeout=4.0, what="both events projected at PROJECT_NOW")
    finally:
        projector.stop()
        await asyncio.wait_for(running, timeout=10)
