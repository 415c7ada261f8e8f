"""NATS JetStream: connection, the two streams, subjects. nats errors are translated here.

Streams:
  NOETL_EVENTS   ``noetl.events.{shard}.{kind}``  everything a shard's engine consumes
                 (worker results, submission nudges, cancels, expiries, barriers).
                 Limits retention: engines read it with an ordered consumer per owned
                 shard from the stream position recorded in their lease row.
  NOETL_COMMANDS ``noetl.commands.{shard}``       command notifications; work-queue
                 retention, one durable pull consumer shared by every worker.

Core (non-JetStream) subjects carry hints only, never facts:
  ``noetl.progress.{execution_id}``  the read model of an execution changed
  ``noetl.projector.{shard}``        new events were appended to a shard
  ``noetl.checkpointer.{shard}``     the projection passed a checkpoint barrier of a shard
  ``noetl.cancel.{shard}``           commands were cancelled: {"command_ids": [...]}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError
from opentelemetry.context import Context

from . import tracing
from .errors import NoetlError, Unavailable

logger = logging.getLogger(__name__)

EVENTS_STREAM = "NOETL_EVENTS"
COMMANDS_STREAM = "NOETL_COMMANDS"
WORKER_CONSUMER = "noetl-workers"

# Event kinds (the last subject token).
KIND_CALL = "call"
KIND_SUBMIT = "submit"
KIND_CANCEL = "cancel"
KIND_EXPIRED = "expired"
KIND_BARRIER = "barrier"


def events_subject(shard: int, kind: str) -> str:
    return f"noetl.events.{shard}.{kind}"


def events_filter(shard: int) -> str:
    return f"noetl.events.{shard}.>"


def commands_subject(shard: int) -> str:
    return f"noetl.commands.{shard}"


def progress_subject(execution_id: int) -> str:
    return f"noetl.progress.{execution_id}"


def projector_subject(shard: int) -> str:
    return f"noetl.projector.{shard}"


def checkpointer_subject(shard: int) -> str:
    return f"noetl.checkpointer.{shard}"


def cancel_subject(shard: int) -> str:
    return f"noetl.cancel.{shard}"


def translate(exc: BaseException) -> NoetlError:
    if isinstance(exc, NoetlError):
        return exc
    return Unavailable(f"nats error: {type(exc).__name__}: {exc}")


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


async def connect(url: str, *, name: str, reconnects: Reconnects | None = None) -> NATS:
    """Connect with unbounded reconnects (every 0.5 s); the caller closes with ``await
    nc.drain()``. ``reconnects`` is told about every reconnection."""

    async def on_error(exc: Exception) -> None:
        logger.warning("nats error: %s", exc)

    async def on_disconnect() -> None:
        logger.warning("nats disconnected")

    async def on_reconnect() -> None:
        logger.info("nats reconnected")
        if reconnects is not None:
            reconnects.reconnected()

    try:
        return await nats.connect(
            servers=[u.strip() for u in url.split(",") if u.strip()],
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            pending_size=64 * 1024 * 1024,
        )
    except (NatsError, OSError) as exc:
        raise translate(exc) from exc


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
                         command_ack_wait_sec: float = 30.0, replicas: int = 1) -> None:
    """Create the streams and the shared worker consumer when missing (idempotent). An
    existing stream is updated only where a managed setting differs from the wanted one
    (logged), so every role's start does not re-apply, and undo, an operator's changes
    to the rest of its configuration."""
    try:
        for cfg in stream_configs(events_max_age_sec=events_max_age_sec, replicas=replicas):
            try:
                info = await js.stream_info(cfg.name)  # type: ignore[arg-type]
            except NotFoundError:
                await js.add_stream(cfg)
                logger.info("created stream %s (replicas %s)", cfg.name, cfg.num_replicas)
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
        await ensure_worker_consumer(js, command_ack_wait_sec=command_ack_wait_sec)
    except NatsError as exc:
        raise translate(exc) from exc


def _differs(have: Any, want: Any) -> bool:
    if isinstance(have, float | int) and isinstance(want, float | int):
        return abs(float(have) - float(want)) > 1e-6
    if isinstance(have, list) and isinstance(want, list):
        return sorted(have) != sorted(want)
    return bool(have != want)


async def ensure_worker_consumer(js: JetStreamContext, *, command_ack_wait_sec: float = 30.0) -> None:
    """Create the durable pull consumer every worker shares, if it is missing."""
    try:
        await js.consumer_info(COMMANDS_STREAM, WORKER_CONSUMER)
        return
    except NotFoundError:
        pass
    await js.add_consumer(
        COMMANDS_STREAM,
        ConsumerConfig(
            durable_name=WORKER_CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=command_ack_wait_sec,
            max_ack_pending=-1,
            filter_subject="noetl.commands.>",
        ),
    )


async def publish(js: JetStreamContext, subject: str, payload: bytes, *, msg_id: str | None = None,
                  headers: dict[str, str] | None = None, ack_wait: float = 5.0,
                  trace_parent: Context | None = None) -> Any:
    """Publish to JetStream and wait up to ``ack_wait`` seconds for the ack (the message is stored).
    With tracing on, the publish is a producer span (child of ``trace_parent``, default the
    current context) whose ``traceparent`` travels in the message headers."""
    hdrs = dict(headers or {})
    if msg_id:
        hdrs["Nats-Msg-Id"] = msg_id
    with tracing.producer(subject, hdrs, msg_id=msg_id, parent=trace_parent) as span:
        try:
            return await js.publish(subject, payload, timeout=ack_wait, headers=hdrs or None)
        except (NatsError, OSError) as exc:
            tracing.set_error(span, f"{type(exc).__name__}: {exc}")
            raise translate(exc) from exc


async def hint(nc: NATS, subject: str, payload: bytes = b"") -> None:
    """Publish a best-effort core-NATS hint. Hints only save latency (every reader has a
    polling backstop), so a failure is logged and swallowed."""
    try:
        await nc.publish(subject, payload)
    except (NatsError, OSError) as exc:
        logger.debug("hint on %s not sent: %s", subject, exc)
