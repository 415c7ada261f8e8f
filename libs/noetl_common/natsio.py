"""NATS JetStream: connection, the two streams, subjects. nats errors are translated here.

Streams:
  NOETL_EVENTS   ``noetl.events.{shard}.{kind}``  everything a shard's engine consumes
                 (worker results, submission nudges, cancels, expiries, barriers).
                 Limits retention: engines read it with an ordered consumer per owned
                 shard from the stream position recorded in their lease row.
  NOETL_COMMANDS ``noetl.commands.{pool}.{priority}.{shard}``  command notifications;
                 work-queue retention, one durable pull consumer per (pool, priority),
                 ``noetl-workers-{pool}-{priority}``, shared by that pool's workers
                 (``pools.py``; their filters are disjoint, as a work queue requires).

Core (non-JetStream) subjects carry hints only, never facts (and a pool's workers also
subscribe to ``noetl.commands.{pool}.*.*`` itself: a notice's copy tells them which
priority has work, so idle slots ask that consumer at once and busy ones skip levels with none):
  ``noetl.progress.{execution_id}``  the read model of an execution changed
  ``noetl.projector.{shard}``        new events were appended to a shard
  ``noetl.checkpointer.{shard}``     the projection passed a checkpoint barrier of a shard
  ``noetl.cancel.{shard}``           commands were cancelled: {"command_ids": [...]}

Replies (JetStream API answers, pulled and pushed messages) come to ``_INBOX.{role}.>``
(``inbox_prefix``), so a role's NATS user may subscribe to its own replies only.
Each role's NATS permissions are data in ``natsperms.py``.

Security: the URL may carry ``user:password@`` (never logged: ``redact``), a creds file
(JWT + nkey seed) is ``creds_file``, and ``ca_file`` makes the connection TLS, verifying the
server against that CA (``cert_file``/``key_file`` present a client certificate). An
authorization violation at the first connection is a ``ConfigError`` naming it, not an
endless retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, ConnectionClosedError
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StatusCode,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError
from opentelemetry.context import Context

from . import pools, retry, tracing
from .errors import ConfigError, NoetlError, Unavailable

logger = logging.getLogger(__name__)

EVENTS_STREAM = "NOETL_EVENTS"
COMMANDS_STREAM = "NOETL_COMMANDS"
# The one shared consumer of the runtime before pools (filter ``noetl.commands.>``): the
# api deletes it (a work queue refuses the per-pool consumers while it overlaps them).
LEGACY_WORKER_CONSUMER = "noetl-workers"

# Event kinds (the last subject token).
KIND_CALL = "call"
KIND_SUBMIT = "submit"
KIND_CANCEL = "cancel"
KIND_EXPIRED = "expired"
KIND_BARRIER = "barrier"
KIND_REDRIVE = "redrive"


def events_subject(shard: int | str, kind: str) -> str:
    return f"noetl.events.{shard}.{kind}"


def events_filter(shard: int | str) -> str:
    return f"noetl.events.{shard}.>"


def commands_subject(pool: str, priority: str, shard: int | str) -> str:
    return f"noetl.commands.{pool}.{priority}.{shard}"


def commands_filter(pool: str, priority: str) -> str:
    """One pool's notices of one priority, every shard (a worker consumer's filter)."""
    return commands_subject(pool, priority, "*")


def progress_subject(execution_id: int | str) -> str:
    return f"noetl.progress.{execution_id}"


# The payload of a progress hint whose batch projected the execution's terminal status
# (watchers read at once; other hints they may coalesce).
PROGRESS_TERMINAL = b"terminal"


# The engine's hint to the projector of a shard: project now (an execution ended, or a
# checkpoint barrier was appended), rather than within the projector's batch window.
PROJECT_NOW = b"now"


def projector_subject(shard: int | str) -> str:
    return f"noetl.projector.{shard}"


def checkpointer_subject(shard: int | str) -> str:
    return f"noetl.checkpointer.{shard}"


def cancel_subject(shard: int | str) -> str:
    return f"noetl.cancel.{shard}"


def handoff_subject(worker_id: int | str) -> str:
    """Where the engine sends a worker the commands it hands it (docs/ARCHITECTURE.md
    "Handoff"): one subject per worker, named by a digest of its id, so any id makes one
    valid subject token."""
    digest = hashlib.sha256(str(worker_id).encode()).hexdigest()[:24]
    return f"{HANDOFF_PREFIX}.{digest}"


HANDOFF_PREFIX = "noetl.handoff"


def cancel_filter() -> str:
    """Every shard's cancel hints (workers hold commands of any shard)."""
    return cancel_subject("*")


def inbox_prefix(role: str) -> str:
    """Where a role's replies come: its NATS user may subscribe here and nowhere else
    under ``_INBOX``."""
    return f"_INBOX.{role}"


def redact(url: str) -> str:
    """``url`` (comma-separated URLs) with any password replaced by ``***``."""
    out = []
    for one in url.split(","):
        one = one.strip()
        parts = urlsplit(one if "://" in one else f"nats://{one}")
        if parts.password is not None:
            host = parts.hostname or ""
            netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
            one = urlunsplit(parts._replace(netloc=netloc))
        out.append(one)
    return ",".join(out)


def _is_auth_violation(exc: BaseException) -> bool:
    return isinstance(exc, AuthorizationError) or "authorization violation" in str(exc).lower()


def tls_context(ca_file: str = "", cert_file: str = "", key_file: str = "") -> ssl.SSLContext | None:
    """A client TLS context verifying the server against ``ca_file`` (and presenting
    ``cert_file``/``key_file`` when given); None when none is set (plaintext)."""
    if not (ca_file or cert_file):
        return None
    if bool(cert_file) != bool(key_file):
        raise ConfigError("NOETL_NATS_TLS_CERT_FILE and NOETL_NATS_TLS_KEY_FILE go together")
    try:
        ctx = ssl.create_default_context(cafile=ca_file or None)
        if cert_file:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"NATS TLS files not usable: {exc}") from exc
    return ctx


def translate(exc: BaseException) -> NoetlError:
    """A nats (or socket) error as the project's: Unavailable when waiting can get past it
    (``retry.nats_transient``, OSError, timeouts), else a plain NoetlError."""
    if isinstance(exc, NoetlError):
        return exc
    message = f"nats error: {type(exc).__name__}: {exc}"
    if retry.nats_transient(exc) or isinstance(exc, OSError | TimeoutError):
        return Unavailable(message)
    return NoetlError(message)


class Reconnects:
    """Counts a client's reconnections and calls its listeners on each one: JetStream
    consumers are not carried across a server restart reliably (an ordered consumer
    notices only after two missed heartbeats, ~10 s, and resumes at a sequence the
    restarted server may no longer have), so their owners re-create them at once."""

    def __init__(self) -> None:
        self.generation = 0
        self._listeners: list[Callable[[], None]] = []

    def listen(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def unlisten(self, fn: Callable[[], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def reconnected(self) -> None:
        self.generation += 1
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:  # a listener's bug must not break the client's reconnect
                logger.exception("nats reconnect listener failed")


# Each connection connect() made: a future resolved when the connection is re-established
# (and replaced by a fresh one then). publish() waits on it beside its ack.
_RECONNECTED: weakref.WeakKeyDictionary[NATS, asyncio.Future[None]] = weakref.WeakKeyDictionary()


def _reconnected(nc: NATS) -> None:
    """Wake every publish awaiting an ack on ``nc``'s previous connection."""
    old = _RECONNECTED.get(nc)
    _RECONNECTED[nc] = asyncio.get_running_loop().create_future()
    if old is not None and not old.done():
        old.set_result(None)


async def connect(url: str, *, name: str, reconnects: Reconnects | None = None, role: str = "",
                  ca_file: str = "", creds_file: str = "", cert_file: str = "", key_file: str = "") -> NATS:
    """Connect with unbounded reconnects (every 0.5 s); the caller closes with ``await
    nc.drain()``. ``reconnects`` is told about every reconnection. ``role`` puts replies
    under that role's inbox (``inbox_prefix``); ``ca_file`` (and ``cert_file``/``key_file``)
    make it TLS; ``creds_file`` is a NATS creds file (user JWT and nkey seed); a user and
    password go in the URL. The first connection refused for authorization raises
    ``ConfigError`` (wrong or missing credentials do not get better by retrying)."""
    tls = tls_context(ca_file, cert_file, key_file)
    if creds_file and not _readable(creds_file):
        raise ConfigError(f"NOETL_NATS_CREDS_FILE {creds_file} is not readable")
    nc = NATS()
    _RECONNECTED[nc] = asyncio.get_running_loop().create_future()
    connected = False

    async def on_error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():  # the connection stays up
            _VIOLATIONS.setdefault(nc, deque(maxlen=32)).append(str(exc).lower())
        if _is_auth_violation(exc):
            logger.error("nats refused this client's credentials (authorization violation) at %s: check "
                         "the user/password in NOETL_NATS_URL or NOETL_NATS_CREDS_FILE", redact(url))
            if not connected:
                raise ConfigError(f"nats at {redact(url)}: authorization violation (wrong or missing "
                                  "credentials in NOETL_NATS_URL / NOETL_NATS_CREDS_FILE)") from exc
            return
        if isinstance(exc, ssl.SSLCertVerificationError) and not connected:
            raise ConfigError(f"nats at {redact(url)}: TLS certificate not trusted ({exc.verify_message}); "
                              "check NOETL_NATS_TLS_CA_FILE") from exc
        logger.warning("nats error: %s", exc)

    async def on_disconnect() -> None:
        logger.warning("nats disconnected")

    async def on_reconnect() -> None:
        logger.info("nats reconnected")
        _reconnected(nc)
        if reconnects is not None:
            reconnects.reconnected()

    options: dict[str, Any] = {}
    if tls is not None:
        options["tls"] = tls
    if creds_file:
        options["user_credentials"] = creds_file
    if role:
        options["inbox_prefix"] = inbox_prefix(role)
    try:
        await nc.connect(
            servers=[u.strip() for u in url.split(",") if u.strip()],
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; typed int, a float works
            connect_timeout=5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            pending_size=64 * 1024 * 1024,
            **options,
        )
    except ConfigError:
        connected = True  # from here on errors are only logged
        await _abandon(nc)
        raise
    except (NatsError, OSError) as exc:
        connected = True
        await _abandon(nc)
        raise translate(exc) from exc
    connected = True
    wants_tls = tls is not None or any(u.strip().startswith("tls://") for u in url.split(","))
    if wants_tls and not nc._server_info.get("tls_required"):
        # nats-py upgrades to TLS only when the server asks: refuse a server that did not.
        await _abandon(nc)
        raise ConfigError(f"nats at {redact(url)} does not require TLS (a tls:// URL or "
                          "NOETL_NATS_TLS_CA_FILE asks for it): refusing a plaintext connection")
    return nc


# The permission violations the server reported on each connection (recent ones), for
# ``subscribe_permitted``.
_VIOLATIONS: weakref.WeakKeyDictionary[NATS, deque[str]] = weakref.WeakKeyDictionary()


async def subscribe_permitted(nc: NATS, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Any:
    """Subscribe, and make sure the server accepted it: a subscription the user's
    permissions refuse is only reported asynchronously (the connection stays up and the
    subscription never gets a message). The server answers the PING that follows the SUB
    before it reports the refusal (seen: 'pong err' in 285 of 300 tries, the error arriving
    between the first and a second PONG in all 300), so this waits for two PING/PONGs.
    Refused, the subscription is dropped and None returned (the violation is logged by
    ``connect``'s error handler). A refusal later still is seen by ``refused``, which
    callers check before relying on the subscription. Only on connections ``connect()``
    made."""
    try:
        sub = await nc.subscribe(subject, cb=cb)
        await nc.flush(timeout=5)
        if not refused(nc, subject):
            await nc.flush(timeout=5)
    except (NatsError, OSError, TimeoutError) as exc:
        raise translate(exc) from exc
    if refused(nc, subject):
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        return None
    return sub


def refused(nc: NATS, subject: str) -> bool:
    """Whether the server reported refusing this connection a subscription to ``subject``
    (among its recent permission violations)."""
    quoted = f'"{subject.lower()}"'
    return any(quoted in v for v in _VIOLATIONS.get(nc, ()))


async def _abandon(nc: NATS) -> None:
    """Close a client whose first connection failed (a transport left by a failed TLS
    handshake may never report closed: bounded)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 2.0)


def _readable(path: str) -> bool:
    try:
        with open(path, "rb"):
            return True
    except OSError:
        return False


def stream_configs(*, events_max_age_sec: float = 7 * 86400, replicas: int = 1) -> list[StreamConfig]:
    """The two streams as the runtime wants them (``ensure_streams`` converges to these)."""
    return [
        StreamConfig(
            name=EVENTS_STREAM,
            subjects=["noetl.events.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=events_max_age_sec,
            duplicate_window=120.0,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=COMMANDS_STREAM,
            subjects=["noetl.commands.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            num_replicas=replicas,
        ),
    ]


# The stream settings the runtime manages; anything else an operator set is left alone.
_MANAGED = ("subjects", "retention", "storage", "max_age", "duplicate_window", "num_replicas")


async def ensure_streams(js: JetStreamContext, *, events_max_age_sec: float = 7 * 86400,
                         command_ack_wait_sec: float = 30.0, replicas: int = 1, manage: bool = True) -> None:
    """Create the streams and the shared worker consumer when missing (idempotent). An
    existing stream is updated only where a managed setting differs from the wanted one
    (logged), so every role's start does not re-apply, and undo, an operator's changes
    to the rest of its configuration, and the shared consumer of a runtime before pools is
    deleted (every queued command is republished: a new engine owner and the reaper both do). ``manage=False`` (workers: their NATS user may not create or
    change streams) only checks the streams exist (``Unavailable`` naming the missing one);
    workers ensure their own pool's consumers (``ensure_pool_consumers``)."""
    try:
        for cfg in stream_configs(events_max_age_sec=events_max_age_sec, replicas=replicas):
            try:
                info = await js.stream_info(cfg.name)  # type: ignore[arg-type]
            except NotFoundError:
                if not manage:
                    raise Unavailable(f"nats stream {cfg.name} does not exist (yet): the api creates it") from None
                await js.add_stream(cfg)
                logger.info("created stream %s (replicas %s)", cfg.name, cfg.num_replicas)
                continue
            if not manage:
                continue
            have = info.config
            changed = {f: (getattr(have, f), getattr(cfg, f)) for f in _MANAGED
                       if _differs(getattr(have, f), getattr(cfg, f))}
            if changed:
                merged = have
                for f, (_old, new) in changed.items():
                    setattr(merged, f, new)
                await js.update_stream(merged)
                logger.warning("stream %s updated: %s", cfg.name,
                               ", ".join(f"{f} {old!r} -> {new!r}" for f, (old, new) in changed.items()))
        if manage:
            await _drop_legacy_consumer(js)
    except NatsError as exc:
        raise translate(exc) from exc


def _differs(have: Any, want: Any) -> bool:
    if isinstance(have, float | int) and isinstance(want, float | int):
        return abs(float(have) - float(want)) > 1e-6
    if isinstance(have, list) and isinstance(want, list):
        return sorted(have) != sorted(want)
    return bool(have != want)


async def _drop_legacy_consumer(js: JetStreamContext) -> None:
    try:
        await js.consumer_info(COMMANDS_STREAM, LEGACY_WORKER_CONSUMER)
    except NotFoundError:
        return
    await js.delete_consumer(COMMANDS_STREAM, LEGACY_WORKER_CONSUMER)
    # Its undelivered notices (``noetl.commands.{shard}``) stay in the stream, read by no one:
    # nobody may purge it; the queued commands they named are republished on their pools' subjects.
    logger.warning("deleted the pre-pool worker consumer %s: queued commands are republished on their pool's"
                   " subjects", LEGACY_WORKER_CONSUMER)


MAX_WAITING_PULLS = 16384


async def ensure_pool_consumers(js: JetStreamContext, pool: str, *, command_ack_wait_sec: float = 30.0) -> None:
    """Create the durable pull consumers of a pool's notices, one per priority, if missing
    (NATS errors come out as ``Unavailable``: the pre-pool consumer, until the api deletes
    it, makes the server refuse them)."""
    try:
        for priority in pools.PRIORITIES:
            name = pools.consumer_name(pool, priority)
            try:
                await js.consumer_info(COMMANDS_STREAM, name)
                continue
            except NotFoundError:
                pass
            await js.add_consumer(
                COMMANDS_STREAM,
                ConsumerConfig(
                    name=name,  # CONSUMER.CREATE.{stream}.{name}.{filter}: the worker may create only these
                    durable_name=name,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    ack_wait=command_ack_wait_sec,
                    max_ack_pending=-1,
                    # every idle slot of every worker of the pool keeps one pull request here
                    # (fetch_first); the server's default of 512 would refuse the 513th
                    max_waiting=MAX_WAITING_PULLS,
                    filter_subject=commands_filter(pool, priority),
                ),
            )
    except NatsError as exc:
        raise translate(exc) from exc


async def fetch_now(sub: JetStreamContext.PullSubscription, *, wait_sec: float = 5.0) -> Msg | None:
    """The next message of a pull consumer if it has one now, else None: a ``no_wait`` pull
    request of one message, which the server answers at once (a message, or a 404/408
    status). No request lingers on the server afterwards, so a worker holds a notice only
    while it has a slot for it. A message left in the subscription by an earlier request
    that timed out is returned first. NATS errors come out as ``Unavailable``."""
    inner = sub._sub
    assert inner is not None
    queue = inner._pending_queue
    while not queue.empty():
        msg = queue.get_nowait()
        inner._pending_size -= len(msg.data)
        if not JetStreamContext.is_status_msg(msg):
            return msg
    try:
        await sub._nc.publish(sub._nms, b'{"batch":1,"no_wait":true}', sub._deliver)
        msg = await inner.next_msg(timeout=wait_sec)
    except (NatsError, OSError, TimeoutError) as exc:
        raise translate(exc) from exc
    status = JetStreamContext.is_status_msg(msg)
    if not status:
        return msg
    if status in (StatusCode.NO_MESSAGES, StatusCode.REQUEST_TIMEOUT):
        return None
    raise Unavailable(f"nats pull from {sub._nms}: status {status} {msg.headers or ''}")


async def fetch_first(subs: list[JetStreamContext.PullSubscription], *, wait_sec: float,
                      wake: asyncio.Future[None] | None = None) -> Msg | None:
    """The first message any of several pull consumers delivers within ``wait_sec``, else
    None: one long pull request of one message per consumer, all answering to one fresh
    inbox, so the caller hears of a message as soon as the server stores it. Once one has
    arrived the other requests are withdrawn (UNSUB: the server drops a pull request nobody
    listens for; a PING/PONG later everything it sent before has arrived) and a message that
    crossed the withdrawal is nak'ed at once for another fetcher: nothing lingers on the
    server or in this process. The consumers' own subscriptions are unused but for their
    subjects. The connection being re-established meanwhile (the server forgot the
    requests) ends the wait at once (the reconnect signal of a connection ``connect()``
    made; on another, the requests' expiry ends it), and so does ``wake`` resolving (the
    caller has other work: the requests are withdrawn as above). NATS errors come out as
    ``Unavailable``."""
    nc: NATS = subs[0]._nc
    # woken by the signal, not by polling while idle
    reconnected = _RECONNECTED.get(nc) or asyncio.get_running_loop().create_future()
    inbox = nc.new_inbox()
    expires = int(wait_sec * 1e9)
    request = b'{"batch":1,"expires":%d}' % expires
    try:
        sub = await nc.subscribe(inbox)
        for pull in subs:
            await nc.publish(pull._nms, request, inbox)
    except (NatsError, OSError) as exc:
        raise translate(exc) from exc
    deadline = asyncio.get_running_loop().time() + wait_sec + 1.0
    open_requests = len(subs)
    refused = ""
    withdraw = True
    try:
        while open_requests:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return None  # requests lost with a NATS restart: the caller asks again
            try:
                msg = await _next_unless(sub, remaining, reconnected, wake)
                if msg is None:
                    return None  # reconnected (the requests died with the old connection) or woken
            except TimeoutError:
                return None
            except NatsError as exc:
                raise translate(exc) from exc
            status = JetStreamContext.is_status_msg(msg)
            if not status:
                return msg
            if status == StatusCode.CONTROL_MESSAGE:  # an idle heartbeat
                continue
            open_requests -= 1  # 408 expired, 409 (max waiting, consumer deleted, ...)
            if status != StatusCode.REQUEST_TIMEOUT:
                refused = f"{status} {msg.headers or ''}"
        withdraw = False  # every request has ended on the server
        if refused:
            raise Unavailable(f"nats pull of {len(subs)} consumers: status {refused}")
        return None
    finally:
        _spawn(_withdraw(nc, sub, server_side=withdraw))


async def _next_unless(sub: Any, wait_sec: float, reconnected: asyncio.Future[None],
                       wake: asyncio.Future[None] | None = None) -> Msg | None:
    """The subscription's next message within ``wait_sec`` (else TimeoutError), or None
    as soon as ``reconnected`` (or ``wake``) resolves. It reads the subscription's queue as
    ``next_msg`` does, with one task per wait where ``next_msg`` makes two and a uuid (the
    race with the reconnect signal then costs nothing extra per fetch). A message that
    arrives as the wait ends stays queued for the withdrawal to give back."""
    stops = (reconnected,) if wake is None else (reconnected, wake)
    if any(f.done() for f in stops):
        return None
    if sub._conn.is_closed:
        raise ConnectionClosedError
    queue: asyncio.Queue[Msg] = sub._pending_queue
    if queue.empty():
        getter = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait((getter, *stops), timeout=wait_sec, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()  # a message not taken yet stays queued
                await asyncio.wait((getter,))  # ended (cancelled, or with a message after all)
        if getter.cancelled():
            if any(f.done() for f in stops):
                return None
            raise TimeoutError
        msg = getter.result()
    else:
        msg = queue.get_nowait()
    sub._pending_size -= len(msg.data)
    queue.task_done()
    return msg


_withdrawals: set[asyncio.Task[None]] = set()


def _spawn(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _withdrawals.add(task)
    task.add_done_callback(_withdrawals.discard)


async def _withdraw(nc: NATS, sub: Any, *, server_side: bool) -> None:
    """End ``fetch_first``'s requests: UNSUB on the server first, keeping the subscription
    here until a PONG says every message sent before it has arrived; nak those."""
    try:
        if server_side and nc.is_connected:
            await nc._send_unsubscribe(sub._id)
            await nc.flush(timeout=5)
    except Exception as exc:  # a NATS restart drops the requests with the connection
        logger.debug("withdrawing pull requests: %s", exc)
    queue = sub._pending_queue
    while not queue.empty():
        msg = queue.get_nowait()
        if not JetStreamContext.is_status_msg(msg):
            with contextlib.suppress(Exception):
                await msg.nak()
    with contextlib.suppress(Exception):
        await sub.unsubscribe()


async def publish(js: JetStreamContext, subject: str, payload: bytes, *, msg_id: str | None = None,
                  headers: dict[str, str] | None = None, ack_wait: float = 5.0,
                  trace_parent: Context | None = None) -> Any:
    """Publish to JetStream and wait up to ``ack_wait`` seconds for the ack (the message is stored).
    A message with ``msg_id`` whose wait is ended by a reconnect is sent again at once (up
    to ``RECONNECT_REPUBLISHES`` times; the stream's duplicate window keeps one copy); one
    without raises ``Unavailable`` for its caller to decide. With tracing on, the publish
    is a producer span (child of ``trace_parent``, default the current context) whose
    ``traceparent`` travels in the message headers."""
    hdrs = dict(headers or {})
    if msg_id:
        hdrs["Nats-Msg-Id"] = msg_id
    with tracing.producer(subject, hdrs, msg_id=msg_id, parent=trace_parent) as span:
        for again in range(RECONNECT_REPUBLISHES, -1, -1):
            try:
                return await _acked(js, subject, payload, ack_wait, hdrs or None)
            except _ReconnectedWhileAwaiting as exc:
                # With a Msg-Id the stream keeps one copy (within its 120 s duplicate window), so the
                # message goes out again at once on the new connection; without one a second
                # copy could be stored, so the caller decides.
                if not msg_id or not again:
                    tracing.set_error(span, str(exc))
                    raise
            except (NatsError, OSError) as exc:
                tracing.set_error(span, f"{type(exc).__name__}: {exc}")
                raise translate(exc) from exc
    raise AssertionError("unreachable")  # the loop returns or raises


# How often publish() sends a message with a Msg-Id again when reconnects keep ending its
# wait for the ack (each try waits for the next reconnect at most, so this bounds a flapping
# server's cost, not a healthy one's).
RECONNECT_REPUBLISHES = 3


class _ReconnectedWhileAwaiting(Unavailable):
    """The connection was re-established while a publish awaited its ack."""


async def _acked(js: JetStreamContext, subject: str, payload: bytes, ack_wait: float,
                 headers: dict[str, str] | None) -> Any:
    """``js.publish``, except that the client re-establishing its connection while the ack
    is awaited ends the wait at once (``Unavailable``) instead of after ``ack_wait``: the
    server that was to answer is gone. The caller publishes again; with the same Msg-Id
    the stream keeps one copy if the first one was stored after all."""
    reconnected = _RECONNECTED.get(js._nc)
    if reconnected is None:  # a connection not made by connect(): no reconnect signal
        return await js.publish(subject, payload, timeout=ack_wait, headers=headers)
    ack = asyncio.ensure_future(js.publish(subject, payload, timeout=ack_wait, headers=headers))
    try:
        done, _ = await asyncio.wait((ack, reconnected), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller was cancelled
        ack.cancel()
        raise
    if ack in done:
        return ack.result()
    ack.cancel()
    raise _ReconnectedWhileAwaiting(f"nats reconnected while the publish on {subject} awaited its ack; "
                                    "publish it again")


async def send(nc: NATS, subject: str, payload: bytes, *, trace_parent: Context | None = None) -> None:
    """Publish on core NATS (no stream, no ack: delivered to whoever listens now, else
    dropped), raising ``Unavailable``. With tracing on, a producer span (child of
    ``trace_parent``) whose ``traceparent`` travels in the headers."""
    hdrs: dict[str, str] = {}
    with tracing.producer(subject, hdrs, parent=trace_parent):
        try:
            await nc.publish(subject, payload, headers=hdrs or None)
        except (NatsError, OSError) as exc:
            raise translate(exc) from exc


async def hint(nc: NATS, subject: str, payload: bytes = b"") -> None:
    """Publish a best-effort core-NATS hint. Hints only save latency (every reader has a
    polling backstop), so a failure is logged and swallowed."""
    try:
        await nc.publish(subject, payload)
    except (NatsError, OSError) as exc:
        logger.debug("hint on %s not sent: %s", subject, exc)
