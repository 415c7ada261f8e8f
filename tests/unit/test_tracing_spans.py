"""Tracing plumbing (noetl_common.tracing, the engine's EngineTraces): settings, exporters,
W3C propagation through gRPC metadata (a loopback server) and NATS headers, the engine's
spans per execution, and nothing at all while tracing is off. The cross-process chain is
tests/e2e/test_tracing.py."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from noetl_api.engine.traces import EngineTraces
from noetl_common import grpcutil, tracing
from noetl_common.config import TracingSettings, load
from noetl_common.errors import ConfigError, NotFound

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "noetl-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def hexid(span: ReadableSpan) -> tuple[str, str, str | None]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{span.parent.span_id:016x}" if span.parent else None


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


# ---------------------------------------------------------------- settings and exporters


def test_settings_default_off_and_name_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("NOETL_OTEL_"):
            monkeypatch.delenv(name)
    assert load(TracingSettings).exporter == "none"
    monkeypatch.setenv("NOETL_OTEL_EXPORTER", "otlp")
    with pytest.raises(ConfigError, match="NOETL_OTEL_ENDPOINT"):
        load(TracingSettings)
    monkeypatch.setenv("NOETL_OTEL_ENDPOINT", "collector:4318")
    with pytest.raises(ConfigError, match=r"http\(s\)://"):
        load(TracingSettings)
    monkeypatch.setenv("NOETL_OTEL_EXPORTER", "jsonl")
    with pytest.raises(ConfigError, match="NOETL_OTEL_FILE"):
        load(TracingSettings)
    monkeypatch.setenv("NOETL_OTEL_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="NOETL_OTEL_EXPORTER"):
        load(TracingSettings)
    monkeypatch.setenv("NOETL_OTEL_EXPORTER", "none")
    monkeypatch.setenv("NOETL_OTEL_SAMPLE_RATIO", "1.5")
    with pytest.raises(ConfigError, match="NOETL_OTEL_SAMPLE_RATIO"):
        load(TracingSettings)


def test_otlp_endpoint_gets_the_traces_path() -> None:
    assert tracing.otlp_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.otlp_traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.otlp_traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


def test_off_records_nothing_and_writes_no_header() -> None:
    tracing.setup(TracingSettings(exporter="none"), role="api", instance="x")
    assert not tracing.enabled()
    assert tracing.server_interceptors() == [] and list(tracing.client_interceptors()) == []
    headers: dict[str, str] = {}
    with tracing.producer("noetl.commands.1", headers) as s, tracing.span("x") as t:
        assert s is None and t is None
    assert headers == {} and tracing.current_traceparent() is None


def test_jsonl_exporter_writes_a_file_per_process(tmp_path: Path) -> None:
    tracing.setup(TracingSettings(exporter="jsonl", file=str(tmp_path / "{role}-{pid}.jsonl")),
                  role="worker", instance="w-1")
    try:
        assert tracing.enabled()
        with tracing.span("outer", attributes={"noetl.execution_id": 7}), tracing.span("inner"):
            pass
    finally:
        tracing.shutdown()
    path = tmp_path / f"worker-{os.getpid()}.jsonl"
    rows = tracing.read_jsonl([path])
    assert [r["name"] for r in rows] == ["inner", "outer"]
    inner, outer = rows
    assert inner["trace_id"] == outer["trace_id"] and inner["parent_span_id"] == outer["span_id"]
    assert outer["parent_span_id"] is None and outer["service"] == "noetl-worker"
    assert outer["attributes"] == {"noetl.execution_id": 7} and outer["pid"] == os.getpid()
    assert all(json.loads(line) for line in path.read_text().splitlines())  # one object per line


class _Collector(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_otlp_exporter_posts_protobuf_to_the_collector() -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    server = HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        tracing.setup(TracingSettings(exporter="otlp", endpoint=endpoint, timeout_sec=5), role="api", instance="a-1")
        with tracing.span("engine.submitted", attributes={"noetl.execution_id": 42}):
            pass
        tracing.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        server.server_close()
    assert _Collector.bodies, "nothing exported"
    path, body = _Collector.bodies[-1]
    assert path == "/v1/traces"
    req = ExportTraceServiceRequest.FromString(body)
    resource = req.resource_spans[0]
    service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
    names = [s.name for scope in resource.scope_spans for s in scope.spans]
    assert service == "noetl-api" and names == ["engine.submitted"]


# ---------------------------------------------------------------- propagation


def test_producer_writes_traceparent_and_consumer_continues_it(spans: InMemorySpanExporter) -> None:
    headers: dict[str, str] = {"Nats-Msg-Id": "c#1"}
    parent = tracing.context_from(TRACEPARENT)
    with tracing.producer("noetl.commands.3", headers, msg_id="c#1", parent=parent):
        pass
    assert headers["traceparent"].split("-")[1] == TRACE_ID

    class Handler:
        seen: str | None = None

        @tracing.consumer
        async def handle(self, msg: Any) -> str:
            self.seen = tracing.current_traceparent()
            return "done"

    handler = Handler()
    msg = SimpleNamespace(subject="noetl.commands.3", headers=headers)
    assert asyncio.run(handler.handle(msg)) == "done"
    got = by_name(spans)
    publish, process = got["publish noetl.commands.3"], got["process noetl.commands.3"]
    assert publish.kind.name == "PRODUCER" and process.kind.name == "CONSUMER"
    assert hexid(publish)[0] == TRACE_ID and hexid(publish)[2] == PARENT_ID
    assert hexid(process)[2] == hexid(publish)[1]
    assert handler.seen is not None and handler.seen.split("-")[2] == hexid(process)[1]
    # a message without a context starts a trace of its own
    asyncio.run(handler.handle(SimpleNamespace(subject="s", headers=None)))
    assert hexid(by_name(spans)["process s"])[2] is None


def test_malformed_contexts_are_ignored() -> None:
    assert tracing.context_from(None) is None
    assert tracing.context_from("garbage") is None
    assert tracing.extract({"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"}) is None
    assert tracing.extract({}) is None


async def test_grpc_client_and_server_spans_share_the_trace(spans: InMemorySpanExporter) -> None:
    """A loopback server with the same interceptors as every role: the client span's
    context travels in the metadata; errors set the code and an error status; health
    checks are not traced."""
    from noetl_proto.v1 import execution_pb2, execution_pb2_grpc

    class Executions(execution_pb2_grpc.ExecutionServiceServicer):
        async def GetExecution(self, request: Any, context: Any) -> Any:
            with tracing.span("inside"):
                pass
            if request.execution_id == 404:
                raise NotFound("no such execution")
            return execution_pb2.GetExecutionResponse()

    server = grpc.aio.server(interceptors=[*tracing.server_interceptors(), grpcutil.ErrorInterceptor()])
    execution_pb2_grpc.add_ExecutionServiceServicer_to_server(Executions(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpcutil.channel(f"127.0.0.1:{port}")
    try:
        stub = execution_pb2_grpc.ExecutionServiceStub(channel)
        with tracing.span("caller", parent=tracing.context_from(TRACEPARENT)):
            await stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=1), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetExecution(execution_pb2.GetExecutionRequest(execution_id=404), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await channel.close()
        await server.stop(None)
    finished = spans.get_finished_spans()
    method = "noetl.v1.ExecutionService/GetExecution"
    clients = [s for s in finished if s.name == method and s.kind.name == "CLIENT"]
    servers = [s for s in finished if s.name == method and s.kind.name == "SERVER"]
    assert len(clients) == 2 and len(servers) == 2
    caller = next(s for s in finished if s.name == "caller")
    for client, server_span in zip(clients, servers, strict=True):
        assert hexid(client)[0] == TRACE_ID and hexid(client)[2] == hexid(caller)[1]
        assert hexid(server_span)[2] == hexid(client)[1]
    assert all(hexid(s)[2] == hexid(servers[0])[1] or hexid(s)[2] == hexid(servers[1])[1]
               for s in finished if s.name == "inside")
    ok, missing = servers
    assert ok.attributes is not None and ok.attributes["rpc.grpc.status_code"] == 0
    assert missing.attributes is not None and missing.attributes["rpc.grpc.status_code"] == 5
    assert missing.status.status_code.name == "ERROR" and clients[1].status.status_code.name == "ERROR"
    assert not [s for s in finished if "Health" in s.name]


# ---------------------------------------------------------------- the engine


class _Conn:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.queries = 0

    async def execute(self, query: str, params: Any) -> Any:
        self.queries += 1
        rows = [r for r in self.rows if r["execution_id"] in params[0]]

        class Cur:
            async def fetchall(self) -> list[dict[str, Any]]:
                return rows

        return Cur()


async def test_engine_spans_continue_the_stored_context(spans: InMemorySpanExporter) -> None:
    traces = EngineTraces()
    conn = _Conn([{"execution_id": 2, "traceparent": TRACEPARENT.replace(PARENT_ID, "1" * 16)}])
    await traces.load(conn, [1, 2], {1: {"traceparent": TRACEPARENT}})
    assert conn.queries == 1  # 1 came with its request row, 2 was looked up
    await traces.load(conn, [1, 2], {})
    assert conn.queries == 1  # both cached

    async def transition(commands: int) -> Any:
        return SimpleNamespace(events=[1, 2], commands=[object()] * commands, republish=[])

    start = SimpleNamespace(kind="submitted", execution_id=1, msg=None)
    assert (await traces.fold(start, 5, transition(1))).commands
    issuer = traces.notice_parent(1)
    with tracing.producer("noetl.commands.5", {}, parent=issuer):
        pass
    result = SimpleNamespace(kind="call_result", execution_id=1, msg=SimpleNamespace(command_id="1:start:1"))
    await traces.fold(result, 5, transition(0))
    assert traces.notice_parent(1) is issuer  # a fold that issued nothing parents no notice
    traces.committed([(1, 5, 9, "playbook.completed", None, None, None, "{}"),
                      (2, 5, 10, "command.dead_lettered", "boom", "2:boom:1", None, "{}")])
    got = by_name(spans)
    submitted, notice, folded = got["engine.submitted"], got["publish noetl.commands.5"], got["engine.call_result"]
    done, dead = got["playbook.completed"], got["command.dead_lettered"]
    assert {hexid(s)[0] for s in (submitted, notice, folded, done)} == {TRACE_ID}
    assert hexid(submitted)[2] == hexid(folded)[2] == hexid(done)[2] == PARENT_ID
    assert hexid(notice)[2] == hexid(submitted)[1]
    assert submitted.attributes is not None and submitted.attributes["noetl.commands"] == 1
    assert folded.attributes is not None and folded.attributes["noetl.command_id"] == "1:start:1"
    assert hexid(dead)[2] == "1" * 16 and dead.status.status_code.name == "ERROR"
    # the finished execution is forgotten; the other one is not
    assert traces.notice_parent(1) is None and traces.notice_parent(2) is not None


async def test_engine_traces_cost_nothing_while_off() -> None:
    traces = EngineTraces()
    conn = _Conn([])
    await traces.load(conn, [1], {})
    marker = object()

    async def work() -> object:
        return marker

    assert await traces.fold(SimpleNamespace(kind="submitted", execution_id=1, msg=None), 0, work()) is marker
    traces.committed([(1, 0, 1, "playbook.completed", None, None, None, "{}")])
    assert conn.queries == 0 and traces.notice_parent(1) is None
