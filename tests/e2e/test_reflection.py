"""gRPC reflection v1 and v1alpha on every role's port (and the api's worker port) of a
real stack, TLS on: ``buf curl`` (a reflection client that is not ours) lists the
services over v1, and a v1 request describes a service of the role's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from noetl_cli import devstack
from noetl_common import reflection

pytestmark = pytest.mark.e2e

# A service each role serves besides health and reflection (the worker: none but those).
EXPECTED = {
    "api": "noetl.v1.ExecutionService",
    "shard-manager": "noetl.v1.ShardManagerService",
    "worker": "grpc.health.v1.Health",
}


def buf() -> str:
    found = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(found).exists():
        pytest.skip("buf is not installed (the dev extra's buf-bin)")
    return found


def targets(stack: devstack.StackState) -> list[tuple[str, str, str]]:
    """(name, address, a service it must list) of every gRPC port of the stack."""
    found = [(p.instance, p.grpc, EXPECTED.get(p.role, "grpc.health.v1.Health")) for p in stack.processes()]
    found += [(f"{p.instance} (worker api)", p.worker_grpc, "noetl.v1.WorkerService")
              for p in stack.processes("api") if p.worker_grpc]
    assert len(found) >= 8, found
    return found


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_buf_curl_lists_the_services_of_every_port_by_reflection(stack: devstack.StackState, protocol: str) -> None:
    for name, address, service in targets(stack):
        out = subprocess.run([buf(), "curl", "--protocol", "grpc", "--reflect-protocol", protocol, "--cacert",
                              stack.ca_file, "--list-services", f"https://{address}"],
                             capture_output=True, text=True, timeout=60)
        listed = out.stdout.split()
        assert out.returncode == 0, (name, out.stderr)
        assert service in listed and reflection.V1 in listed and reflection.V1ALPHA in listed, (name, listed)


def v1_classes() -> tuple[type, type]:
    reflection.register_v1_descriptor()
    pool = descriptor_pool.Default()
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse")))


def test_a_v1_request_describes_the_execution_service_with_its_dependencies(stack: devstack.StackState) -> None:
    request_cls, response_cls = v1_classes()
    creds = grpc.ssl_channel_credentials(Path(stack.ca_file).read_bytes())
    with grpc.secure_channel(stack.api, creds) as channel:  # no token: reflection is open
        call = channel.stream_stream(f"/{reflection.V1}/ServerReflectionInfo",
                                     request_serializer=request_cls.SerializeToString,
                                     response_deserializer=response_cls.FromString)
        asked = [request_cls(list_services=""),
                 request_cls(file_containing_symbol="noetl.v1.ExecutionService"),
                 request_cls(file_containing_symbol="noetl.v1.NoSuchService")]
        listed, described, missing = list(call(iter(asked), timeout=30))
    assert {s.name for s in listed.list_services_response.service} >= {
        "noetl.v1.ExecutionService", "noetl.v1.CatalogService", reflection.V1, reflection.V1ALPHA}
    files = {descriptor_pb2.FileDescriptorProto.FromString(b).name
             for b in described.file_descriptor_response.file_descriptor_proto}
    assert {"noetl/v1/execution.proto", "noetl/v1/common.proto", "google/protobuf/timestamp.proto"} <= files
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
