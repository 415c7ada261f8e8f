"""One helper for the server interceptors (``grpcmetrics.ServerMetricsInterceptor``,
``grpcutil.ErrorInterceptor``, ``tracing.ServerInterceptor``, ``auth.AuthInterceptor``): a
method handler whose behaviours are replaced by wrappers, keeping the original's
(de)serializers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


def rewrapped(handler: grpc.RpcMethodHandler, *, unary_unary: Callable[..., Any] | None = None,
              unary_stream: Callable[..., Any] | None = None, stream_unary: Callable[..., Any] | None = None,
              stream_stream: Callable[..., Any] | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by whichever of the four is given; with none
    given, ``handler`` as it is."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    if stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
    return handler
