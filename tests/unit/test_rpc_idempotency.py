"""Every RPC of every service in proto/ is classified once (grpcretry): idempotent, keyed
(repeatable only with an idempotency key) or not idempotent; the channels' service config
retries exactly the idempotent ones. A new RPC cannot slip in unclassified."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

import noetl_proto.v1
from noetl_common import grpcretry
from noetl_common.errors import NotFound, Unavailable
from noetl_proto.v1 import execution_pb2

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto" / "noetl" / "v1"
CLASSES = {"idempotent": grpcretry.IDEMPOTENT, "keyed": grpcretry.KEYED, "not idempotent": grpcretry.NOT_IDEMPOTENT}
# Served by every role, not defined in proto/ (grpc_health).
OUTSIDE_PROTOS = {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}


def method_descriptors() -> dict[str, Any]:
    """Every method of every service of the generated modules (``make proto``), by full name."""
    out = {}
    for info in pkgutil.iter_modules(noetl_proto.v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"noetl_proto.v1.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            out.update({f"/{service.full_name}/{m.name}": m for m in service.methods})
    return out


def proto_methods() -> set[str]:
    return set(method_descriptors())


def test_the_generated_services_are_the_services_in_the_proto_files() -> None:
    services = {f"noetl.v1.{name}" for path in PROTO_DIR.glob("*.proto")
                for name in re.findall(r"^service (\w+) \{", path.read_text(), re.MULTILINE)}
    rpcs = {f"{service}/{rpc}" for path in PROTO_DIR.glob("*.proto")
            for block in re.findall(r"^service (\w+) \{(.*?)^\}", path.read_text(), re.MULTILINE | re.DOTALL)
            for service in [f"noetl.v1.{block[0]}"] for rpc in re.findall(r"^\s*rpc (\w+)\(", block[1], re.MULTILINE)}
    assert services and {m.strip("/").rsplit("/", 1)[0] for m in proto_methods()} == services
    assert {m.strip("/") for m in proto_methods()} == rpcs


def test_every_rpc_is_classified_exactly_once() -> None:
    methods = proto_methods()
    classified = [m for group in CLASSES.values() for m in group]
    assert len(classified) == len(set(classified)), "a method is in two classes"
    unclassified = methods - set(classified)
    assert not unclassified, f"classify these RPCs in clients/python/noetl_client/retries.py: {sorted(unclassified)}"
    assert set(classified) - methods == OUTSIDE_PROTOS, "a classified method no proto defines"


def test_the_keyed_methods_carry_an_idempotency_key() -> None:
    methods = method_descriptors()
    for method in grpcretry.KEYED:
        assert grpcretry.KEY_FIELD in methods[method].input_type.fields_by_name, method


def test_the_channel_retries_only_idempotent_methods_on_unavailable() -> None:
    config = json.loads(grpcretry.service_config())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    [method_config] = config["methodConfig"]
    named = {f"/{n['service']}/{n['method']}" for n in method_config["name"]}
    assert named == grpcretry.IDEMPOTENT
    assert all(set(n) == {"service", "method"} for n in method_config["name"])  # no {} default entry
    assert "/noetl.v1.ExecutionService/SubmitExecution" not in named
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def test_a_submission_is_repeatable_only_with_a_key() -> None:
    assert not grpcretry.has_key(execution_pb2.SubmitExecutionRequest())
    assert grpcretry.has_key(execution_pb2.SubmitExecutionRequest(idempotency_key="k"))
    assert grpcretry.has_key(execution_pb2.RerunExecutionRequest(idempotency_key="k"))
    assert not grpcretry.has_key(execution_pb2.GetExecutionRequest())


def rpc_error(code: grpc.StatusCode) -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{code.name} here")


class Calls:
    """A blocking call that fails with ``codes`` in turn, then answers "ok"."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.timeouts: list[float] = []

    def __call__(self, timeout: float) -> Any:
        self.timeouts.append(timeout)
        if self.codes:
            raise rpc_error(self.codes.pop(0))
        return "ok"


def test_call_keyed_repeats_a_keyed_request_on_transient_failures_only() -> None:
    keyed = execution_pb2.SubmitExecutionRequest(idempotency_key="k")
    calls = Calls(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    assert grpcretry.call_keyed(calls, keyed, timeout=10, sleep=lambda s: None) == "ok"
    assert len(calls.timeouts) == 3 and all(0 < t <= 10 for t in calls.timeouts)

    calls = Calls(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError):  # no key: one call
        grpcretry.call_keyed(calls, execution_pb2.SubmitExecutionRequest(), timeout=10, sleep=lambda s: None)
    assert len(calls.timeouts) == 1

    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.INTERNAL):
        calls = Calls(code)
        with pytest.raises(grpc.RpcError):
            grpcretry.call_keyed(calls, keyed, timeout=10, sleep=lambda s: None)
        assert len(calls.timeouts) == 1, code

    calls = Calls(*[grpc.StatusCode.UNAVAILABLE] * 10)
    with pytest.raises(grpc.RpcError):
        grpcretry.call_keyed(calls, keyed, timeout=10, sleep=lambda s: None)
    assert len(calls.timeouts) == grpcretry.MAX_ATTEMPTS


def test_call_keyed_stays_within_its_timeout() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    calls = Calls(*[grpc.StatusCode.DEADLINE_EXCEEDED] * 10)
    with pytest.raises(grpc.RpcError):
        grpcretry.call_keyed(calls, execution_pb2.SubmitExecutionRequest(idempotency_key="k"), timeout=0.05,
                             sleep=sleep, clock=lambda: now[0])
    assert now[0] < 0.05 and all(t <= 0.05 for t in calls.timeouts)


def test_the_grpc_classifier() -> None:
    transient = {c for c in grpc.StatusCode if grpcretry.grpc_transient(rpc_error(c))}
    assert transient == {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED} == grpcretry.TRANSIENT_CODES
    assert grpcretry.grpc_transient(Unavailable("the api at x did not answer"))
    assert not grpcretry.grpc_transient(NotFound("no such execution"))
    assert not grpcretry.grpc_transient(OSError("not a gRPC failure"))
