"""The worker role: pull command notices, claim, run, persist, report.

    NOETL_COMMANDS --fetch--> CommandNotice --ClaimCommand(s)(api)--> Command
        not claimable / not found (Conflict, NotFound): ack and drop (another worker has
            it, or it is done)
        UNAVAILABLE (or any other failure): claim again a few times (CLAIM_RETRY_SEC), then
            nak with a delay (redelivered). If the claim committed and only its answer was
            lost, claiming the same attempt again gives the command back to this worker,
            so it does not wait for its lease to expire and a re-issue
        already claimed here (a duplicate notice of an attempt this worker took): dropped
        claimed: ack, run (renewing the claim lease every lease/3 s), persist results,
                 publish EngineInput{call_result} on noetl.events.{shard}.call
                 (Msg-Id {command_id}#{attempt}#result) until JetStream acks it

Pools and priorities: the worker serves one pool or several (``NOETL_WORKER_POOL``) with
labels and tool kinds (``NOETL_WORKER_LABELS``, ``NOETL_WORKER_TOOLS``); it reads only its
pools' consumers, one per pool and priority, and every claim carries its placement, so the api hands it
only commands it qualifies for (a notice of one it does not qualify for, in a pool whose
workers differ in labels, is nak'ed with a delay for another worker: NOT_QUALIFIED).

Concurrency: ``WorkerSettings.concurrency`` slots, each taking one notice when it is free
from its pools' consumers: ``no_wait`` pull requests highest priority first, else long
pull requests on every consumer at once, withdrawn when one delivers (``notices.py``): a
worker never holds more notices than it has free slots. Claims are group-committed: the claims slots make while a
``ClaimCommands`` call is in flight go out together as the next call (one round trip
and one SQL statement for the batch, no waiting window: a lone claim goes at once, as
a plain ``ClaimCommand``). If ``RenewLease`` says stop (cancelled, or the lease is no longer ours)
the command's task is cancelled (its python child killed) and nothing is published.

Cancel hints: the engine publishes ``{"command_ids": [...]}`` on core-NATS
``noetl.cancel.{shard}`` after committing cancellations; a running command listed there
stops at once, exactly as on a lease renewal answering "cancelled" (which remains the
backstop when a hint is lost). A cancelled command also cancels the sub-playbooks it
started; a command that merely lost its lease leaves them to its next attempt.

Cursor slots (kind ``cursor``, ``cursor.py``) report each claimed row with a
``RenewLease`` carrying ``progress_json = {"row": row, "counts": {...}}`` (the slot's
counts before that row) before the claim commits.

Credentials: the worker never reads ``noetl.credential`` and holds no master key; a
command's tools get stored credentials from the api (``WorkerService.GetCredential``, for
the attempt this worker holds: ``tools/credentials.py``). The secret values a command
resolved are masked in everything it reports (``secrecy.py``) and, by a filter on this
process's log handlers, in every log line written while it runs (``noetl_common.redact``).

gRPC errors: the api's stubs are ``grpcclient.translating`` ones, so every call here
raises the project's errors (Unavailable, Conflict, NotFound, LeaseLost, ...) and never a
``grpc.RpcError``; claims, lease renewals and credential reads are idempotent, retried by
the channel (``grpcretry``) and, for claims, again here.

Shutdown: stop fetching, let running commands finish within part of the grace period,
cancel the rest, then close the python pool, http client, tool pools, NATS and gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from noetl_common import faults, grpcclient, natsio, pools, tracing
from noetl_common.coalesce import Coalescer
from noetl_common.config import (
    PYTHON_WARM,
    CommandSettings,
    CoreSettings,
    LimitSettings,
    NatsSettings,
    ResultStoreSettings,
    ShardSettings,
    WorkerSettings,
)
from noetl_common.errors import (
    Conflict,
    LeaseLost,
    NoetlError,
    NotFound,
    PermissionDenied,
    Unavailable,
    Unimplemented,
)
from noetl_common.redact import ActiveSecrets, LogFilter, Redactor
from noetl_common.retry import retry_transient
from noetl_common.service import Service
from noetl_common.vocab import CommandStatus, StopReason, result_msg_id
from noetl_dsl import templates
from noetl_proto.v1 import execution_pb2_grpc, messages_pb2, worker_pb2, worker_pb2_grpc
from noetl_store import ResultStore, encode_json, envelope_from_proto, make_result_store

from .cursor import CURSOR_KIND, run_cursor_slot
from .cursor_drivers import Row, default_drivers
from .metrics import BUSY, CANCEL_HINTS, CLAIMS, COMMANDS, CONCURRENCY, RESULT_BYTES, RESULTS_REPUBLISHED
from .notices import WAIT_SEC, Queues, queue_of, queues
from .runner import error_result, execute_command
from .secrecy import scrub_call_result
from .tools import (
    CommandSecrets,
    Credentials,
    DuckdbTool,
    Holder,
    HttpTool,
    PlaybookTool,
    PoolRegistry,
    PostgresTool,
    PythonPool,
    Tools,
    api_fetch,
)
from .tools.duckdb import default_directory

logger = logging.getLogger(__name__)

CLAIM_TIMEOUT_SEC = 10.0
NAK_DELAY_SEC = 1.0
# A notice of a command this worker does not qualify for (labels, tools) goes back for this long.
NOT_QUALIFIED_NAK_SEC = 5.0
CLAIM_RETRY_SEC = (0.1, 0.5, 1.5)  # pauses before claiming again when the api did not answer
PUBLISH_BACKOFF_CAP_SEC = 5.0
# Earlier step results kept in memory (by count: results may be large).
RESULT_CACHE_ITEMS = 256
TAKEN_KEEP = 4096  # command attempts this worker remembers having claimed
# Results published lately, kept to publish again if the events stream loses them (a NATS
# server that restarts without its unsynced writes, a recreated stream).
RECENT_KEEP = 20_000
RECENT_KEEP_SEC = 300.0
WORKER_ERROR = "WORKER_ERROR"
# Core-NATS hints of cancelled commands, one subject per shard (natsio.cancel_subject).
CANCEL_HINTS_SUBJECT = natsio.cancel_filter()
# How long a slot whose result offered a handoff waits for it before pulling notices again
# (the engine answers in a few ms; an offer it does not take costs the slot this pause).
HANDOFF_WAIT_SEC = 0.1
STREAMS_WAIT_SEC = 120.0
# What the api answers (translated) about a claim that is not ours to take, and a lease
# that is no longer ours (FAILED_PRECONDITION, NOT_FOUND, ABORTED).
_LOST_CLAIM = (Conflict, NotFound)
_LOST_LEASE = (Conflict, NotFound, LeaseLost)


@dataclass(frozen=True)
class _Published:
    seq: int  # its position in the events stream (the PubAck)
    subject: str
    payload: bytes
    msg_id: str
    at: float


class ClaimLost(Exception):
    """The command cannot be claimed (another worker has it, it finished, was cancelled or
    re-issued under another attempt, or is unknown): the notice is acked and dropped."""


class NotQualifiedClaim(Exception):
    """The command is queued for workers with labels or tools this one does not have: the
    notice is nak'ed with a delay, for a worker that qualifies."""


class _Run:
    """One command in flight: its task, and why it was told to stop (if it was).
    ``cancelled`` is set only when the command itself was cancelled (not when the lease
    moved on to another attempt)."""

    def __init__(self, command: messages_pb2.Command) -> None:
        self.command = command
        self.task: asyncio.Task[messages_pb2.CallResult] | None = None
        self.stop_reason = ""
        self.stopped = asyncio.Event()
        self.cancelled = asyncio.Event()

    def stop(self, reason: str, *, cancelled: bool = False) -> None:
        if self.stopped.is_set():
            return
        self.stop_reason = reason or "stopped by the api"
        if cancelled:
            self.cancelled.set()
        self.stopped.set()
        if self.task is not None and not self.task.done():
            self.task.cancel()


class WorkerService(Service):
    role = "worker"
    sharded = False
    hardened = True  # tasks run as this process's user: no secret in its environment

    def __init__(self, core: CoreSettings, shard: ShardSettings, command: CommandSettings,
                 worker: WorkerSettings, *, tools: Tools | None = None, store: ResultStore | None = None,
                 results: ResultStoreSettings | None = None, limits: LimitSettings | None = None,
                 nats: NatsSettings | None = None, credentials: Credentials | None = None) -> None:
        super().__init__(core, shard)
        # Stored credentials come from the api, for the commands this worker holds; the
        # secret values of the commands running now are masked in every log line.
        self.credentials = credentials
        self.secrets_in_use = ActiveSecrets()
        self._log_filter = LogFilter(self.secrets_in_use)
        self.nats_cfg = nats or NatsSettings.model_construct()
        self.reconnects = natsio.Reconnects()
        self._recent: deque[_Published] = deque(maxlen=RECENT_KEEP)
        self._recovering: asyncio.Task[None] | None = None
        self._consumer_checked = 0.0
        self.command_cfg = command
        self.worker_cfg = worker
        self.results_cfg = results or ResultStoreSettings()
        self.limits = limits or LimitSettings()
        self.tools = tools
        self.store = store
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.api_channel: grpc.aio.Channel | None = None
        self.worker_api_channel: grpc.aio.Channel | None = None
        self.api: worker_pb2_grpc.WorkerServiceStub | None = None
        self._slots: list[asyncio.Task[Any]] = []
        # the slots waiting for a notice, each with the future that wakes it for a handoff
        self._idle: dict[int, asyncio.Future[None]] = {}
        # commands the engine handed to this worker ("Handoff"), not taken by a slot yet
        self._handoffs: deque[_Handoff] = deque()
        # handed-off commands run outside the slots while the worker drains
        self._late: set[asyncio.Task[None]] = set()
        # slots waiting for the handoff their result offered (``_await_handoff``)
        self._awaiting: list[asyncio.Future[None]] = []
        self._draining = False
        self._handoff_sub: Any = None
        self._runs: dict[str, _Run] = {}
        # Attempts claimed here (bounded, oldest forgotten): a claim is idempotent for its
        # worker, so a duplicate notice (a republish racing our claim, two slots fetching
        # twin notices) would hand us the same attempt again; it is dropped, not run twice.
        self._taken: dict[str, None] = {}
        self._claims: Coalescer[worker_pb2.ClaimCommandRequest, messages_pb2.Command] = Coalescer(
            self._claim_batch, max_batch=worker.claim_batch)
        self._batch_claims = True  # until the api answers UNIMPLEMENTED (an older api)
        self.pools = pools.parse_pools(worker.pool)
        self.labels = pools.parse_labels(worker.labels)
        self.placement = worker_pb2.WorkerPlacement(pools=list(self.pools), labels=self.labels,
                                                    tools=list(pools.parse_tools(worker.tools)))
        self._queues = Queues(queues(self.pools))

    def join_fields(self) -> dict[str, Any]:
        return {"pools": list(self.pools), "labels": self.labels, "tools": list(self.placement.tools)}

    @property
    def worker_id(self) -> str:
        return self.core.instance

    def pool_size(self) -> int:
        return self.worker_cfg.concurrency + 2

    # ------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        self.core.require("postgres_dsn", "nats_url", "api_target")
        templates.configure(self.limits)  # every template a task renders is bounded
        assert self.pool is not None
        self.nc = await natsio.connect(self.core.nats_url, name=f"noetl-worker-{self.worker_id}",
                                       reconnects=self.reconnects, role=self.role, **self.core.nats_options())
        self.js = self.nc.jetstream()
        # The worker's NATS user may not create streams (the api does): wait for them.
        await retry_transient("waiting for the nats streams",
                              self._ensure_streams_and_consumers, deadline_sec=STREAMS_WAIT_SEC, initial=0.2, cap=2.0)
        self.reconnects.listen(self._on_reconnect)
        result_bytes = self.limits.result_bytes
        if self.store is None:
            # Writes the configured tier (NOETL_RESULT_TIER), reads every tier; refuses a
            # result above NOETL_LIMIT_RESULT_BYTES (the task's RESULT_TOO_LARGE).
            self.store = await make_result_store(self.results_cfg, self.pool, self.js, lru_items=RESULT_CACHE_ITEMS,
                                                 max_result_bytes=result_bytes)
        # claims, lease renewals and credentials on the api's worker port; sub-playbooks on its client port
        self.api_channel = self.channel(self.core.api_target)
        self.worker_api_channel = self.channel(self.core.worker_api_target or self.core.api_target)
        self.api = grpcclient.translating(worker_pb2_grpc.WorkerServiceStub(self.worker_api_channel))
        if self.credentials is None:
            self.credentials = Credentials(api_fetch(self.api, self.worker_id))
        for handler in logging.getLogger().handlers:
            handler.addFilter(self._log_filter)
        if self.tools is None:
            # Tools stop reading a result as soon as it passes the limit (the store checks it exactly).
            python = PythonPool(self.worker_cfg.python_pool_size, warm=PYTHON_WARM,
                                max_tasks_per_child=self.worker_cfg.python_tasks_per_child,
                                memory_mb=self.worker_cfg.python_memory_mb, result_bytes=result_bytes)
            pools = PoolRegistry()
            duckdb = DuckdbTool(python, self.worker_cfg.duckdb_dir or default_directory(), max_result_bytes=result_bytes,
                                memory_mb=self.worker_cfg.python_memory_mb)
            self.tools = Tools(python=python, http=HttpTool(max_body_bytes=result_bytes),
                               postgres=PostgresTool(pools, max_result_bytes=result_bytes),
                               playbook=PlaybookTool(execution_pb2_grpc.ExecutionServiceStub(self.api_channel)),
                               cursors=default_drivers(pools), duckdb=duckdb,
                               script_dir=self.worker_cfg.script_dir or None)
        if self.tools.python is not None:
            await self.tools.python.start()
        await self.nc.subscribe(CANCEL_HINTS_SUBJECT, cb=self._on_cancel_hint)
        if self.command_cfg.handoff:
            # offered only once the server has accepted the subscription: a worker whose NATS
            # user may not read handoffs (permissions older than this version) is never handed
            # commands it would not hear of
            subject = natsio.handoff_subject(self.worker_id)
            self._handoff_sub = await natsio.subscribe_permitted(self.nc, subject, self._on_handoff)
            if self._handoff_sub is None:
                logger.error("this worker's NATS user may not subscribe to %s: handoffs are off (update the NATS"
                             " permissions: noetl-rt nats-config)", subject)

    async def _ensure_streams_and_consumers(self) -> None:
        assert self.js is not None
        await natsio.ensure_streams(self.js, manage=False)
        for pool in self.pools:
            await natsio.ensure_pool_consumers(self.js, pool)

    async def on_serving(self) -> None:
        CONCURRENCY.set(self.worker_cfg.concurrency)
        for n in range(self.worker_cfg.concurrency):
            self._slots.append(self.spawn(self._slot_loop(n), f"worker-slot-{n}"))
        logger.info("worker %s running %d slots in pool(s) %s (labels %s)", self.worker_id, len(self._slots),
                    ",".join(self.pools), self.labels or "none")

    async def check_health(self) -> list[str]:
        if self.nc is not None and not self.nc.is_connected:
            return ["nats unavailable: not connected"]
        return []

    # ------------------------------------------------------------ NATS restarts

    def _on_reconnect(self) -> None:
        if self._recovering is None or self._recovering.done():
            self._recovering = asyncio.ensure_future(self._after_reconnect())

    async def _after_reconnect(self) -> None:
        """After a reconnect: the shared consumer may be gone with the server's state
        (re-created), and results the events stream had acknowledged may be lost (a server
        restart without its unsynced writes, a recreated stream): every recent result whose
        stream position is past the stream's end now is published again (same Msg-Id; the
        engine accepts one result per command and records any other as a duplicate)."""
        assert self.js is not None
        for delay in (0.0, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0):
            await asyncio.sleep(delay)
            try:
                await self._ensure_streams_and_consumers()  # the api re-creates lost streams
                last = int((await self.js.stream_info(natsio.EVENTS_STREAM)).state.last_seq)
                break
            except Exception as exc:
                logger.warning("after a NATS reconnect: streams not readable yet (%s)", exc)
        else:
            return
        horizon = time.monotonic() - RECENT_KEEP_SEC
        lost = [p for p in self._recent if p.seq > last and p.at >= horizon]
        if not lost:
            return
        logger.error("the events stream ends at %s but %d result(s) this worker published were acknowledged past"
                     " it: publishing them again", last, len(lost))
        RESULTS_REPUBLISHED.inc(len(lost))
        for p in lost:
            try:
                await natsio.publish(self.js, p.subject, p.payload, msg_id=p.msg_id)
            except NoetlError as exc:
                logger.warning("republishing %s failed: %s", p.msg_id, exc)

    async def _ensure_consumer(self) -> None:
        """Re-create the pool's consumers if they are gone (at most once a second)."""
        if self.js is None or time.monotonic() - self._consumer_checked < 1.0:
            return
        self._consumer_checked = time.monotonic()
        try:
            for pool in self.pools:
                await natsio.ensure_pool_consumers(self.js, pool)
        except Exception as exc:
            logger.warning("checking the worker consumer failed: %s", exc)

    async def on_stop(self) -> None:
        self._draining = True
        if self._recovering is not None:
            self._recovering.cancel()
        grace = self.core.shutdown_grace_sec
        idle = [t for n, t in enumerate(self._slots) if n in self._idle]
        busy = [t for n, t in enumerate(self._slots) if n not in self._idle and not t.done()]
        # Commands handed to this worker are claimed for it: those waiting for a slot, and
        # those arriving while it drains (an offer made just before), run within the grace
        # like the ones running (``_on_handoff``); the subscription ends after that.
        while self._handoffs:
            self._late_handoff(self._handoffs.popleft())
        for task in idle:
            task.cancel()
        deadline = time.monotonic() + grace * 0.6
        if busy or self._late:
            logger.info("waiting up to %.1fs for %d running commands", grace * 0.6, len(busy) + len(self._late))
        while busy or self._late:
            left = deadline - time.monotonic()
            waiting = [*busy, *self._late]
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
            busy = [t for t in busy if not t.done()]
            if left <= 0 or not done:
                for task in [*busy, *self._late]:
                    task.cancel()
                idle.extend([*busy, *self._late])
                break
        if self._handoff_sub is not None:
            with contextlib.suppress(Exception):
                await self._handoff_sub.unsubscribe()
        if idle:
            await asyncio.wait(idle, timeout=1.0)
        if self.tools is not None:
            await self.tools.close()
        if self.store is not None:
            await self.store.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout=2.0)
        if self.api_channel is not None:
            await self.api_channel.close()
        if self.worker_api_channel is not None:
            await self.worker_api_channel.close()
        if self.credentials is not None:
            self.credentials.clear()
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self._log_filter)

    # ------------------------------------------------------------ slots

    async def _slot_loop(self, n: int) -> None:
        assert self.js is not None
        subs = {}
        for key in self._queues.keys:
            pool, _, priority = key.partition(".")
            subs[key] = await self.js.pull_subscribe_bind(durable=pools.consumer_name(pool, priority),
                                                          stream=natsio.COMMANDS_STREAM)
        mark = _SlotMark()
        _SLOT_MARK.set(mark)  # _publish notes there that this slot's result offered a handoff
        while not self._draining:
            if mark.offered:
                # the engine is likely to hand this worker the next command within a few ms:
                # wait for it here rather than pulling notices and withdrawing the requests
                mark.offered = False
                await self._await_handoff()
            if self._handoffs:
                await self._run_handoff(self._handoffs.popleft())
                continue
            try:
                msg = await self._next_notice(n, subs)
            except NoetlError as exc:
                logger.warning("fetching commands failed: %s", exc)
                await self._ensure_consumer()
                await self.sleep(0.5)
                continue
            if msg is None:
                continue
            try:
                await self.handle_notice(msg)
            except Exception:
                logger.exception("handling a command notice failed; it will be redelivered")

    async def _next_notice(self, n: int, subs: dict[str, JetStreamContext.PullSubscription]) -> Msg | None:
        """One notice for slot ``n``: drain its consumers highest priority first, else wait
        on all of them at once (notices.py)."""
        queues = self._queues
        for key in queues.to_drain():
            msg = await natsio.fetch_now(subs[key])
            if msg is not None:
                return msg
            queues.found_empty(key)
        if self._handoffs:
            return None  # one arrived while this slot drained: the slot loop runs it
        wake = self._idle[n] = asyncio.get_running_loop().create_future()
        try:
            msg = await natsio.fetch_first(list(subs.values()), wait_sec=WAIT_SEC, wake=wake)
        finally:
            del self._idle[n]
        if msg is not None:
            queues.found_notice(queue_of(msg.subject))
        return msg

    async def _on_handoff(self, msg: Msg) -> None:
        """A command the engine handed to this worker: committed claimed by it, with its
        lease running. It waits for the next free slot (an idle one is woken for it)."""
        try:
            command = messages_pb2.Command.FromString(msg.data)
        except Exception as exc:  # protobuf DecodeError
            logger.error("dropping an undecodable handoff: %s", exc)
            return
        try:
            faults.check("worker.handoff", command.step)  # tests: a handoff lost on the way
        except faults.InjectedFault:
            logger.warning("handoff of %s dropped (injected fault)", command.command_id)
            return
        if not command.command_id or not self._take(command):
            return
        CLAIMS.labels("handoff").inc()
        # run later by a slot, in a span continuing the trace its headers carry
        handoff = _Handoff(command, msg.subject, dict(msg.headers or {}))
        if self._draining:  # no slot will take it: run it now, within the shutdown grace
            self._late_handoff(handoff)
            return
        self._handoffs.append(handoff)
        for wake in (*self._awaiting, *self._idle.values()):  # a slot waiting for it first
            if not wake.done():
                wake.set_result(None)
                break

    async def _await_handoff(self) -> None:
        """Wait up to HANDOFF_WAIT_SEC for a handoff (after this slot's result offered one)."""
        if self._handoffs or self._draining:
            return
        wake = asyncio.get_running_loop().create_future()
        self._awaiting.append(wake)
        try:
            await asyncio.wait((wake,), timeout=HANDOFF_WAIT_SEC)
        finally:
            self._awaiting.remove(wake)

    def _late_handoff(self, handoff: _Handoff) -> None:
        task = asyncio.ensure_future(self._run_handoff(handoff))
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    async def _run_handoff(self, handoff: _Handoff) -> None:
        try:
            with tracing.consumer_span(handoff.subject, handoff.headers):
                await self.run_command(handoff.command)
        except Exception:
            logger.exception("running the handed-off command %s failed; its lease expires and it is re-issued",
                             handoff.command.command_id)

    def _handoff_offer(self) -> messages_pb2.HandoffOffer | None:
        """Offered with a result when a slot is idle for each command already handed here:
        the engine may then hand this worker the command the result leads to."""
        if self._handoff_sub is not None and self.nc is not None and natsio.refused(self.nc, self._handoff_sub.subject):
            # refused after subscribe_permitted looked: nothing would reach this worker
            logger.error("this worker's NATS user may not subscribe to %s: handoffs are off (update the NATS"
                         " permissions: noetl-rt nats-config)", self._handoff_sub.subject)
            self._handoff_sub = None
        if self._handoff_sub is None or self._draining or \
                len(self._idle) + len(self._awaiting) <= len(self._handoffs):
            return None
        p = self.placement
        return messages_pb2.HandoffOffer(pools=list(p.pools), labels=dict(p.labels), tools=list(p.tools))

    @tracing.consumer  # a span per notice, continuing the execution's trace (the notice headers)
    async def handle_notice(self, msg: Msg) -> None:
        try:
            notice = messages_pb2.CommandNotice.FromString(msg.data)
        except Exception as exc:  # protobuf DecodeError
            logger.error("dropping an undecodable command notice: %s", exc)
            await _settle(msg.term())
            return
        claim = worker_pb2.ClaimCommandRequest(command_id=notice.command_id, worker_id=self.worker_id,
                                               attempt=notice.attempt, placement=self.placement)
        for retry_in in (*CLAIM_RETRY_SEC, None):
            try:
                command = await self._claims.submit(claim)
                break
            except ClaimLost as exc:
                CLAIMS.labels("lost").inc()
                logger.debug("command %s not claimable (%s); dropping", notice.command_id, exc)
                await _settle(msg.ack())
                return
            except NotQualifiedClaim as exc:
                CLAIMS.labels("not_qualified").inc()
                logger.info("not qualified for command %s (%s); leaving it for another worker", notice.command_id,
                            exc)
                await _settle(msg.nak(delay=NOT_QUALIFIED_NAK_SEC))
                return
            except NoetlError as exc:
                # The api unreachable or confused. The claim may have committed with only its
                # answer lost (a replica dying mid-call): claiming again from this worker gets
                # it back, so retry here (the channel routes to a live replica) before letting
                # the notice go back to the stream, where another worker might fetch it.
                if retry_in is None or await self.sleep(retry_in):
                    CLAIMS.labels("unavailable").inc()
                    logger.warning("claiming %s failed (%s); redelivering", notice.command_id, exc)
                    await _settle(msg.nak(delay=NAK_DELAY_SEC))
                    return
                logger.info("claiming %s failed (%s); retrying in %.1fs", notice.command_id, exc, retry_in)
        await _settle(msg.ack())
        if not command.command_id:
            CLAIMS.labels("lost").inc()
            logger.error("the api answered the claim of %s without a command; dropping", notice.command_id)
            return
        if not self._take(command):
            CLAIMS.labels("lost").inc()
            logger.debug("command %s attempt %s already claimed here; dropping the duplicate notice",
                         command.command_id, command.attempt)
            return
        CLAIMS.labels(CommandStatus.CLAIMED).inc()
        await self.run_command(command)

    def _take(self, command: messages_pb2.Command) -> bool:
        """Record that this worker runs the command's attempt; False if it already did."""
        key = f"{command.command_id}#{command.attempt}"
        if key in self._taken:
            return False
        self._taken[key] = None
        if len(self._taken) > TAKEN_KEEP:
            del self._taken[next(iter(self._taken))]
        return True

    async def _claim_batch(self, claims: Sequence[worker_pb2.ClaimCommandRequest],
                           ) -> list[messages_pb2.Command | BaseException]:
        """Claim a batch (Coalescer flush): one ``ClaimCommands`` call, or ``ClaimCommand``
        for a lone claim. Per claim: the command, ``ClaimLost``, ``NotQualifiedClaim``, or
        the call's error."""
        assert self.api is not None
        if len(claims) > 1 and self._batch_claims:
            try:
                resp = await self.api.ClaimCommands(worker_pb2.ClaimCommandsRequest(
                    worker_id=self.worker_id, claims=claims, placement=self.placement), timeout=CLAIM_TIMEOUT_SEC)
            except Unimplemented:
                logger.info("the api does not serve ClaimCommands; claiming one command per call")
                self._batch_claims = False
            else:
                if len(resp.outcomes) != len(claims):
                    raise Unavailable(f"ClaimCommands answered {len(resp.outcomes)} outcomes"
                                      f" for {len(claims)} claims")
                out: list[messages_pb2.Command | BaseException] = []
                for claim, o in zip(claims, resp.outcomes, strict=True):
                    if o.HasField("command"):
                        out.append(o.command)
                    elif o.failure == worker_pb2.CLAIM_FAILURE_DEFERRED:
                        # claimed for us, answer deferred (size budget): claiming again returns it
                        try:
                            out.append(await self._claim_one(claim))
                        except Exception as exc:
                            out.append(exc)
                    elif o.failure == worker_pb2.CLAIM_FAILURE_NOT_QUALIFIED:
                        out.append(NotQualifiedClaim(o.message))
                    else:
                        out.append(ClaimLost(o.message or "not claimable"))
                return out
        return list(await asyncio.gather(*(self._claim_one(c) for c in claims), return_exceptions=True))

    async def _claim_one(self, claim: worker_pb2.ClaimCommandRequest) -> messages_pb2.Command:
        assert self.api is not None
        try:
            resp = await self.api.ClaimCommand(claim, timeout=CLAIM_TIMEOUT_SEC)
        except _LOST_CLAIM as exc:
            raise ClaimLost(f"{type(exc).__name__}: {exc}") from exc
        except PermissionDenied as exc:  # errors.NotQualified
            raise NotQualifiedClaim(str(exc)) from exc
        return resp.command

    # ------------------------------------------------------------ commands

    async def run_command(self, command: messages_pb2.Command) -> None:
        """Run a claimed command, renewing its lease, and publish its result."""
        assert self.store is not None and self.tools is not None
        extra = {"execution_id": command.execution_id, "command_id": command.command_id, "step": command.step}
        run = _Run(command)
        self._runs[command.command_id] = run
        BUSY.inc()
        started = time.perf_counter()
        renewer = asyncio.ensure_future(self._renew_loop(run))
        # The credentials this attempt reads, and the redactor of their values (registered
        # while it runs: log lines of any origin are masked with it).
        redactor = Redactor()
        secrets = CommandSecrets(self.credentials, Holder(command.command_id, command.attempt, command.execution_id,
                                                          command.step, command.claim_token), redactor)
        self.secrets_in_use.register(redactor)
        try:
            work: Awaitable[messages_pb2.CallResult]
            if command.kind == CURSOR_KIND:
                async def report(row: Row, counts: dict[str, int]) -> None:
                    await self._report_row(run, row, counts)

                work = run_cursor_slot(command, self.store, self.tools, report=report, worker_id=self.worker_id,
                                       default_timeout=self.worker_cfg.default_task_timeout_sec,
                                       cancelled=run.cancelled, infra_retry_sec=self.worker_cfg.infra_retry_sec,
                                       secrets=secrets)
            else:
                work = execute_command(command, self.store, self.tools, worker_id=self.worker_id,
                                       default_timeout=self.worker_cfg.default_task_timeout_sec,
                                       cancelled=run.cancelled, infra_retry_sec=self.worker_cfg.infra_retry_sec,
                                       secrets=secrets, batch_budget_sec=self.worker_cfg.batch_budget_sec)
            run.task = asyncio.ensure_future(work)
            try:
                result = await run.task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if run.stopped.is_set() and (current is None or not current.cancelling()):
                    COMMANDS.labels(command.kind or "unknown", "stopped").inc()
                    logger.info("command stopped: %s", run.stop_reason, extra=extra)
                    return
                raise
            except Exception as exc:  # a worker bug: report it rather than leave the command hanging
                logger.exception("command crashed the worker code", extra=extra)
                result = scrub_call_result(error_result(
                    command, WORKER_ERROR, f"worker error: {type(exc).__name__}: {exc}", worker_id=self.worker_id,
                    kind=type(exc).__name__), redactor)
            await self._publish(run, result)
            status = result.envelope.status or "unknown"
            COMMANDS.labels(command.kind or "unknown", status).inc()
            logger.debug("command done status=%s in %.1f ms", status, (time.perf_counter() - started) * 1000,
                         extra=extra)
        finally:
            self.secrets_in_use.unregister(redactor)
            if self._runs.get(command.command_id) is run:
                del self._runs[command.command_id]
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            BUSY.dec()

    async def _renew_loop(self, run: _Run) -> None:
        assert self.api is not None
        interval = max(0.05, self.command_cfg.lease_sec / 3)
        command = run.command
        while True:
            await asyncio.sleep(interval)
            try:
                resp = await self.api.RenewLease(worker_pb2.RenewLeaseRequest(
                    command_id=command.command_id, worker_id=self.worker_id, attempt=command.attempt),
                    timeout=interval)
            except _LOST_LEASE as exc:
                run.stop(f"lease lost ({type(exc).__name__}: {exc})")
                return
            except NoetlError as exc:
                logger.warning("renewing the lease of %s failed (%s)", command.command_id, exc)
                continue
            if resp.stop:
                run.stop(resp.stop_reason, cancelled=resp.stop_reason == StopReason.CANCELLED)
                return

    async def _report_row(self, run: _Run, row: Row, counts: dict[str, int]) -> None:
        """Record the row a cursor slot is claiming (before its claim commits). Raises
        Unavailable when the api cannot be reached (the claim rolls back and is retried);
        when the api says stop, stops the command and raises CancelledError (the claim
        rolls back, nothing is published)."""
        assert self.api is not None
        command = run.command
        try:
            resp = await self.api.RenewLease(worker_pb2.RenewLeaseRequest(
                command_id=command.command_id, worker_id=self.worker_id, attempt=command.attempt,
                progress_json=encode_json({"row": row, "counts": counts}).decode()), timeout=CLAIM_TIMEOUT_SEC)
        except _LOST_LEASE as exc:
            run.stop(f"lease lost ({type(exc).__name__}: {exc})")
            raise asyncio.CancelledError(run.stop_reason) from None
        except NoetlError as exc:
            raise Unavailable(f"recording the claimed row failed ({exc})") from exc
        if resp.stop:
            run.stop(resp.stop_reason, cancelled=resp.stop_reason == StopReason.CANCELLED)
            raise asyncio.CancelledError(run.stop_reason)

    async def _on_cancel_hint(self, msg: Msg) -> None:
        """``{"command_ids": [...]}``: stop those of them running here (a hint: the lease
        renewal answering "cancelled" is the backstop)."""
        try:
            ids = json.loads(msg.data or b"{}").get("command_ids") or []
        except (ValueError, AttributeError) as exc:
            logger.debug("ignoring a malformed cancel hint on %s: %s", msg.subject, exc)
            return
        for command_id in ids if isinstance(ids, list) else []:
            run = self._runs.get(str(command_id))
            if run is not None and not run.stopped.is_set():
                CANCEL_HINTS.inc()
                run.stop(StopReason.CANCELLED, cancelled=True)

    async def _publish(self, run: _Run, result: messages_pb2.CallResult) -> None:
        """Publish until JetStream acks (capped backoff); gives up only when the command
        was stopped or the worker's shutdown grace is spent."""
        assert self.js is not None
        command = run.command
        offer = self._handoff_offer()
        if offer is not None:
            result.handoff.CopyFrom(offer)
            # The slot waits for the handoff, unless the command ran loop iterations: their
            # result usually leads to more iterations, which are never handed off (its offer
            # then waits in the engine for another command, and an idle slot takes that).
            # A context naming a loop anywhere only costs the wait; a loop's always names it.
            if (mark := _SLOT_MARK.get()) is not None and '"loop"' not in command.context_json:
                mark.offered = True
        payload = messages_pb2.EngineInput(call_result=result).SerializeToString()
        subject = natsio.events_subject(command.shard_id, natsio.KIND_CALL)
        msg_id = result_msg_id(command.command_id, command.attempt)
        delay = 0.05
        give_up_at: float | None = None
        while True:
            try:
                ack = await natsio.publish(self.js, subject, payload, msg_id=msg_id)
                if ack is not None and getattr(ack, "seq", None):
                    self._recent.append(_Published(int(ack.seq), subject, payload, msg_id, time.monotonic()))
                break
            except NoetlError as exc:
                if run.stopped.is_set():
                    logger.info("not publishing the result of %s: %s", command.command_id, run.stop_reason)
                    return
                if self.stopping:
                    give_up_at = give_up_at or time.monotonic() + self.core.shutdown_grace_sec / 2
                    if time.monotonic() > give_up_at:
                        logger.error("giving up publishing the result of %s at shutdown: %s",
                                     command.command_id, exc)
                        return
                logger.warning("publishing the result of %s failed (%s); retrying in %.2fs",
                               command.command_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, PUBLISH_BACKOFF_CAP_SEC)
        RESULT_BYTES.observe(len(encode_json(envelope_from_proto(result.envelope))))


class _SlotMark:
    """Per slot: whether the result it just published offered a handoff."""

    offered = False


_SLOT_MARK: contextvars.ContextVar[_SlotMark | None] = contextvars.ContextVar("noetl_slot_mark", default=None)


@dataclass(frozen=True)
class _Handoff:
    """A command the engine handed to this worker, with the message's subject and headers."""

    command: messages_pb2.Command
    subject: str
    headers: dict[str, str]


async def _settle(op: Any) -> None:
    """Ack / nak / term a message; a failure only means it will be redelivered."""
    try:
        await op
    except (NatsError, OSError) as exc:
        logger.warning("settling a command notice failed: %s", exc)
