"""gRPC plumbing: the one place project errors become status codes (server side) and
status codes become project errors (client side), plus RED metrics per method.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import Counter, Histogram

from . import tracing
from .errors import (
    Conflict,
    InvalidInput,
    LeaseLost,
    NoetlError,
    NotFound,
    Overloaded,
    Unavailable,
)
from .rpchandlers import rewrapped

logger = logging.getLogger(__name__)

STATUS_FOR: list[tuple[type[NoetlError], grpc.StatusCode]] = [
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LeaseLost, grpc.StatusCode.ABORTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
]

GRPC_REQUESTS = Counter("noetl_grpc_requests_total", "gRPC requests served", ["method", "code"])
GRPC_SECONDS = Histogram(
    "noetl_grpc_request_seconds", "gRPC request duration (server side)", ["method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


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
    """Maps NoetlError to its status code and records RED metrics for every method."""

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
                start = time.perf_counter()
                code = grpc.StatusCode.OK
                try:
                    return await inner_uu(request, context)
                except NoetlError as exc:
                    code = status_for(exc)
                    await _abort(context, code, exc)
                except grpc.aio.AbortError:
                    code = context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[assignment]
                    raise
                except Exception as exc:
                    code = grpc.StatusCode.INTERNAL
                    logger.exception("unhandled error in %s", name)
                    await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
                finally:
                    GRPC_REQUESTS.labels(name, code.name).inc()
                    GRPC_SECONDS.labels(name).observe(time.perf_counter() - start)

            return rewrapped(handler, unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                code = grpc.StatusCode.OK
                try:
                    async for item in inner_us(request, context):
                        yield item
                except NoetlError as exc:
                    code = status_for(exc)
                    await _abort(context, code, exc)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    code = grpc.StatusCode.INTERNAL
                    logger.exception("unhandled error in %s", name)
                    await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
                finally:
                    GRPC_REQUESTS.labels(name, code.name).inc()

            return rewrapped(handler, unary_stream=unary_stream)
        return handler


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, exc: NoetlError) -> None:
    if isinstance(exc, Overloaded):
        await context.send_initial_metadata((("retry-after", f"{exc.retry_after:.3f}"),))
    await context.abort(code, str(exc))


# ------------------------------------------------------------------ client side

_SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{}],
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
})


def channel(target: str) -> grpc.aio.Channel:
    """An insecure aio channel with round-robin balancing and transparent retries on
    UNAVAILABLE (a replica died: the call goes to another one). Targets may list
    several replicas: ``ipv4:127.0.0.1:P1,127.0.0.1:P2``. With tracing on, every unary
    call gets a client span whose context travels in the call's metadata."""
    return grpc.aio.insecure_channel(
        target,
        interceptors=tracing.client_interceptors(),
        options=[
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ],
    )


def translate(exc: grpc.RpcError) -> NoetlError:
    """Map a client-side RpcError to the project's tree."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    mapping: dict[Any, type[NoetlError]] = {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: Conflict,
        grpc.StatusCode.ALREADY_EXISTS: Conflict,
        grpc.StatusCode.ABORTED: LeaseLost,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
        grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    }
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(detail or "overloaded")
    return mapping.get(code, NoetlError)(detail or str(code))
