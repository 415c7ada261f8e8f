"""A role serving TLS also serves grpc.health.v1 alone on a plaintext port when
NOETL_HEALTH_LISTEN is set (the kubelet's gRPC probes cannot speak TLS): there, health
answers and nothing else is served; the main port refuses plaintext."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from waiting import until

from noetl_cli import stackcerts
from noetl_cli.supervise import health_check
from noetl_common.config import CoreSettings, ShardSettings, TlsSettings
from noetl_common.service import Service


class Probe(Service):
    role = "probe"
    joins = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_health_alone_on_a_plaintext_port_beside_a_tls_server(tmp_path: Path) -> None:
    certs = stackcerts.ensure(tmp_path)
    health = f"127.0.0.1:{free_port()}"
    svc = Probe(CoreSettings(health_listen=health, instance="probe-0"), ShardSettings())
    svc.configure_security(svc.auth, TlsSettings(ca_file=str(certs["ca"]), cert_file=str(certs["cert"]),
                                                 key_file=str(certs["key"])))
    runner = asyncio.ensure_future(svc.run())
    try:
        await until(lambda: svc.grpc_address, timeout=10, what="the probe's gRPC address", interval=0.02)
        ca = str(certs["ca"])
        checks = await asyncio.to_thread(lambda: (health_check(health, 3), health_check(svc.grpc_address, 3),
                                                  health_check(svc.grpc_address, 3, ca)))
        assert checks == ("SERVING", "UNREACHABLE", "SERVING"), checks
    finally:
        svc.request_stop()
        await asyncio.wait_for(runner, 20)


async def test_a_replica_list_target_verifies_each_replica_by_its_address(tmp_path: Path) -> None:
    """``ipv4:H:P1,H:P2`` (the local stack's several shard-managers): gRPC would check the
    whole list as one host name; the channel verifies each replica as H."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from noetl_common import grpcutil

    certs = stackcerts.ensure(tmp_path)
    tls = TlsSettings(ca_file=str(certs["ca"]), cert_file=str(certs["cert"]), key_file=str(certs["key"]))
    probes = [Probe(CoreSettings(instance=f"probe-{i}"), ShardSettings()) for i in range(2)]
    runners = []
    for svc in probes:
        svc.configure_security(svc.auth, tls)
        runners.append(asyncio.ensure_future(svc.run()))
    try:
        await until(lambda: all(svc.grpc_address for svc in probes), timeout=10,
                    what="both probes' gRPC addresses", interval=0.02)
        target = "ipv4:" + ",".join(svc.grpc_address for svc in probes)
        channel = grpcutil.channel(target, tls=TlsSettings(ca_file=str(certs["ca"])))
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(4):  # round robin: both replicas answer
                answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await channel.close()
    finally:
        for svc in probes:
            svc.request_stop()
        for runner in runners:
            await asyncio.wait_for(runner, 20)
