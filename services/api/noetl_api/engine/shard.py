"""One shard's engine loop (ARCHITECTURE.md section 4, step 2).

Takes whatever inputs are pending *now* (no waiting window), and in ONE transaction:
fences on its lease row (which also records the stream position), appends the events
with gap-free ``shard_seq``, saves the touched executions' engine state, inserts and
updates commands. After commit it publishes the new commands and hints the projector.
A new owner resumes from ``stream_seq + 1`` with the committed state: nothing
committed is replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from prometheus_client import Counter, Histogram

import noetl_store
from noetl_common import auth, faults, natsio
from noetl_common.coalesce import ShardRounds, to_boundary
from noetl_common.config import CommandSettings, ExecutionSettings, LimitSettings
from noetl_common.db import Pool, autocommit, pipelined_transaction
from noetl_common.errors import LeaseLost, NoetlError
from noetl_common.ids import barrier_execution_id, snowflake_at
from noetl_common.retry import is_transient
from noetl_common.shards import ShardOwnership
from noetl_common.vocab import CommandStatus, EngineStatus, EventType, cancel_msg_id, notice_msg_id
from noetl_db import Write, leases
from noetl_db import commands as commands_db
from noetl_db import dead_letters as dead_letters_db
from noetl_db import engine_state as engine_state_db
from noetl_db import events as events_db
from noetl_db import limits as limits_db
from noetl_db import loops as loops_db
from noetl_db import requests as requests_db
from noetl_db.commands import QueuedCommand
from noetl_db.dead_letters import RedriveOutcome
from noetl_db.engine_state import StateRow
from noetl_db.events import EventRow
from noetl_db.loops import IterationKey, IterationResult
from noetl_dsl import merged_workload
from noetl_flow import (
    CallResultInput,
    ExecState,
    Flow,
    IterationOutcome,
    NewCommand,
    RedriveItem,
    StartInput,
    Transition,
    refusal,
    rerun,
)
from noetl_proto.v1 import messages_pb2
from noetl_store import ResultStore, envelope_from_proto

from ..catalog import Catalog
from ..claims import Claims
from . import limits
from .handoff import MAX_HANDOFF_BYTES, Offer, OfferBook
from .limits import EngineLimits
from .placing import Placed, place
from .traces import EngineTraces

logger = logging.getLogger(__name__)

ROLE = "api"  # the engine's shard leases are the api's

BATCH_EVENTS = Counter("noetl_engine_events_total", "Events appended by the engine", ["shard"])
BATCH_SECONDS = Histogram("noetl_engine_batch_seconds", "Engine batch transaction time",
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
BATCH_INPUTS = Histogram("noetl_engine_batch_inputs", "Inputs folded per engine batch",
                         buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
REPLAYED = Counter("noetl_engine_replayed_inputs_total",
                   "Inputs consumed after a takeover that were already in the stream when the shard was taken "
                   "(delivered to the previous owner but not committed by it)", ["shard"])
REPUBLISHED = Counter("noetl_engine_republished_commands_total", "Commands republished on takeover or re-issue")
DEAD_LETTERS = Counter("noetl_engine_dead_letters_total", "command.dead_lettered events appended", ["shard"])
DEAD_LETTERED = Counter("noetl_dead_letters_total",
                        "Commands that exhausted their attempts, recorded in noetl.dead_letter (reason: failed, a"
                        " call.error accepted; expired, claim leases ran out)", ["shard", "reason"])
REDRIVES = Counter("noetl_dead_letter_redrives_total",
                   "Redrive requests the engine applied, by outcome (redriven, refused)", ["shard", "outcome"])
QUARANTINED = Counter("noetl_engine_quarantined_total",
                      "Engine inputs quarantined after failing their batch repeatedly (not an outage)", ["shard"])
STREAM_RESETS = Counter("noetl_engine_stream_resets_total",
                        "Times an engine found the events stream behind its recorded position (messages lost or"
                        " the stream recreated) and resumed at the stream's end", ["shard"])
FORGED = Counter("noetl_engine_forged_results_total",
                 "Results ignored because they did not carry their claim's token (not from the worker that"
                 " holds the claim of that attempt)", ["shard"])
RESUBSCRIBES = Counter("noetl_engine_resubscribes_total",
                       "Engine consumers re-created after a NATS reconnect", ["shard"])

FAST_BATCHES = Counter("noetl_engine_batches_total",
                       "Engine batches by how they committed: as one statement, or in a transaction because"
                       " the batch needed reads first (needs reads), had writes that depend on each other"
                       " (dependent writes) or a gate of its one statement did not match (gate missed: its fence,"
                       " or an execution it started had state)",
                       ["shard", "path"])
HANDOFFS = Counter("noetl_engine_handoffs_total",
                   "Commands the engine handed straight to the worker that offered to take them", ["shard"])

MAX_BATCH = 500
# Inputs taken from NATS but not folded yet, at most: a full queue stops the subscription
# callback, so the server stops delivering (flow control) instead of the api growing.
MAX_QUEUE = 10_000
# A single input whose batch fails this many times for a reason that is not an outage is
# quarantined (recorded, its execution failed, skipped).
POISON_ATTEMPTS = 3
UNDECODABLE = "undecodable"


@dataclass
class EngineDeps:
    pool: Pool
    nc: NATS
    js: JetStreamContext
    catalog: Catalog
    results: ResultStore
    ownership: ShardOwnership
    commands: CommandSettings
    executions: ExecutionSettings
    limits: LimitSettings = field(default_factory=LimitSettings.model_construct)
    # Results must echo their claim's token (auth.claim_token); empty: not checked.
    claim_key: bytes = b""
    # assembles the commands handed to workers ("Handoff"); None: no handoffs
    claims: Claims | None = None
    # offers no command of their own result took, for the next command of any shard here
    offers: OfferBook = field(default_factory=OfferBook)
    reconnects: natsio.Reconnects = field(default_factory=natsio.Reconnects)
    workloads: OrderedDict[int, dict[str, Any]] = field(default_factory=OrderedDict)
    # the submission's priority per execution ("" when it gave none), kept and dropped
    # with the workloads, reloaded with the request when missing
    priorities: OrderedDict[int, str] = field(default_factory=OrderedDict)
    # the reference of the execution's workload in the result store (None: inline), kept
    # with the priorities: a handed-off command carries it as a claim's answer does
    workload_refs: OrderedDict[int, int | None] = field(default_factory=OrderedDict)
    traces: EngineTraces = field(default_factory=EngineTraces)
    concurrency: EngineLimits = field(default_factory=EngineLimits)
    # the shard engines' sweeps start with one shared read (``sweep_rounds``)
    sweeps: ShardRounds[int, bool] = field(init=False)

    def __post_init__(self) -> None:
        self.sweeps = sweep_rounds(self.pool)


def sweep_rounds(pool: Pool) -> ShardRounds[int, bool]:
    """Which shards' sweeps may find something, read once for every shard engine of a
    process (``requests.sweep_candidates``: a superset of what a sweep finds). The engines
    sweep on the same interval boundaries, so an idle api makes one query a sweep, not
    six per shard; a shard left out skips its six sweep statements."""

    async def read(shards: list[int]) -> dict[int, bool]:
        async with pool.connection() as conn:
            found = await requests_db.sweep_candidates(conn, ROLE, shards)
            await conn.commit()
        return dict.fromkeys(found, True)

    return ShardRounds(read, False)


@dataclass
class _Input:
    kind: str  # submitted | call_result | cancel | expired | barrier | timeout | abort | redrive
    execution_id: int
    msg: Any = None
    seq: int = 0  # stream position (0: a sweep input)
    data: bytes | None = None  # the raw message (kept for a quarantine record)
    # a redrive input: who asked for each dead letter, and the refusals made without a
    # transition (the execution has no state, or was compacted)
    requested_by: dict[int, str] = field(default_factory=dict)
    refused: list[tuple[int, str | None, str | None]] = field(default_factory=list)
    # a submission this api committed and handed over: its request row as committed
    request: dict[str, Any] | None = None


@dataclass
class _Batch:
    """What a batch folds to: the lease positions it leaves (``seq``: the last ``shard_seq``
    numbered), its writes, and what is sent once they commit."""

    seq: int
    sweep_from: int
    barrier_epoch: int
    barrier_seq: int
    new_sweep: int = 0
    events: list[EventRow] = field(default_factory=list)
    touched: dict[int, tuple[ExecState, int]] = field(default_factory=dict)
    new_commands: list[QueuedCommand] = field(default_factory=list)
    updates: list[Any] = field(default_factory=list)
    publish: list[tuple[str, int, int, str, Placed]] = field(default_factory=list)
    handoffs: list[tuple[str, int, bytes]] = field(default_factory=list)  # (worker, execution, the Command)
    unused: list[Offer] = field(default_factory=list)  # offers kept for another command once it commits
    taken: list[Offer] = field(default_factory=list)  # kept offers its commands took
    loop_results: list[IterationResult] = field(default_factory=list)
    dead_letters: list[tuple[int, Any]] = field(default_factory=list)
    redrives: list[RedriveOutcome] = field(default_factory=list)
    cleared: list[IterationKey] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)  # cancelled in this batch
    finished: list[int] = field(default_factory=list)  # terminal in this batch

    def state_rows(self) -> list[StateRow]:
        return [StateRow(s, last, _deadline(s)) for s, last in self.touched.values()]


class _NeedsTransaction(Exception):
    """A fold on the one-statement path used the batch's connection: it takes the
    transaction instead."""


class _NoConnection:
    """The connection a one-statement batch's fold gets: any use of it is
    ``_NeedsTransaction``."""

    def __getattr__(self, name: str) -> Any:
        raise _NeedsTransaction(name)


_NO_CONNECTION: Any = _NoConnection()


@dataclass
class _Quarantined:
    inp: _Input
    attempts: int
    error: str


class ShardEngine:
    def __init__(self, deps: EngineDeps, shard: int, epoch: int) -> None:
        self.d = deps
        self.shard = shard
        self.epoch = epoch
        self._queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=MAX_QUEUE)
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._cache: OrderedDict[int, ExecState] = OrderedDict()
        self._sub: Any = None
        self._next_tick = 0.0
        self._replay_until = 0  # stream tail when the shard was taken
        self._received = 0  # highest stream position handed to the queue
        self._generation = 0  # the NATS connection's reconnect count our consumer was made for
        self._reset_to: int | None = None  # the stream went back to here: the next fence records it
        # submissions this process committed for the shard, handed over without a NATS nudge
        self._local: deque[tuple[int, dict[str, Any] | None]] = deque()
        # the newest checkpoint barrier received and not folded yet: it goes ahead of the
        # inputs queued before it (``_on_msg``)
        self._barrier: _Input | None = None
        self._barrier_subject = natsio.events_subject(shard, natsio.KIND_BARRIER)
        self._running = False
        # the lease row's engine positions as this engine last committed them (its only
        # writer at its epoch); None: unknown, the next batch reads them with its fence
        self._positions: leases.EnginePositions | None = None

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def take_submission(self, execution_id: int, request: dict[str, Any] | None = None) -> bool:
        """A submission committed by this api process (``Submitter.nudge``): folded with the
        next batch, as a nudge from the stream would be (``request``: its row as committed,
        which the batch then need not read). False when this engine is not running (nudge
        through the stream then). Nothing depends on it: an engine that stops first leaves
        the submission to the shard's sweep (a committed request without engine state), as
        a lost nudge does."""
        if not self._running or self._stopped.is_set():
            return False
        self._local.append((execution_id, request))
        self._wake.set()
        return True

    def _on_reconnect(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        self.d.reconnects.listen(self._on_reconnect)
        self._running = True
        try:
            await self._run()
        except LeaseLost as exc:
            logger.warning("%s; stopping", exc, extra={"shard": self.shard})
        finally:
            self._running = False
            self.d.reconnects.unlisten(self._on_reconnect)
            await self._unsubscribe()

    async def _run(self) -> None:
        self._generation = self.d.reconnects.generation
        start = await self._takeover()
        await self._subscribe(start)
        if self._reset_to is not None:
            await self._run_batch([], self._reset_to)  # record the reset now, not at the next input
        while not self._stopped.is_set():
            faults.check("engine.loop", self.shard)
            if self.d.ownership.epoch(self.shard) != self.epoch:
                raise LeaseLost(f"shard {self.shard} epoch {self.epoch} no longer trusted")
            if self.d.reconnects.generation != self._generation:
                await self._resubscribe()
            timeout = max(0.0, self._next_tick - time.monotonic())
            if self._queue.empty() and not self._local and self._barrier is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=timeout)
                self._wake.clear()
            if self._stopped.is_set():
                break
            msgs: list[tuple[int, bytes]] = []
            while not self._queue.empty() and len(msgs) < MAX_BATCH:
                msgs.append(self._queue.get_nowait())
            synthetic: list[_Input] = []
            while self._local and len(synthetic) < MAX_BATCH:
                eid, request = self._local.popleft()
                synthetic.append(_Input("submitted", eid, request=request))
            if self._barrier is not None:
                synthetic.append(self._barrier)
                self._barrier = None
            if time.monotonic() >= self._next_tick:
                # to the next interval boundary: the shard engines of the process sweep
                # together, and their first reads are one (``sweep_rounds``)
                self._next_tick = time.monotonic() + to_boundary(self.d.executions.sweep_interval_sec)
                synthetic += await self._tick_inputs()
            if msgs or synthetic:
                await self._consume(msgs, synthetic)

    async def _on_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self._received:
            return  # delivered again by a consumer re-created after a reconnect
        self._received = seq
        barrier = _decode(msg.data, seq) if msg.subject == self._barrier_subject else None
        if barrier is not None and barrier.kind == "barrier":
            # A checkpoint barrier goes ahead of the backlog: folded by the next batch, not
            # behind the inputs queued before it (seed 004's checkpoint age, p99 <= 1.5 s,
            # counts that wait). Any point of the log is a consistent cut, so the barrier
            # need not keep its stream place. It is folded as a synthetic input (seq 0): the
            # stream position a batch records never counts it. Lost with this process, it is
            # delivered again unless a position past it was recorded first (a batch split
            # around a poison input); then the checkpointer asks again (a barrier not
            # appended within five intervals). One folded already is dropped by its epoch.
            if self._barrier is None or barrier.msg.checkpoint_epoch > self._barrier.msg.checkpoint_epoch:
                barrier.seq = 0
                self._barrier = barrier
            self._wake.set()
            return
        await self._queue.put((seq, msg.data))  # waits while the queue is full (backpressure)
        self._wake.set()

    # ------------------------------------------------------------ the stream

    async def _stream_last_seq(self) -> int:
        try:
            return int((await self.d.js.stream_info(natsio.EVENTS_STREAM)).state.last_seq)
        except Exception as exc:
            raise natsio.translate(exc) from exc

    async def _subscribe(self, start: int) -> None:
        try:
            self._sub = await self.d.js.subscribe(
                natsio.events_filter(self.shard), ordered_consumer=True, cb=self._on_msg,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
            )
        except Exception as exc:
            raise natsio.translate(exc) from exc
        self._received = max(self._received, start - 1)

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _resubscribe(self) -> None:
        """After a NATS reconnect: a new consumer from the next position we have not seen
        (at once: the ordered consumer would notice only after two missed heartbeats). If
        the stream is now behind what we already received, the server lost acknowledged
        messages (or the stream was recreated): resume at its end and recover."""
        generation = self.d.reconnects.generation
        await self._unsubscribe()
        try:
            last = await self._stream_last_seq()
        except NoetlError as exc:
            logger.warning("engine shard %s: stream not readable after a reconnect (%s); retrying", self.shard, exc)
            await asyncio.sleep(0.2)
            return
        start = self._received + 1
        if last < self._received:
            start = await self._stream_went_back(last, self._received)
        await self._subscribe(start)
        self._generation = generation
        RESUBSCRIBES.labels(str(self.shard))
        FORGED.labels(str(self.shard)).inc()
        logger.info("engine shard %s consuming again from stream position %s", self.shard, start)
        if self._reset_to is not None:
            await self._run_batch([], self._reset_to)

    async def _stream_went_back(self, last: int, ours: int) -> int:
        """The events stream ends at ``last`` but we had recorded or received ``ours``:
        messages after ``last`` are gone from the stream (a server that lost its unsynced
        writes, a recreated stream). Drop what the queue holds beyond ``last`` (its senders
        re-send what matters: workers republish results the stream lost, the sweeps find
        submissions and cancellations in Postgres, the reaper re-reports expiries),
        republish the shard's queued commands (their notices may be gone too) and resume
        at ``last + 1``."""
        STREAM_RESETS.labels(str(self.shard)).inc()
        logger.error("engine shard %s: the events stream ends at %s, behind position %s we already had: messages"
                     " were lost or the stream was recreated; resuming at its end", self.shard, last, ours)
        kept = [m for m in _drain(self._queue) if m[0] <= last]
        for m in kept:
            self._queue.put_nowait(m)
        self._received = last
        self._reset_to = last
        self._cache.clear()
        self._positions = None
        async with self.d.pool.connection() as conn:
            queued = await commands_db.queued_commands(conn, self.shard)
            await conn.commit()
        if queued:
            REPUBLISHED.inc(len(queued))
            await self._publish([_queued(q) for q in queued])
        return last + 1

    # ------------------------------------------------------------ takeover and ticks

    async def _takeover(self) -> int:
        """Load what a new owner needs, republish the shard's queued commands, and return
        the stream position to consume from."""
        async with self.d.pool.connection() as conn:
            row = await leases.held_positions(conn, ROLE, self.shard, self.d.ownership.runtime_id, self.epoch)
            if row is None:
                raise LeaseLost(f"shard {self.shard} epoch {self.epoch} is not ours")
            queued = await commands_db.queued_commands(conn, self.shard)
            await self.d.traces.load(conn, {q["execution_id"] for q in queued}, {})
            await conn.commit()
        REPLAYED.labels(str(self.shard))  # the series exists (0) from the takeover on
        DEAD_LETTERS.labels(str(self.shard))
        for reason in ("failed", "expired"):
            DEAD_LETTERED.labels(str(self.shard), reason)
        for outcome in ("redriven", "refused"):
            REDRIVES.labels(str(self.shard), outcome)
        QUARANTINED.labels(str(self.shard))
        limits.QUEUED.labels(str(self.shard))
        STREAM_RESETS.labels(str(self.shard))
        RESUBSCRIBES.labels(str(self.shard))
        FORGED.labels(str(self.shard))
        stream_seq = int(row["stream_seq"])
        last = await self._stream_last_seq()
        self._replay_until = last
        self._received = stream_seq
        start = stream_seq + 1
        if last < stream_seq:
            start = await self._stream_went_back(last, stream_seq)
        elif queued:
            REPUBLISHED.inc(len(queued))
            await self._publish([_queued(q) for q in queued])
        logger.info("engine took shard %s epoch %s at stream_seq %s event_seq %s (republished %s)",
                    self.shard, self.epoch, stream_seq, row["event_seq"], len(queued))
        return start

    async def _tick_inputs(self) -> list[_Input]:
        """Sweep inputs: committed submissions never started (a lost nudge), executions
        past their deadline, cancellations and redrives committed but not applied. A failed sweep is
        logged and tried again next tick. A shard the shared read (``sweep_rounds``)
        finds nothing for is not swept."""
        try:
            if not await self.d.sweeps.get(self.shard):
                return []
        except Exception as exc:  # the sweep itself then finds out (and logs what fails)
            logger.debug("engine shard %s: sweep candidates not read (%s); sweeping", self.shard, exc)
        try:
            async with self.d.pool.connection() as conn:
                after = await leases.sweep_from(conn, ROLE, self.shard)
                starts = await requests_db.unstarted(conn, self.shard, after, 200)
                starts += [eid for eid, _ in await limits_db.heads(conn, shard=self.shard, limit=200)]
                late = await engine_state_db.overdue(conn, self.shard, 200)
                cancels = await requests_db.pending_cancels(conn, self.shard, 200)
                redrives = await requests_db.pending_redrive_executions(conn, self.shard, 200)
                await conn.commit()
        except Exception as exc:
            if is_transient(exc):
                logger.warning("engine shard %s: sweep failed (%s); next tick", self.shard, exc)
            else:
                logger.exception("engine shard %s: sweep failed; next tick", self.shard)
            return []
        return ([_Input("submitted", e) for e in starts] + [_Input("timeout", e) for e in late]
                + [_Input("cancel", c["execution_id"], messages_pb2.CancelRequested(
                    execution_id=c["execution_id"], reason=c["reason"])) for c in cancels]
                + [_Input("redrive", e) for e in redrives])

    # ------------------------------------------------------------ the batch

    async def _consume(self, msgs: list[tuple[int, bytes]], synthetic: list[_Input]) -> None:
        last_stream_seq = max((q for q, _ in msgs), default=0)
        if self._replay_until:
            replayed = sum(1 for q, _ in msgs if q <= self._replay_until)
            if replayed:
                REPLAYED.labels(str(self.shard)).inc(replayed)
            if last_stream_seq >= self._replay_until:
                self._replay_until = 0
        # an undecodable message stays in its place (order matters for the recorded stream
        # position) and is quarantined by the batch that holds it
        inputs = [_decode(data, q) or _Input(UNDECODABLE, 0, seq=q, data=data) for q, data in msgs]
        inputs += synthetic
        await self._run_batch(inputs, last_stream_seq)

    async def _run_batch(self, inputs: list[_Input], last_stream_seq: int) -> None:
        """Fold ``inputs`` in one transaction. An outage (``retry.is_transient``) is waited
        out: the same batch again, with capped backoff, for as long as the lease is ours.
        Any other failure is a poison somewhere in the batch: it is split in halves (order
        kept) until the failing input is alone; an input that fails POISON_ATTEMPTS times
        alone is quarantined and the rest of the shard goes on."""
        delay = 0.1
        failures = 0
        while True:
            try:
                await self._process(inputs, last_stream_seq)
                return
            except LeaseLost:
                raise
            except Exception as exc:
                self._cache.clear()
                self._positions = None
                if is_transient(exc):
                    logger.warning("engine batch failed on shard %s (%s); retrying in %.1fs", self.shard, exc, delay)
                else:
                    failures += 1
                    logger.exception("engine batch of %d input(s) failed on shard %s (%d time(s))", len(inputs),
                                     self.shard, failures)
                    if len(inputs) > 1:
                        mid = len(inputs) // 2
                        await self._run_batch(inputs[:mid], max((i.seq for i in inputs[:mid]), default=0))
                        await self._run_batch(inputs[mid:], last_stream_seq)
                        return
                    if inputs and failures >= POISON_ATTEMPTS:
                        await self._quarantine(_Quarantined(inputs[0], failures, f"{type(exc).__name__}: {exc}"),
                                               last_stream_seq)
                        return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            if self.d.ownership.epoch(self.shard) != self.epoch:
                raise LeaseLost(f"shard {self.shard} lost while retrying a batch")

    async def _quarantine(self, bad: _Quarantined, last_stream_seq: int) -> None:
        """Record a poison input and fail its execution in the same transaction; if failing
        the execution fails too, record the input alone."""
        inp = bad.inp
        logger.error("quarantining %s input of execution %s on shard %s after %d failed attempt(s): %s",
                     inp.kind, inp.execution_id, self.shard, bad.attempts, bad.error)
        abort = _Input("abort", inp.execution_id, msg=f"ENGINE_INPUT_QUARANTINED: the engine could not process"
                       f" the execution's {inp.kind} input ({bad.error}); it was quarantined")
        try:
            await self._transient_retry(lambda: self._process([abort], last_stream_seq, quarantine=[bad]))
        except LeaseLost:
            raise
        except Exception:
            logger.exception("failing execution %s after quarantining its input failed too; recording the"
                             " quarantine alone", inp.execution_id)
            await self._record_quarantine(bad, last_stream_seq)

    async def _record_quarantine(self, bad: _Quarantined, last_stream_seq: int) -> None:
        await self._transient_retry(lambda: self._process([], last_stream_seq, quarantine=[bad]))

    async def _transient_retry(self, work: Any) -> None:
        """``await work()``, retried while it fails for an outage (and the lease is ours)."""
        delay = 0.1
        while True:
            try:
                await work()
                return
            except Exception as exc:
                self._cache.clear()
                self._positions = None
                if isinstance(exc, LeaseLost) or not is_transient(exc):
                    raise
                logger.warning("engine shard %s: %s; retrying in %.1fs", self.shard, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            if self.d.ownership.epoch(self.shard) != self.epoch:
                raise LeaseLost(f"shard {self.shard} lost while retrying")

    async def _process(self, inputs: list[_Input], last_stream_seq: int,
                       quarantine: list[_Quarantined] | None = None) -> None:
        started = time.perf_counter()
        reset = self._reset_to is not None
        if self._reset_to is not None:
            last_stream_seq = max(last_stream_seq, self._reset_to)
        # one redrive input per execution and batch (a nudge and a sweep may both bring it)
        inputs = [i for n, i in enumerate(inputs) if i.kind != "redrive"
                  or not any(j.kind == "redrive" and j.execution_id == i.execution_id for j in inputs[:n])]
        quarantine = [*(quarantine or ()), *(_Quarantined(i, 1, "not a decodable EngineInput message")
                                             for i in inputs if i.kind == UNDECODABLE)]
        inputs = [i for i in inputs if i.kind != UNDECODABLE]
        ids = {i.execution_id for i in inputs if i.kind != "barrier"}
        states: dict[int, ExecState] = {e: self._cache[e] for e in ids if e in self._cache}
        need_requests = [e for e in ids if e not in states or e not in self.d.workloads
                         or e not in self.d.priorities or e not in self.d.workload_refs]
        # submissions this api handed over with their rows, not seen here before: started
        # without reading anything (their one statement checks that they have no state)
        fresh = {i.execution_id: i.request for i in inputs
                 if i.kind == "submitted" and i.request is not None and i.execution_id not in states}
        batch: _Batch | None = None
        if (self._positions is not None and not reset and not quarantine
                and len(states) + len(fresh) == len(ids) and not set(need_requests) - set(fresh)):
            batch = await self._process_fast(inputs, ids, dict(states), dict(fresh), last_stream_seq,
                                             self._positions)
            if batch is None:  # folded again below, from what Postgres holds
                states = {e: self._cache[e] for e in ids if e in self._cache}
                need_requests = [e for e in ids if e not in states or e not in self.d.workloads
                                 or e not in self.d.priorities or e not in self.d.workload_refs]
        if batch is None:
            batch = await self._process_slow(inputs, ids, states, need_requests, last_stream_seq, reset,
                                             quarantine)
        # committed: the handed-off commands go first (their workers wait for them), then
        # the cache mirrors what is in Postgres now
        if batch.handoffs:
            await self._send_handoffs(batch.handoffs)
        self._positions = leases.EnginePositions(batch.seq, max(batch.sweep_from, batch.new_sweep),
                                                 batch.barrier_epoch, batch.barrier_seq)
        if reset:
            self._reset_to = None
        if quarantine:
            QUARANTINED.labels(str(self.shard)).inc(len(quarantine))
        for eid, (state, _) in batch.touched.items():
            if state.terminal:
                self._cache.pop(eid, None)
                self.d.workloads.pop(eid, None)
                self.d.priorities.pop(eid, None)
                self.d.workload_refs.pop(eid, None)
            else:
                self._cache[eid] = state
                self._cache.move_to_end(eid)
        while len(self._cache) > 10_000:
            self._cache.popitem(last=False)
        while len(self.d.priorities) > 20_000:
            self.d.priorities.popitem(last=False)
        while len(self.d.workload_refs) > 20_000:
            self.d.workload_refs.popitem(last=False)
        for offer in batch.unused:  # (kept only now: a batch that failed is folded again)
            self.d.offers.keep(offer)
        if batch.publish:
            await self._publish(batch.publish)
        cancelled = [u.command_id for u in batch.updates if u.status == CommandStatus.CANCELLED]
        if cancelled:  # a hint: running tasks stop now rather than at their next lease renewal
            await natsio.hint(self.d.nc, natsio.cancel_subject(self.shard),
                              json.dumps({"command_ids": cancelled}).encode())
        if batch.ended:
            await self._nudge_children(batch.ended)
        if batch.finished and self.d.concurrency.any:
            await self._nudge_waiters()
        events = batch.events
        if events:
            self.d.traces.committed(events)
            if dead := sum(1 for e in events if e.event_type == EventType.COMMAND_DEAD_LETTERED):
                DEAD_LETTERS.labels(str(self.shard)).inc(dead)
            BATCH_EVENTS.labels(str(self.shard)).inc(len(events))
            # an execution that ended, or a barrier, is projected at once; the rest within
            # the projector's batch window
            urgent = batch.finished or any(e.event_type == EventType.CHECKPOINT_COMMITTED for e in events)
            await natsio.hint(self.d.nc, natsio.projector_subject(self.shard), natsio.PROJECT_NOW if urgent else b"")
        for _eid, d in batch.dead_letters:
            DEAD_LETTERED.labels(str(self.shard), d.reason).inc()
        for dl, new_id, why, _who in batch.redrives:
            REDRIVES.labels(str(self.shard), "redriven" if new_id else "refused").inc()
            logger.info("redrive of dead letter %s on shard %s: %s", dl, self.shard,
                        f"re-issued as {new_id}" if new_id else f"refused: {why}")
        BATCH_INPUTS.observe(len(inputs))
        BATCH_SECONDS.observe(time.perf_counter() - started)

    async def _process_slow(self, inputs: list[_Input], ids: set[int], states: dict[int, ExecState],
                            need_requests: list[int], last_stream_seq: int, reset: bool,
                            quarantine: list[_Quarantined]) -> _Batch:
        """The batch in one pipelined transaction: the fence and the reads in one round trip,
        every write and the COMMIT in a second."""
        async with pipelined_transaction(self.d.pool) as conn:
            fence = await leases.send_fence(conn, ROLE, self.shard, self.d.ownership.runtime_id, self.epoch,
                                            stream_seq=last_stream_seq, reset=reset)
            sent_states = await engine_state_db.send_load_states(conn, [e for e in ids if e not in states])
            sent_requests = await requests_db.send_load_requests(conn, need_requests)
            lease = await leases.fenced(fence, ROLE, self.shard, self.epoch)
            states.update(await engine_state_db.loaded_states(sent_states))
            requests = await requests_db.loaded_requests(sent_requests)
            for e, req in requests.items():
                self.d.priorities[e] = req.get("priority") or ""
                self.d.workload_refs[e] = req.get("workload_ref_id")
            await self.d.traces.load(conn, ids, requests)
            batch = _Batch(int(lease["event_seq"]), int(lease["sweep_from"]), int(lease["barrier_epoch"]),
                           int(lease["barrier_seq"]))
            await self._fold(inputs, states, requests, conn, batch)
            if batch.finished:
                # always (two pipelined DELETEs, no round trip): slots and queue places of a
                # limit must go even when this replica's cached view says there is none
                await limits_db.release(conn, batch.finished)
                await self.d.concurrency.refresh(conn)  # at most once a second: whom to nudge
            # every write of the batch, then the COMMIT, in one round trip
            await events_db.append_events(conn, batch.events)
            await engine_state_db.save_states(conn, self.shard, batch.state_rows())
            await commands_db.insert_commands(conn, self.shard, batch.new_commands, self.d.commands.lease_sec)
            await loops_db.clear_loop_results(conn, batch.cleared)
            await loops_db.store_loop_results(conn, batch.loop_results)
            await dead_letters_db.insert_dead_letters(conn, self.shard, batch.dead_letters)
            await dead_letters_db.record_redrives(conn, batch.redrives)
            await requests_db.applied_redrives(conn, [r.dead_letter_id for r in batch.redrives])
            await commands_db.update_commands(conn, batch.updates)
            await requests_db.applied_cancels(conn, sorted({i.execution_id for i in inputs if i.kind == "cancel"}))
            await requests_db.cascade_cancels(conn, batch.ended)
            for bad in quarantine:
                await events_db.quarantine(conn, self.shard, bad.inp.execution_id, bad.inp.kind, bad.inp.seq or None,
                                     bad.attempts, bad.error, bad.inp.data)
            await leases.finish_engine_batch(conn, ROLE, self.shard, batch.seq, batch.new_sweep, batch.barrier_epoch,
                                             batch.barrier_seq)
            await leases.assert_lease(conn, ROLE, self.shard, self.d.ownership.runtime_id, self.epoch)
        return batch

    async def _process_fast(self, inputs: list[_Input], ids: set[int], states: dict[int, ExecState],
                            fresh: dict[int, dict[str, Any]], last_stream_seq: int,
                            positions: leases.EnginePositions) -> _Batch | None:
        """The batch as ONE statement (``leases.fenced_batch``), when it reads nothing: every
        execution's state and request at hand, the lease's positions as this engine last
        committed them, and a fold that never needs the connection. The common batch, a
        worker's result of a running execution, is then one round trip instead of two, and
        none of a transaction's BEGIN, COMMIT and pipeline syncs (about a third of the
        client CPU of the batch, measured). None when the batch must take the transaction
        after all (its fold needed the connection, its writes depend on each other, or the
        fence, or the check that the executions it starts have no state, did not match):
        nothing was written, the executions' states are dropped from
        the cache (the fold changes them in place) and the kept offers it took given back."""
        batch = _Batch(*positions)
        try:
            for e, req in fresh.items():
                self.d.priorities[e] = req.get("priority") or ""
                self.d.workload_refs[e] = req.get("workload_ref_id")
            if fresh and self.d.concurrency.due:  # admission's view of the limits, read beside the batch
                async with autocommit(self.d.pool) as conn:
                    await self.d.concurrency.refresh(conn)
            await self.d.traces.load(_NO_CONNECTION, ids, fresh)
            await self._fold(inputs, states, fresh, _NO_CONNECTION, batch)
            writes = self._fast_writes(inputs, batch)
            if writes is not None:
                if batch.finished and self.d.concurrency.due:  # whom to nudge: read beside the batch
                    async with autocommit(self.d.pool) as conn:
                        await self.d.concurrency.refresh(conn)
                started = [e for e in fresh if e in batch.touched]
                async with autocommit(self.d.pool) as conn:
                    if await leases.fenced_batch(conn, ROLE, self.shard, self.d.ownership.runtime_id, self.epoch,
                                                 event_seq=positions.event_seq, stream_seq=last_stream_seq,
                                                 positions=leases.EnginePositions(
                                                     batch.seq, batch.new_sweep, batch.barrier_epoch,
                                                     batch.barrier_seq),
                                                 writes=writes,
                                                 checks=[engine_state_db.unstarted_gate(started)] if started else []):
                        FAST_BATCHES.labels(str(self.shard), "one statement").inc()
                        return batch
                # a gate did not match (the fence: the transaction says why; an execution it
                # started had state after all: the transaction reads it)
                self._positions = None
                FAST_BATCHES.labels(str(self.shard), "gate missed").inc()
            else:
                FAST_BATCHES.labels(str(self.shard), "dependent writes").inc()
        except _NeedsTransaction:
            FAST_BATCHES.labels(str(self.shard), "needs reads").inc()
        except BaseException:
            self._unfold(ids, batch)
            raise
        self._unfold(ids, batch)
        return None

    def _unfold(self, ids: set[int], batch: _Batch) -> None:
        """Forget what a fold that did not commit changed here: the executions' cached
        states (changed in place) and the kept offers it took."""
        for e in ids:
            self._cache.pop(e, None)
        for offer in batch.taken:
            self.d.offers.keep(offer)
        batch.taken.clear()

    def _fast_writes(self, inputs: list[_Input], batch: _Batch) -> list[Write] | None:
        """The batch's writes as independent statements of one (``leases.fenced_batch``), or
        None when it needs the transaction: a statement that must see another's rows (an
        update of a command inserted in the same batch, results cleared and stored again),
        or one of the rarer writes (dead letters, redrives, cancellations and their
        cascades), which keep their own statements there."""
        if (batch.cleared or batch.dead_letters or batch.redrives or batch.ended
                or any(i.kind == "cancel" for i in inputs)):
            return None
        inserted = {q.command.command_id for q in batch.new_commands}
        if any(u.command_id in inserted for u in batch.updates):
            return None
        writes = [events_db.append_events_write(batch.events),
                  engine_state_db.save_states_write(self.shard, batch.state_rows()),
                  commands_db.insert_commands_write(self.shard, batch.new_commands, self.d.commands.lease_sec),
                  loops_db.store_loop_results_write(batch.loop_results),
                  commands_db.update_commands_write(batch.updates),
                  *limits_db.release_writes(batch.finished)]
        return [w for w in writes if w is not None]

    async def _fold(self, inputs: list[_Input], states: dict[int, ExecState], requests: dict[int, dict[str, Any]],
                    conn: Any, batch: _Batch) -> None:
        """Fold ``inputs`` into ``batch`` (events numbered from its ``seq``): the
        transitions, their events, commands and writes. ``conn`` is the batch's
        transaction (``_NO_CONNECTION`` on the one-statement path)."""
        for inp in inputs:
            if inp.kind == "barrier":
                epoch = int(inp.msg.checkpoint_epoch)
                if epoch > batch.barrier_epoch:  # exactly once per epoch; stale or repeated barriers are dropped
                    batch.seq += 1
                    batch.barrier_epoch, batch.barrier_seq = epoch, batch.seq
                    batch.events.append(EventRow(barrier_execution_id(epoch, self.shard), self.shard, batch.seq,
                                                 EventType.CHECKPOINT_COMMITTED, None, None, None,
                                                 json.dumps({"checkpoint_epoch": epoch, "epoch_id": epoch,
                                                             "lease_epoch": self.epoch})))
                continue
            t = await self.d.traces.fold(inp, self.shard, self._apply(inp, states, requests, conn, batch.loop_results))
            batch.redrives.extend(RedriveOutcome(dl, cid, why, inp.requested_by.get(dl, ""))
                                  for dl, cid, why in inp.refused)
            if t is None:
                continue
            eid = t.state.execution_id
            states[eid] = t.state
            offer = self._offer(inp)
            for instance, items in t.loop_items:
                await loops_db.store_loop_items(conn, eid, instance, items)
            for source, source_instance, instance in t.loop_copies:
                await loops_db.copy_loop(conn, source, source_instance, eid, instance)
            for _instance, step_name, envelope in t.loop_refs:  # before the events are serialised
                envelope["reference"]["ref_id"] = await noetl_store.loop_reference(
                    conn, eid, step_name, envelope["reference"]["uri"], envelope["context"])
            batch.loop_results.extend(IterationResult(eid, *r) for r in t.loop_results)
            batch.dead_letters.extend((eid, d) for d in t.dead_letters)
            batch.cleared.extend(IterationKey(eid, *c) for c in t.loop_results_cleared)
            batch.redrives.extend(RedriveOutcome(dl, cid, why, inp.requested_by.get(dl, ""))
                                  for dl, cid, why in t.redrive_outcomes)
            for ev in t.events:
                batch.seq += 1
                meta = {**ev.meta, "epoch_id": batch.barrier_epoch, "lease_epoch": self.epoch}
                batch.events.append(EventRow(eid, self.shard, batch.seq, ev.event_type, ev.step, ev.command_id,
                                             json.dumps(ev.result) if ev.result is not None else None,
                                             json.dumps(meta)))
            batch.touched[eid] = (t.state, batch.seq)
            if t.commands or t.republish:
                placements = (await self.d.catalog.compiled(t.state.catalog_id)).placements
                submitted = self.d.priorities.get(eid) or None
                for c in t.commands:
                    placed = place(placements, c.step, submitted)
                    handed, offer = await self._hand(offer, eid, t.state.catalog_id, c, placed, taken=batch.taken)
                    if handed is not None:  # inserted claimed by the worker, sent after the commit
                        worker, data = handed
                        batch.handoffs.append((worker, eid, data))
                        batch.new_commands.append(QueuedCommand(eid, t.state.catalog_id, c, placed, worker))
                        continue
                    batch.new_commands.append(QueuedCommand(eid, t.state.catalog_id, c, placed))
                    batch.publish.append((c.command_id, eid, c.attempt, c.kind, placed))
                for cid, attempt, kind in t.republish:
                    pending = t.state.pending.get(cid)
                    batch.publish.append((cid, eid, attempt, kind, place(placements, pending.step if pending else "",
                                                                         submitted)))
            batch.updates.extend(t.updates)
            if offer is not None:  # none of its own result's commands took it
                batch.unused.append(offer)
        started_ids = [e for e in requests if e in batch.touched]
        horizon = snowflake_at(int((time.time() - 60) * 1000))
        batch.new_sweep = min(max(started_ids, default=batch.sweep_from), horizon)
        batch.ended = [eid for eid, (state, _) in batch.touched.items() if state.status == EngineStatus.CANCELLED]
        batch.finished = [eid for eid, (state, _) in batch.touched.items() if state.terminal]

    async def _apply(self, inp: _Input, states: dict[int, ExecState], requests: dict[int, dict[str, Any]],
                     conn: Any, batch_loop_results: list[IterationResult]
                     ) -> Transition | None:
        eid = inp.execution_id
        if inp.kind != "abort":
            faults.check("engine.input", eid)
        state = states.get(eid)
        if inp.kind in ("submitted", "cancel") and state is None:
            req = requests.get(eid)
            if req is None:
                logger.warning("input %s for unknown execution %s ignored", inp.kind, eid)
                return None
            compiled = await self.d.catalog.compiled(req["catalog_id"])
            workload = self._workload(eid, req, compiled.playbook)
            if inp.kind == "submitted" and not await self.d.concurrency.admit(conn, self.shard, eid, req["path"],
                                                                               workload, queued=inp.request is None):
                return None  # queued by a concurrency limit: started when a slot frees (limits.py)
            deadline = req["requested_at"] + timedelta(seconds=float(req["timeout_sec"]))
            start = StartInput(eid, self.shard, req["catalog_id"], int(deadline.timestamp() * 1000),
                               req["parent_execution_id"] or 0,
                               meta={"catalog_id": req["catalog_id"], "path": req["path"],
                                     "version": req["version"],
                                     "parent_execution_id": req["parent_execution_id"],
                                     "requested_at": req["requested_at"].isoformat()})
            if req.get("rerun_of"):
                t = await self._rerun(start, req, compiled.flow, workload, conn)
            else:
                t = compiled.flow.start(start, workload)
            if inp.kind == "cancel":
                t2 = compiled.flow.on_cancel(t.state, inp.msg.reason)
                _merge(t, t2)
            return t
        if inp.kind == "redrive":
            return await self._redrive(inp, state, conn, requests)
        if state is None:
            logger.warning("input %s for execution %s with no engine state ignored", inp.kind, eid)
            return None
        if inp.kind == "submitted":
            return None  # already started: a duplicate nudge or a sweep race
        compiled = await self.d.catalog.compiled(state.catalog_id)
        flow = compiled.flow
        if inp.kind == "call_result":
            r = inp.msg
            if self.d.claim_key and not auth.claim_token_valid(self.d.claim_key, r.claim_token, r.command_id,
                                                                r.attempt, r.worker_id):
                FORGED.labels(str(self.shard)).inc()
                logger.warning("result for %s attempt %s from %r without a valid claim token ignored",
                               r.command_id, r.attempt, r.worker_id)
                return None
            envelope = envelope_from_proto(r.envelope)
            res = CallResultInput(r.command_id, r.attempt, envelope,
                                  json.loads(r.set_json) if r.set_json else {}, r.worker_id,
                                  tuple(IterationOutcome(it.index, envelope_from_proto(it.envelope),
                                                         json.loads(it.set_json) if it.set_json else {})
                                        for it in r.iterations))
            workload = await self._workload_for(state, requests)
            values = await self._values(flow.needs(state, res), conn, eid, batch_loop_results)
            return flow.on_result(state, res, workload, values)
        if inp.kind == "cancel":
            return flow.on_cancel(state, inp.msg.reason)
        if inp.kind == "expired":
            m = inp.msg
            return flow.on_expired(state, m.command_id, m.attempt, self.d.commands.max_attempts,
                                   m.reason or "claim lease expired")
        if inp.kind == "timeout":
            return flow.on_timeout(state, int(time.time() * 1000))
        if inp.kind == "abort":
            return flow.on_abort(state, str(inp.msg))
        return None

    async def _rerun(self, start: StartInput, req: dict[str, Any], flow: Flow, workload: dict[str, Any],
                     conn: Any) -> Transition:
        """The first transition of a rerun (noetl_flow.rerun): the original's terminal engine
        state, the successful iterations of its loops to resume and the results the first
        templates read, all from Postgres. If the original can no longer be rerun (RerunExecution
        checked it; this is a second look at what is durable), the rerun fails at once naming why."""
        original_id = int(req["rerun_of"])
        meta = {"rerun_of": original_id}
        original = (await engine_state_db.load_states(conn, [original_id])).get(original_id)
        if original is None:
            return flow.refuse(start, f"RERUN_REFUSED: execution {original_id} has no engine state to rerun from", meta)
        try:
            plan = rerun.plan(flow, original, req.get("rerun_from") or "")
        except rerun.RerunRefused as exc:
            return flow.refuse(start, f"RERUN_REFUSED: {exc}", meta)
        todo: dict[str, tuple[int, list[list[int]]]] = {}
        for name, lr in plan.resume.items():
            ok = await loops_db.ok_ranges(conn, original_id, lr.instance)
            todo[name] = (sum(end - begin for begin, end in ok), rerun.todo_ranges(lr.total, ok))
        refs = rerun.needs(flow, original, plan, {name: ranges for name, (_, ranges) in todo.items()})
        values = await self._values(refs, conn, start.execution_id, []) if refs else {}
        return flow.rerun(start, original, plan, workload, values, todo)

    async def _redrive(self, inp: _Input, state: ExecState | None, conn: Any,
                       requests: dict[int, dict[str, Any]]) -> Transition | None:
        """Apply the execution's committed redrive requests (docs/ARCHITECTURE.md "Dead
        letters"): each dead letter is re-issued, or its refusal recorded; the requests are
        deleted in this batch either way."""
        eid = inp.execution_id
        inp.refused = []  # a batch retried after a failure folds its inputs again
        compacted = await requests_db.lock_for_redrive(conn, eid)
        rows = await requests_db.redrive_requests(conn, eid)
        if not rows:
            return None  # applied already (a nudge and a sweep)
        inp.requested_by = {int(r["dead_letter_id"]): r["requested_by"] for r in rows}
        items = [RedriveItem(int(r["dead_letter_id"]), r["command_id"], r["step"], r["reason"], r["loop_instance"],
                             r["loop_index"], r["status"], r["redrive_command_id"]) for r in rows]
        if compacted or state is None:
            for item in items:
                why = (f"execution {eid} was compacted (its events are gone, past NOETL_RETENTION_DAYS)" if compacted
                       else refusal(None, item))
                inp.refused.append((item.dead_letter_id, None, why))
            return None
        req = requests.get(eid) or (await requests_db.load_requests(conn, [eid])).get(eid)
        deadline_ms = int((time.time() + float(req["timeout_sec"])) * 1000) if req else None
        flow = (await self.d.catalog.compiled(state.catalog_id)).flow
        return flow.on_redrive(state, items, deadline_ms)

    async def _values(self, refs: dict[str, dict[str, Any] | None], conn: Any, eid: int,
                      batch_loop_results: list[IterationResult]) -> dict[str, Any]:
        plain = {name: ref for name, ref in refs.items() if not (ref and "loop" in ref)}
        ids = {name: int(ref["ref_id"]) for name, ref in plain.items() if ref and ref.get("ref_id")}
        found = await self.d.results.get_many(list(ids.values())) if ids else {}
        values = {name: found.get(ids[name]) if name in ids else None for name in plain}
        for name, ref in refs.items():
            if ref and "loop" in ref:
                values[name] = await self._loop_value(conn, eid, ref, batch_loop_results)
        return values

    async def _loop_value(self, conn: Any, eid: int, need: dict[str, Any],
                          batch_loop_results: list[IterationResult]) -> dict[str, Any]:
        """The value of a loop finishing in this batch: every stored iteration result (the
        batch's own, not yet written, are flushed first) plus the finishing one."""
        loop = need["loop"]
        await loops_db.store_loop_results(conn, batch_loop_results)
        batch_loop_results.clear()
        rows = await loops_db.loop_results(conn, eid, loop["instance"])
        for index, ref in loop["results"]:
            rows[int(index)] = (ref or {}).get("ref_id")
        ids = [r for r in rows.values() if r]
        found = await self.d.results.get_many(ids) if ids else {}
        results = [found.get(ref_id) if (ref_id := rows[i]) else None for i in sorted(rows)]
        return {"results": results, "stats": need["stats"]}

    def _workload(self, eid: int, req: dict[str, Any], playbook: Any) -> dict[str, Any]:
        cached = self.d.workloads.get(eid)
        if cached is None:
            cached = merged_workload(playbook, req["payload"] or {})
            self.d.workloads[eid] = cached
            while len(self.d.workloads) > 10_000:
                self.d.workloads.popitem(last=False)
        return cached

    async def _workload_for(self, state: ExecState, requests: dict[int, dict[str, Any]]) -> dict[str, Any]:
        cached = self.d.workloads.get(state.execution_id)
        if cached is not None:
            return cached
        req = requests.get(state.execution_id)
        if req is None:
            async with self.d.pool.connection() as conn:
                req = (await requests_db.load_requests(conn, [state.execution_id])).get(state.execution_id)
        if req is None:
            return {}
        compiled = await self.d.catalog.compiled(state.catalog_id)
        return self._workload(state.execution_id, req, compiled.playbook)

    async def _nudge_waiters(self) -> None:
        """Slots were freed: nudge the shards of the executions that may start now (a
        lost nudge costs their shard's next sweep)."""
        try:
            async with self.d.pool.connection() as conn:
                heads = await limits_db.heads(conn, shard=None, limit=200)
                await conn.commit()
            for eid, shard in heads:
                msg = messages_pb2.EngineInput(submitted=messages_pb2.ExecutionSubmitted(execution_id=eid))
                # no Msg-Id: the submission's own nudge (``submit#id``) is still in the
                # duplicate window of a recent one
                await natsio.publish(self.d.js, natsio.events_subject(shard, natsio.KIND_SUBMIT),
                                     msg.SerializeToString())
        except Exception as exc:  # nudges: the sweeps start them anyway
            logger.warning("engine shard %s: waiting executions not nudged (%s); their sweeps will", self.shard, exc)

    async def _nudge_children(self, parents: list[int]) -> None:
        """The batch committed the cancellation of the sub-playbooks of ``parents``
        (``noetl.cancel_request``); nudge their shards' engines so they apply it now
        rather than at their next sweep."""
        try:
            async with self.d.pool.connection() as conn:
                children = await requests_db.children(conn, parents)
                await conn.commit()
        except Exception as exc:  # a nudge: the children's sweeps apply the committed cancels anyway
            logger.warning("cancel nudges for the children of %s not sent: %s", parents, exc)
            return
        for child in children:
            msg = messages_pb2.EngineInput(cancel=messages_pb2.CancelRequested(
                execution_id=child["execution_id"], reason="parent execution cancelled"))
            try:
                await natsio.publish(self.d.js, natsio.events_subject(child["shard_id"], natsio.KIND_CANCEL),
                                     msg.SerializeToString(), msg_id=cancel_msg_id(child["execution_id"]))
            except NoetlError as exc:
                logger.warning("cancel nudge of child execution %s not published: %s", child["execution_id"], exc)

    def _offer(self, inp: _Input) -> Offer | None:
        """The worker's offer to take the command its result leads to (see ``_hand``)."""
        if inp.kind != "call_result" or self.d.claims is None or not self.d.commands.handoff:
            return None
        return Offer.of(inp.msg)

    async def _hand(self, offer: Offer | None, eid: int, catalog_id: int, c: NewCommand,
                    placed: Placed, taken: list[Offer] | None = None,
                    ) -> tuple[tuple[str, bytes] | None, Offer | None]:
        """Hand ``c`` to the worker of ``offer`` (the offer of the result that led to it),
        else to that of a kept offer (``OfferBook``), if either qualifies for it: the
        worker and ``c`` as its claim would give it to that worker (a serialised
        ``Command``), and the offer left for the next command (None once used). Not
        handed off: a loop's iteration (its items and progress are read at claim), a
        command of an execution whose workload is not at hand, and one larger than a
        handoff may be (``handoff.MAX_HANDOFF_BYTES``, or the NATS server's payload limit;
        a claim answers it over gRPC). A command handed off is committed claimed by the
        worker (its lease running), so a handoff lost on the way costs a lease expiry and
        a re-issue, like a worker that dies holding a claim."""
        workload = self.d.workloads.get(eid)
        if (self.d.claims is None or not self.d.commands.handoff or c.context.get("loop") or workload is None
                or eid not in self.d.workload_refs):
            return None, offer
        own = offer is not None and offer.fits(placed.pool, placed.requires, c.kind)
        taker = offer if own else self.d.offers.take(placed.pool, placed.requires, c.kind)
        if taker is None:
            return None, offer
        row = {"command_id": c.command_id, "execution_id": eid, "shard_id": self.shard, "catalog_id": catalog_id,
               "step": c.step, "kind": c.kind, "attempt": c.attempt, "context": c.context,
               "timeout_sec": float(c.timeout_sec), "worker_id": taker.worker,
               "workload_ref_id": self.d.workload_refs[eid],
               "lease_until": datetime.now(UTC) + timedelta(seconds=self.d.commands.lease_sec)}
        try:
            data = (await self.d.claims.assemble(row, workload)).to_proto().SerializeToString()
        except NoetlError as exc:  # queued and claimed as usual instead (the claim says why)
            logger.debug("command %s not handed off: %s", c.command_id, exc)
            data = b""
        if not data or len(data) > min(MAX_HANDOFF_BYTES, self.d.nc.max_payload or MAX_HANDOFF_BYTES):
            if not own:
                self.d.offers.keep(taker)
            return None, offer
        if not own and taken is not None:
            taken.append(taker)  # given back if this batch is folded again (``_unfold``)
        return (taker.worker, data), None if own else offer

    async def _send_handoffs(self, items: list[tuple[str, int, bytes]]) -> None:
        """Core-NATS sends, one after another (each only queues the message for the
        client's writer: no task per send, no waiting on the network)."""
        failed: list[BaseException] = []
        for worker, eid, data in items:
            try:
                await natsio.send(self.d.nc, natsio.handoff_subject(worker), data,
                                  trace_parent=self.d.traces.notice_parent(eid))
            except Exception as exc:
                failed.append(exc)
        HANDOFFS.labels(str(self.shard)).inc(len(items) - len(failed))
        if failed:
            logger.warning("%s handed-off commands not sent (%s); each is re-issued when its claim lease expires",
                           len(failed), failed[0])

    async def _publish(self, items: list[tuple[str, int, int, str, Placed]]) -> None:
        async def one(cid: str, eid: int, attempt: int, kind: str, placed: Placed) -> None:
            notice = messages_pb2.CommandNotice(command_id=cid, execution_id=eid, shard_id=self.shard,
                                                attempt=attempt, kind=kind)
            await natsio.publish(self.d.js, natsio.commands_subject(placed.pool, placed.priority, self.shard),
                                 notice.SerializeToString(),
                                 msg_id=notice_msg_id(cid, attempt), trace_parent=self.d.traces.notice_parent(eid))

        results = await asyncio.gather(*(one(*i) for i in items), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning("%s command notices not published (%s); the reaper republishes queued commands",
                           len(failed), failed[0])


def _queued(q: dict[str, Any]) -> tuple[str, int, int, str, Placed]:
    """A queued command row as a notice to publish (on its pool's and priority's subject)."""
    return (q["command_id"], q["execution_id"], q["attempt"], q["kind"], Placed(q["pool"], None, q["priority"]))


def _decode(data: bytes, seq: int = 0) -> _Input | None:
    """The engine input a stream message carries, or None when it is not one."""
    try:
        msg = messages_pb2.EngineInput.FromString(data)
    except Exception:
        logger.warning("undecodable engine input at stream position %s", seq)
        return None
    kind = msg.WhichOneof("input")
    if kind == "submitted":
        return _Input(kind, msg.submitted.execution_id, seq=seq, data=data)
    if kind == "redrive":
        return _Input(kind, msg.redrive.execution_id, seq=seq, data=data)
    if kind in ("call_result", "cancel", "expired"):
        inner = getattr(msg, kind)
        return _Input(kind, inner.execution_id, inner, seq=seq, data=data)
    if kind == "barrier":
        return _Input(kind, 0, msg.barrier, seq=seq, data=data)
    return None


def _drain(queue: asyncio.Queue[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def _deadline(state: ExecState) -> datetime | None:
    if state.terminal or state.deadline_ms is None:
        return None
    return datetime.fromtimestamp(state.deadline_ms / 1000, tz=UTC)


def _merge(first: Transition, second: Transition) -> None:
    first.state = second.state
    for name in ("events", "commands", "updates", "republish", "loop_items", "loop_results", "loop_refs",
                 "loop_copies", "loop_results_cleared", "dead_letters", "redrive_outcomes"):
        getattr(first, name).extend(getattr(second, name))
