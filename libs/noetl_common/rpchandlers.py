"""One helper for the server interceptors (``grpcutil.ErrorInterceptor``,
``tracing.ServerInterceptor``): a method handler whose behaviours are replaced by
wrappers, keeping the original's (de)serializers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


def rewrapped(handler: grpc.RpcMethodHandler, *, unary_unary: Callable[..., Any] | None = None,
              unary_stream: Callable[..., Any] | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with its unary-unary or unary-stream behaviour replaced (whichever is
    given); other kinds of handlers are returned as they are."""
    if unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
    if unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
    return handler
