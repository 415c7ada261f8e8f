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

# one definition of the client side (keepalive, the token's metadata, TLS names, the
# blocking channel's token interceptor), in the client package; re-exported here
from noetl_client.channel import (  # noqa: F401
    CLIENT_KEEPALIVE_OPTIONS,
    KEEPALIVE_MS,
    KEEPALIVE_TIMEOUT_MS,
    METADATA_KEY,
    SyncClientAuth,
    tls_target_name,
)

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

# Servers accept those pings (the default policy answers a ping more often than every
# 5 minutes without data with GOAWAY "too_many_pings").
SERVER_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


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


