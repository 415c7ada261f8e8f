"""gRPC plumbing: the one place project errors become status codes (server side) and
status codes become project errors (client side). The per-method metrics are
``grpcmetrics``'.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from . import auth, grpcretry, tracing
from .config import TlsSettings
from .errors import (
    Conflict,
    InvalidInput,
    LeaseLost,
    NoetlError,
    NotFound,
    Overloaded,
    PermissionDenied,
    Unavailable,
    Unimplemented,
)
from .grpcclient import (  # noqa: F401  (re-exported: one home, the light module)
    CLIENT_KEEPALIVE_OPTIONS,
    KEEPALIVE_MS,
    KEEPALIVE_TIMEOUT_MS,
    SERVER_KEEPALIVE_OPTIONS,
    tls_target_name,
    translate,
)
from .grpcclient import read_file as _read
from .rpchandlers import rewrapped

logger = logging.getLogger(__name__)


def pending_call_options(most: int) -> list[tuple[str, int]]:
    """A server's options that let it hold ``most`` calls its application has not taken up
    yet (NOETL_GRPC_MAX_PENDING_CALLS) before gRPC cancels new ones at random, and all of
    them past twice that."""
    return [("grpc.server.max_pending_requests", most), ("grpc.server.max_pending_requests_hard_limit", 2 * most)]


STATUS_FOR: list[tuple[type[NoetlError], grpc.StatusCode]] = [
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LeaseLost, grpc.StatusCode.ABORTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
]

def set_timestamp(field: Timestamp, value: datetime | None) -> None:
    """Set a message's Timestamp field from a datetime; ``None`` leaves the field unset."""
    if value is not None:
        field.FromDatetime(value)


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_FOR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps NoetlError to its status code (and any other exception to INTERNAL, logged)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 2)[-2:]
        name = "/".join(method)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                except NoetlError as exc:
                    await _abort(context, status_for(exc), exc)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    logger.exception("unhandled error in %s", name)
                    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

            return rewrapped(handler, unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in inner_us(request, context):
                        yield item
                except NoetlError as exc:
                    await _abort(context, status_for(exc), exc)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    logger.exception("unhandled error in %s", name)
                    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

            return rewrapped(handler, unary_stream=unary_stream)
        return handler


# Always answered, whatever the gate says: a role that is down for its dependencies must
# still say so, and be discoverable.
_UNGATED = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class GateInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAVAILABLE at once, naming why, while ``closed()`` returns a reason (e.g.
    Postgres is unreachable): a client learns what is wrong in milliseconds instead of
    waiting out a pool timeout. Health and reflection are never gated."""

    def __init__(self, closed: Callable[[], str | None]) -> None:
        self._closed = closed

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_UNGATED):
            return handler
        gate = self._closed

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                reason = gate()
                if reason:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
                return await inner_uu(request, context)

            return rewrapped(handler, unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                reason = gate()
                if reason:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
                async for item in inner_us(request, context):
                    yield item

            return rewrapped(handler, unary_stream=unary_stream)
        return handler


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, exc: NoetlError) -> None:
    if isinstance(exc, Overloaded):
        await context.send_initial_metadata((("retry-after", f"{exc.retry_after:.3f}"),))
    await context.abort(code, str(exc))


# ------------------------------------------------------------------ client side


def channel(target: str, *, token: str = "", tls: TlsSettings | None = None) -> grpc.aio.Channel:
    """An aio channel with round-robin balancing, transparent retries on UNAVAILABLE of
    the idempotent methods only (a replica died: the call goes to another one;
    ``grpcretry.service_config``) and keepalive pings that drop a frozen
    replica within seconds; every call carries ``token`` (bearer) when given, and goes
    over TLS when ``tls`` has a CA (presenting this process's certificate when it has
    one: mutual TLS). Targets may list several replicas: ``ipv4:127.0.0.1:P1,127.0.0.1:P2``.
    With tracing on, every unary call gets a client span whose context travels in the
    call's metadata."""
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", grpcretry.service_config()),
        ("grpc.enable_retries", 1),
        *CLIENT_KEEPALIVE_OPTIONS,
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ]
    interceptors = [*tracing.client_interceptors(), *auth.client_interceptors(token)]
    creds = client_credentials(tls)
    if creds is None:
        return grpc.aio.insecure_channel(target, interceptors=interceptors, options=options)
    assert tls is not None
    server_name = tls.server_name or tls_target_name(target)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, creds, interceptors=interceptors, options=options)


def client_credentials(tls: TlsSettings | None) -> grpc.ChannelCredentials | None:
    """TLS credentials of a client (None: plaintext): trust ``ca_file``; present
    ``cert_file`` when set (servers that require client certificates accept it)."""
    if tls is None or not tls.ca_file:
        return None
    key = _read(tls.key_file) if tls.key_file else None
    cert = _read(tls.cert_file) if tls.cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file), private_key=key,
                                        certificate_chain=cert)


def server_credentials(tls: TlsSettings | None) -> grpc.ServerCredentials | None:
    """TLS credentials of a server (None: plaintext); with ``client_auth`` every client must
    present a certificate signed by ``ca_file``."""
    if tls is None or not tls.cert_file:
        return None
    ca = _read(tls.ca_file) if tls.ca_file else None
    return grpc.ssl_server_credentials([(_read(tls.key_file), _read(tls.cert_file))], root_certificates=ca,
                                       require_client_auth=bool(tls.client_auth))
