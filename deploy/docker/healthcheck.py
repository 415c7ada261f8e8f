"""grpc.health.v1 check of this container's own server, for Docker's HEALTHCHECK.

Kubernetes does not need it (the chart uses native gRPC probes); docker run / compose do.
Exit 0 when the overall service ("") answers SERVING on the port of NOETL_GRPC_LISTEN.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

port = os.environ.get("NOETL_GRPC_LISTEN", "0.0.0.0:50051").rsplit(":", 1)[-1]
try:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
except grpc.RpcError as exc:
    print(f"unhealthy: {exc.code().name}", file=sys.stderr)
    sys.exit(1)
ok = reply.status == health_pb2.HealthCheckResponse.SERVING
print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
sys.exit(0 if ok else 1)
