"""gRPC server reflection under both of its names: ``grpc.reflection.v1`` (what grpcurl,
``buf curl`` and Postman ask first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection (1.85) serves only v1alpha. The v1 protocol is v1alpha renamed: the
same messages with the same fields and numbers in package ``grpc.reflection.v1``. So v1
is served here by v1alpha's servicer: its descriptor (v1alpha's file, package and type
names rewritten, ``V1_FILE``) is added to the default pool, so that reflection can
describe itself under both names, and its messages travel through v1alpha's classes,
whose wire format is the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as _v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as _pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as _pb_grpc

V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (V1, V1ALPHA)


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file descriptor, renamed to v1."""
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fd = descriptor_pb2.FileDescriptorProto()
    _pb.DESCRIPTOR.CopyToProto(fd)
    fd.name = V1_FILE
    fd.package = "grpc.reflection.v1"
    fd.options.Clear()
    fd.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    fd.options.java_package = "io.grpc.reflection.v1"
    fd.options.java_multiple_files = True
    for message in fd.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = new + f.type_name.removeprefix(old)
    for service in fd.service:
        for m in service.method:
            m.input_type = new + m.input_type.removeprefix(old)
            m.output_type = new + m.output_type.removeprefix(old)
    return fd


def register_v1_descriptor(pool: Any = None) -> None:
    """Add the v1 file to ``pool`` (the default pool) unless it is there already."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_v1_file().SerializeToString())


def enable(service_names: Iterable[str], server: Any) -> None:
    """Serve reflection v1 and v1alpha on ``server`` (a ``grpc.aio.Server`` or a blocking
    one), listing ``service_names`` and the two reflection services."""
    register_v1_descriptor()
    names = (*service_names, *SERVICE_NAMES)
    servicer: Any = (_v1alpha.aio.ReflectionServicer(names) if isinstance(server, grpc.aio.Server)
                     else _v1alpha.ReflectionServicer(names))
    _pb_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=_pb.ServerReflectionRequest.FromString,
        response_serializer=_pb.ServerReflectionResponse.SerializeToString)})
    server.add_generic_rpc_handlers((v1,))


__all__ = ["SERVICE_NAMES", "V1", "V1ALPHA", "V1_FILE", "enable", "register_v1_descriptor"]
