"""The standard gRPC server metrics: the names, labels and label values of
go-grpc-prometheus (grpc-ecosystem), so that dashboards and alerts written for any gRPC
server of that ecosystem (``grpc_code!="OK"``, ``grpc_type="unary"``) read ours as they are.

    grpc_server_started_total{grpc_type, grpc_service, grpc_method}            counter
    grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code} counter
    grpc_server_handling_seconds{grpc_type, grpc_service, grpc_method}         histogram

``grpc_type`` is ``unary``, ``client_stream``, ``server_stream`` or ``bidi_stream``;
``grpc_code`` the status as Go spells it (``OK``, ``Canceled``, ``InvalidArgument``,
``DeadlineExceeded``, ...: ``CODE_NAMES``). A stream's handling time is its whole life (a
``WatchExecution`` lasts as long as its client watches): latency panels take
``grpc_type="unary"``. A call whose client went away or whose deadline passed counts as
``Canceled`` / ``DeadlineExceeded``.

Hand-written rather than taken from a library: docs/DEPLOY.md "gRPC metrics" says why,
with the per-call cost of each measured by ``scripts/measure_grpc_interceptors.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from .rpchandlers import rewrapped

LABELS = ("grpc_type", "grpc_service", "grpc_method")
STARTED = Counter("grpc_server_started_total", "Total number of RPCs started on the server.", LABELS)
HANDLED = Counter("grpc_server_handled_total",
                  "Total number of RPCs completed on the server, regardless of success or failure.",
                  (*LABELS, "grpc_code"))
HANDLING_SECONDS = Histogram(
    "grpc_server_handling_seconds",
    "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
    LABELS, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))

# grpc-go's codes.Code.String(): the label values every go-grpc-prometheus dashboard expects.
CODE_NAMES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
# Server-side failures (what the error-ratio alert and panels count; the caller's own
# mistakes, e.g. InvalidArgument or NotFound, are not the server's errors).
SERVER_ERROR_CODES = ("Unknown", "DeadlineExceeded", "Unimplemented", "Internal", "Unavailable", "DataLoss")
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_TYPES = {(False, False): "unary", (True, False): "client_stream", (False, True): "server_stream",
          (True, True): "bidi_stream"}


def status_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with: the code the handler set or aborted with; else OK
    when it returned, Canceled/DeadlineExceeded when it was cancelled, Unknown when an
    exception escaped (what grpc answers then)."""
    code: Any = context.code()
    if code:  # an int 0 (OK) until abort() or set_code() sets a StatusCode
        return code if isinstance(code, grpc.StatusCode) else _BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class _Series:
    """One method's children of the three metrics (looked up once, not per call)."""

    __slots__ = ("handled", "handling", "labels", "started")

    def __init__(self, method: str, handler: grpc.RpcMethodHandler) -> None:
        service, _, name = method.lstrip("/").rpartition("/")
        self.labels = (_TYPES[bool(handler.request_streaming), bool(handler.response_streaming)], service, name)
        self.started = STARTED.labels(*self.labels)
        self.handling = HANDLING_SECONDS.labels(*self.labels)
        self.handled: dict[grpc.StatusCode, Any] = {}

    def done(self, code: grpc.StatusCode, seconds: float) -> None:
        child = self.handled.get(code)
        if child is None:
            child = self.handled[code] = HANDLED.labels(*self.labels, CODE_NAMES.get(code, "Unknown"))
        child.inc()
        self.handling.observe(seconds)


class ServerMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every call of the server it is installed on, health checks and
    reflection included. Install it outside ``grpcutil.ErrorInterceptor``, the gate and
    auth, so it counts the codes the clients get."""

    def __init__(self) -> None:
        self._series: dict[str, _Series] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED, not counted (as in Go)
            return handler
        method = handler_call_details.method
        series = self._series.get(method)
        if series is None:
            series = self._series[method] = _Series(method, handler)

        if handler.unary_unary:
            return rewrapped(handler, unary_unary=_single(series, handler.unary_unary))
        if handler.unary_stream:
            return rewrapped(handler, unary_stream=_streaming(series, handler.unary_stream))
        if handler.stream_unary:
            return rewrapped(handler, stream_unary=_single(series, handler.stream_unary))
        if handler.stream_stream:
            return rewrapped(handler, stream_stream=_streaming(series, handler.stream_stream))
        return handler


def _single(series: _Series, inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A behaviour with one response (unary or client-streaming request), counted and timed."""

    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
        series.started.inc()
        start, exc = time.perf_counter(), None
        try:
            return await inner(request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            series.done(status_of(context, exc), time.perf_counter() - start)

    return behaviour


def _streaming(series: _Series, inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """A response-streaming behaviour counted and timed over the stream's whole life."""

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        series.started.inc()
        start, exc = time.perf_counter(), None
        try:
            async for item in inner(request, context):
                yield item
        except BaseException as e:
            exc = e
            raise
        finally:
            series.done(status_of(context, exc), time.perf_counter() - start)

    return stream


__all__ = ["CODE_NAMES", "HANDLED", "HANDLING_SECONDS", "SERVER_ERROR_CODES", "STARTED", "ServerMetricsInterceptor",
           "status_of"]
