"""A request that protobuf cannot decode becomes INVALID_ARGUMENT with a message that
says why, not gRPC's UNKNOWN "Unexpected DecodeError".

The case that matters: a payload nested deeper than protobuf decoders allow (100
message levels; a ``google.protobuf.Struct`` spends three per JSON level, so about 32
levels: docs/CLIENTS.md "JSON values and numbers"). The method's deserializer is wrapped
so a failure yields a marker instead of raising, and the behaviour raises
``InvalidInput`` for the marker, which the error interceptor maps like any other.
Installed innermost, so the wrappers of the outer interceptors keep this deserializer.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from noetl_common.errors import InvalidInput
from noetl_common.rpchandlers import rewrapped

PROTOBUF_DEPTH = 100


class _Undecodable:
    def __init__(self, reason: str) -> None:
        self.reason = reason

    def error(self) -> InvalidInput:
        deep = "MaxDepth" in self.reason or "recursion" in self.reason.lower()
        why = (f"it nests deeper than protobuf's {PROTOBUF_DEPTH} message levels (a Struct payload nests at most "
               "32 JSON levels: docs/CLIENTS.md \"JSON values and numbers\")" if deep else self.reason)
        return InvalidInput(f"the request could not be decoded: {why}")


class UndecodableRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def safe(raw: bytes) -> Any:
            try:
                return decode(raw)
            except (DecodeError, RecursionError) as exc:
                return _Undecodable(str(exc))

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    raise request.error()
                return await inner(request, context)

            return rewrapped(handler, unary_unary=unary)._replace(request_deserializer=safe)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    raise request.error()
                out = inner_stream(request, context)
                if inspect.isasyncgen(out):
                    async for item in out:
                        yield item
                else:
                    await out

            return rewrapped(handler, unary_stream=stream)._replace(request_deserializer=safe)
        return handler
