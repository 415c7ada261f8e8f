"""A FAKE role program for the launcher's tests: a tiny gRPC server with grpc.health.v1
that writes its ready file like a real role, so process supervision (start order,
wiring, status, kill/restart, healing) is tested without the real roles.

Environment knobs (set through ``devstack.up(..., env=...)``): ``FAKE_FAIL_ROLE`` (exit 3
at start), ``FAKE_HANG_ROLE`` (never ready), ``FAKE_IGNORE_TERM_ROLE`` (ignore SIGTERM),
``FAKE_CHILD`` (start a ``sleep`` child), ``FAKE_HEALTH_DIR`` (the health status is read
from ``<dir>/<instance>`` when that file exists, e.g. ``NOT_SERVING``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

FAKE_ROLE = r'''
import json, os, signal, subprocess, sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

role = sys.argv[1]
env = os.environ
if env.get("FAKE_FAIL_ROLE") == role:
    print(f"{role}: cannot start: FAKE_FAIL_ROLE says so", flush=True)
    sys.exit(3)
stop = threading.Event()
if env.get("FAKE_IGNORE_TERM_ROLE") == role:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
if env.get("FAKE_HANG_ROLE") == role:
    print(f"{role}: hanging", flush=True)
    stop.wait()
    sys.exit(0)
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
if env.get("NOETL_TLS_CERT_FILE"):  # the local stack serves TLS: so does the fake
    creds = grpc.ssl_server_credentials([(open(env["NOETL_TLS_KEY_FILE"], "rb").read(),
                                          open(env["NOETL_TLS_CERT_FILE"], "rb").read())])
    port = server.add_secure_port(env["NOETL_GRPC_LISTEN"], creds)
else:
    port = server.add_insecure_port(env["NOETL_GRPC_LISTEN"])
server.start()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_file = os.path.join(env["FAKE_HEALTH_DIR"], env["NOETL_INSTANCE"]) if env.get("FAKE_HEALTH_DIR") else ""


def follow_health_file():
    current = "SERVING"
    while not stop.wait(0.05):
        try:
            wanted = open(health_file).read().strip() or "SERVING"
        except OSError:
            wanted = "SERVING"
        if wanted != current:
            servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(wanted))
            current = wanted


if health_file:
    threading.Thread(target=follow_health_file, daemon=True).start()
child = subprocess.Popen(["sleep", "600"]) if env.get("FAKE_CHILD") else None
ready = env["NOETL_READY_FILE"]
data = {"role": role, "pid": os.getpid(), "grpc": f"127.0.0.1:{port}", "metrics": f"127.0.0.1:{port + 1}",
        "runtime_id": os.getpid(), "instance": env["NOETL_INSTANCE"], "child": child.pid if child else 0,
        "env": {k: v for k, v in env.items() if k.startswith("NOETL_")}}
with open(ready + ".tmp", "w") as fh:
    json.dump(data, fh)
os.replace(ready + ".tmp", ready)
print(f"{role} serving on {port}", flush=True)
stop.wait()
server.stop(0.2).wait()
'''


def write_fake_role(directory: Path) -> Path:
    path = directory / "fake_role.py"
    path.write_text(FAKE_ROLE)
    return path


def command_for(fake: Path) -> Callable[[str], Sequence[str]]:
    return lambda role: [sys.executable, str(fake), role]
