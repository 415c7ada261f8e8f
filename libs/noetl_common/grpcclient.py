"""What a gRPC client of the runtime needs and nothing more (the CLI imports this instead
of ``grpcutil``/``auth``, whose servers' plumbing pulls in Postgres, NATS, tracing and
settings: imports a one-RPC command does not need; docs/ARCHITECTURE.md "CLI start-up").
``grpcutil`` and ``auth`` re-export these names.

Status codes become the project's errors here, once (``translate``); ``translating(stub)``
is a stub whose calls raise those errors instead of ``grpc.RpcError``, so code behind it
(the worker) handles ``NoetlError`` subclasses only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc

from .errors import (
    ConfigError,
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

S = TypeVar("S")

METADATA_KEY = "authorization"

# A peer that stops answering (SIGSTOP, a VM pause, a partition) still holds its TCP
# connections open: only HTTP/2 keepalive pings tell. While a call is in flight, a ping
# goes out after KEEPALIVE_MS without data and the connection is dropped when its ack
# does not come within KEEPALIVE_TIMEOUT_MS, so the call fails UNAVAILABLE, is retried on
# another replica, and round robin stops picking the frozen one (its reconnect never
# completes the HTTP/2 handshake).
KEEPALIVE_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
CLIENT_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # One ping is outstanding at a time: any ping (a BDP probe right after a call too) must
    # time out as fast as a keepalive ping, or it holds the keepalive back for its default
    # minute (measured: a frozen replica held every call routed to it for the call's
    # whole deadline).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]
# Servers accept those pings (the default policy answers a ping more often than every
# 5 minutes without data with GOAWAY "too_many_pings").
SERVER_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


def tls_target_name(target: str) -> str:
    """The name to verify the servers of an address-list target by (``ipv4:H:P1,H:P2``:
    gRPC would check the whole list as one name); "" for other targets (gRPC checks the
    target's own host)."""
    scheme, _, addresses = target.partition(":")
    if scheme not in ("ipv4", "ipv6") or not addresses:
        return ""
    first = addresses.split(",")[0]
    host = first.rsplit(":", 1)[0] if first.count(":") == 1 or first.startswith("[") else first
    return host.strip("[]")


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def translate(exc: grpc.RpcError) -> NoetlError:
    """Map a client-side RpcError to the project's tree (UNAVAILABLE and DEADLINE_EXCEEDED,
    the transient statuses of ``grpcretry``, become Unavailable)."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    mapping: dict[Any, type[NoetlError]] = {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
        grpc.StatusCode.FAILED_PRECONDITION: Conflict,
        grpc.StatusCode.ALREADY_EXISTS: Conflict,
        grpc.StatusCode.ABORTED: LeaseLost,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
        grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
        grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    }
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(detail or "overloaded")
    return mapping.get(code, NoetlError)(detail or str(code))


def translating(stub: S) -> S:
    """``stub`` (a generated aio stub) whose calls raise ``translate(exc)`` (chained with
    ``from``) instead of ``grpc.RpcError``: a unary call is awaited as before, a streaming
    call is iterated (``async for``) and cancelled (``cancel()``) as before. Wrapping a
    wrapped stub returns it unchanged."""
    if isinstance(stub, _Translating):
        return stub
    return _Translating(stub)  # type: ignore[return-value]


class _Translating:
    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            rpc = method(*args, **kwargs)
            if hasattr(rpc, "__aiter__"):  # a server-streaming call
                return _TranslatedStream(rpc)
            return _translated(rpc)

        setattr(self, name, call)  # built once per method
        return call


async def _translated(rpc: Awaitable[Any]) -> Any:
    try:
        return await rpc
    except grpc.RpcError as exc:
        raise translate(exc) from exc


class _TranslatedStream:
    def __init__(self, rpc: Any) -> None:
        self._rpc = rpc

    def cancel(self) -> bool:
        return bool(self._rpc.cancel())

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for item in self._rpc:
                yield item
        except grpc.RpcError as exc:
            raise translate(exc) from exc


class SyncClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """The blocking-channel twin (``grpc.intercept_channel(channel, SyncClientAuth(token))``)."""

    def __init__(self, token: str) -> None:
        self._md = (METADATA_KEY, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), self._md],
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
