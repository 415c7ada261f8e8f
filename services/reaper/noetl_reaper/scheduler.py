"""One shard's scheduler loop (in the reaper: its shard leases are the schedules').

Two loops per shard (``noetl_db.schedules``):

    fire:   in one transaction fenced on this reaper lease term, record the due ticks the
            catch-up policies fire and move each schedule's next tick;
    submit: every recorded tick of the shard without an execution goes to the api's
            SubmitExecution with the tick's idempotency key; the answer's execution id
            is written back (woken by the fire loop, else every ``poll_sec``).

A crash (SIGKILL) anywhere costs nothing: before a fire commits nothing happened (the next
owner decides the same ticks); after it the tick is recorded and the next owner
submits it with the same key; after the api answered but before the write-back, the
next submission of the key answers the same execution (``deduplicated``). A stale
owner's fire matches no lease row (LeaseLost) and both loops end.

The fire loop sleeps until the shard's earliest next tick (at most ``poll_sec``, so a
schedule added meanwhile is seen within that). The periodic reads of all the shards a
reaper holds are made together (``ScheduleRounds``): the loops wake on the same
``poll_sec`` boundaries, one query finds which shards have a tick due, and only those
take the fenced round; one query finds every shard's ticks to submit. So a reaper's
idle cost does not grow with its shard count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from noetl_client import values
from noetl_common.coalesce import ShardRounds, to_boundary
from noetl_common.config import ScheduleSettings
from noetl_common.errors import LeaseLost, NoetlError
from noetl_db.schedules import ScheduleStore, idempotency_key
from noetl_proto.v1 import execution_pb2, execution_pb2_grpc

logger = logging.getLogger(__name__)

FIRED = Counter("noetl_schedule_fired_total", "Schedule ticks fired (recorded to be submitted, once each)")
SKIPPED = Counter("noetl_schedule_skipped_total", "Due schedule ticks dropped by their catch-up policy")
SUBMITTED = Counter("noetl_schedule_submitted_total", "Fired schedule ticks submitted to the api, by outcome",
                    ["outcome"])
for _outcome in ("started", "deduplicated", "refused", "retry"):  # exported as 0 before the first one
    SUBMITTED.labels(_outcome)
LAG = Histogram("noetl_schedule_lag_seconds", "From a schedule tick's time to its execution's submission",
                buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 3600))

# The api refused the submission for good: retrying the same request cannot succeed.
REFUSED_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE})
MIN_SLEEP_SEC = 0.02


class ScheduleRounds:
    """The scheduler loops' periodic reads, made together for the shards of a process:
    reads asked for within ``gather_sec`` of the first share one query
    (``noetl_common.coalesce.ShardRounds``)."""

    def __init__(self, store: ScheduleStore, *, gather_sec: float = 0.005) -> None:
        self.store = store
        self._due: ShardRounds[int, tuple[datetime, datetime | None] | None] = ShardRounds(
            self._read_due, None, gather_sec=gather_sec)
        self._pending: ShardRounds[int, list[dict[str, Any]]] = ShardRounds(
            store.pending, [], gather_sec=gather_sec)

    async def due(self, shard: int) -> tuple[datetime, datetime | None]:
        """The database's now and the shard's earliest next tick (None: no unpaused schedule)."""
        due = await self._due.get(shard)
        assert due is not None  # _read_due answers every shard
        return due

    async def pending(self, shard: int) -> list[dict[str, Any]]:
        """The shard's fired ticks not submitted yet, oldest first."""
        return list(await self._pending.get(shard))

    async def _read_due(self, shards: list[int]) -> dict[int, tuple[datetime, datetime | None] | None]:
        now, due = await self.store.next_due(shards)
        return {shard: (now, due.get(shard)) for shard in shards}


class ShardScheduler:
    def __init__(self, store: ScheduleStore, api: execution_pb2_grpc.ExecutionServiceStub, shard: int, epoch: int,
                 owner_runtime_id: int, settings: ScheduleSettings, rounds: ScheduleRounds | None = None) -> None:
        self.store = store
        self.api = api
        self.shard = shard
        self.epoch = epoch
        self.owner = owner_runtime_id
        self.settings = settings
        self.rounds = rounds or ScheduleRounds(store)
        self._stop = asyncio.Event()
        self._fired = asyncio.Event()  # ticks were recorded: the submit loop looks at once

    def stop(self) -> None:
        self._stop.set()
        self._fired.set()

    async def run(self) -> None:
        """The fire loop; the submit loop runs beside it, so a slow or unreachable api
        never delays the recording of ticks (nor makes a ``skip`` schedule miss one)."""
        submitter = asyncio.create_task(self._submit_loop(), name=f"scheduler-submit-{self.shard}")
        try:
            while not self._stop.is_set():
                wait = self.settings.poll_sec
                try:
                    wait = await self.fire()
                except LeaseLost as exc:
                    logger.warning("%s; scheduler of reaper shard %s stops", exc, self.shard)
                    return
                except NoetlError as exc:
                    logger.warning("scheduler shard %s: %s", self.shard, exc)
                wait = min(wait, to_boundary(self.settings.poll_sec))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=max(MIN_SLEEP_SEC, wait))
                if submitter.done() and not self._stop.is_set():
                    submitter.result()  # it crashed: raise, and ShardTasks restarts both loops
        finally:
            submitter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await submitter

    async def fire(self) -> float:
        """Record what is due; seconds until the next tick is due (at most ``poll_sec``).
        The fenced round runs only when the shard has a tick due (``ScheduleRounds.due``)."""
        now, next_due = await self.rounds.due(self.shard)
        if next_due is not None and next_due <= now:
            got = await self.store.fire_due(self.shard, self.owner, self.epoch,
                                            grace_sec=self.settings.misfire_grace_sec)
            FIRED.inc(got.fired)
            SKIPPED.inc(got.skipped)
            if got.fired or got.skipped:
                logger.info("scheduler shard %s: %d tick(s) fired, %d skipped by catch-up policy", self.shard,
                            got.fired, got.skipped)
            if got.fired:
                self._fired.set()
            now, next_due = got.now, got.next_due
        if next_due is None:
            return self.settings.poll_sec
        return min(self.settings.poll_sec, (next_due - now).total_seconds())

    async def _submit_loop(self) -> None:
        while not self._stop.is_set():
            self._fired.clear()
            try:
                await self.submit_pending()
            except NoetlError as exc:
                logger.warning("scheduler shard %s: %s", self.shard, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._fired.wait(), timeout=to_boundary(self.settings.poll_sec))

    async def submit_pending(self) -> int:
        """Submit the shard's recorded ticks without an execution, oldest first; stops at
        the first failure that may pass (the api unreachable, overloaded): the next round
        tries again with the same keys."""
        done = 0
        for tick in await self.rounds.pending(self.shard):
            if self._stop.is_set():
                break
            if not await self._submit(tick):
                break
            done += 1
        return done

    async def _submit(self, tick: dict[str, Any]) -> bool:
        key = idempotency_key(tick["schedule_id"], tick["tick"])
        try:
            payload = values.to_struct(tick["payload"], default=str)
        except ValueError as exc:  # stored before payloads were Structs: deeper than one carries
            SUBMITTED.labels("refused").inc()
            await self.store.refused(tick["schedule_id"], tick["tick"], f"INVALID_ARGUMENT: payload: {exc}")
            return True
        request = execution_pb2.SubmitExecutionRequest(
            ref=execution_pb2.PlaybookRef(path=tick["catalog_path"], version=tick["catalog_version"]),
            payload=payload, idempotency_key=key)
        try:
            answer = await self.api.SubmitExecution(request, timeout=self.settings.submit_timeout_sec)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in REFUSED_CODES:
                SUBMITTED.labels("refused").inc()
                logger.warning("schedule %s tick %s refused by the api: %s", tick["name"], tick["tick"].isoformat(),
                               exc.details())
                await self.store.refused(tick["schedule_id"], tick["tick"], f"{exc.code().name}: {exc.details()}")
                return True
            SUBMITTED.labels("retry").inc()
            logger.warning("schedule %s tick %s not submitted yet (%s: %s); retrying next round", tick["name"],
                           tick["tick"].isoformat(), exc.code().name, exc.details())
            return False
        await self.store.submitted(tick["schedule_id"], tick["tick"], answer.execution_id)
        SUBMITTED.labels("deduplicated" if answer.deduplicated else "started").inc()
        if not answer.deduplicated:
            LAG.observe(max(0.0, (datetime.now(UTC) - tick["tick"]).total_seconds()))
        logger.info("schedule %s tick %s: execution %s%s", tick["name"], tick["tick"].isoformat(),
                    answer.execution_id, " (already submitted)" if answer.deduplicated else "")
        return True
