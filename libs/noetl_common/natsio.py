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


async def connect(url: str, *, name: str) -> NATS:
    """Connect with unbounded reconnects; the caller closes with ``await nc.drain()``."""

    async def on_error(exc: Exception) -> None:
        logger.warning("nats error: %s", exc)

    async def on_disconnect() -> None:
        logger.warning("nats disconnected")

    async def on_reconnect() -> None:
        logger.info("nats reconnected")

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


async def ensure_streams(js: JetStreamContext, *, events_max_age_sec: float = 7 * 86400,
                         command_ack_wait_sec: float = 30.0) -> None:
    """Create or update the streams and the shared worker consumer (idempotent)."""
    wanted: list[StreamConfig] = [
        StreamConfig(
            name=EVENTS_STREAM,
            subjects=["noetl.events.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=events_max_age_sec,
            duplicate_window=120.0,
        ),
        StreamConfig(
            name=COMMANDS_STREAM,
            subjects=["noetl.commands.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120.0,
        ),
    ]
    try:
        for cfg in wanted:
            try:
                await js.stream_info(cfg.name)  # type: ignore[arg-type]
                await js.update_stream(cfg)
            except NotFoundError:
                await js.add_stream(cfg)
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
    except NatsError as exc:
        raise translate(exc) from exc


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
