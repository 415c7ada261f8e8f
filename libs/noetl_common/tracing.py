"""OpenTelemetry tracing: one trace per execution, across every process it touches.

    client --gRPC metadata--> api SubmitExecution (server span; a client's traceparent is continued)
        the trace context is committed with the request (noetl.execution_request.traceparent)
    engine (any api replica, also after a takeover) --> span per input it folds, parented on
        the execution's stored context; command notices carry it in NATS headers
    worker: consumer span per notice --> ClaimCommand (client span; server span in the api)
        --> tool runs --> result publish (producer span, traceparent in the NATS headers)
    engine: folds the result, appends playbook.completed (a span of its own)

Propagation is W3C Trace Context (``traceparent``/``tracestate``) in gRPC metadata and NATS
headers. ``setup()`` is called once per process at the edge (``run_service``) with
``TracingSettings``; until then, and with ``NOETL_OTEL_EXPORTER=none``, nothing is
recorded: no interceptors are installed, every helper returns at its first line and no
header is written. Nothing here does I/O at import time, and the OpenTelemetry global
provider is left alone (tests install their own provider with ``install()``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .config import TracingSettings
from .errors import ConfigError
from .rpchandlers import rewrapped

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
SCOPE = "noetl"
# Periodic or infrastructure calls that would each make a trace of their own.
UNTRACED_METHODS = ("/grpc.health.v1.", "/grpc.reflection.", "/noetl.v1.ShardManagerService/Heartbeat")

_PROPAGATOR = TraceContextTextMapPropagator()
R = TypeVar("R")


class _State:
    provider: TracerProvider | None = None
    tracer: trace.Tracer = trace.NoOpTracer()


_state = _State()


# ---------------------------------------------------------------- setup


def setup(settings: TracingSettings, *, role: str, instance: str) -> None:
    """Configure this process's tracing from ``settings`` (nothing for exporter ``none``)."""
    if settings.exporter == "none":
        return
    resource = Resource.create({"service.name": settings.service_name or f"noetl-{role}",
                                "service.namespace": "noetl", "service.instance.id": instance,
                                "noetl.role": role})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
                              shutdown_on_exit=False)
    provider.add_span_processor(_processor(settings, role=role, instance=instance))
    install(provider)
    logger.info("tracing on: exporter=%s service=%s", settings.exporter, settings.service_name or f"noetl-{role}")


def _processor(settings: TracingSettings, *, role: str, instance: str) -> Any:
    if settings.exporter == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter(service_name=settings.service_name or f"noetl-{role}"))
    if settings.exporter == "jsonl":
        path = settings.file.format(role=role, pid=os.getpid(), instance=instance)
        return SimpleSpanProcessor(JsonlSpanExporter(path))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # the dependency is declared; a trimmed install may lack it
        raise ConfigError("NOETL_OTEL_EXPORTER=otlp needs the package opentelemetry-exporter-otlp-proto-http") from exc
    return BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(settings.endpoint),
                                               timeout=settings.timeout_sec))


def otlp_traces_url(endpoint: str) -> str:
    """The collector's base URL gets the traces path (as OTEL_EXPORTER_OTLP_ENDPOINT does)."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def install(provider: TracerProvider) -> None:
    """Use ``provider`` for this process's spans (``setup`` does; tests pass an in-memory one)."""
    _state.provider = provider
    _state.tracer = provider.get_tracer(SCOPE)


def shutdown() -> None:
    """Flush and stop the exporter (idempotent); tracing is off afterwards."""
    provider, _state.provider = _state.provider, None
    _state.tracer = trace.NoOpTracer()
    if provider is not None:
        try:
            provider.shutdown()
        except Exception:
            logger.exception("tracing shutdown failed")


def enabled() -> bool:
    return _state.provider is not None


def tracer() -> trace.Tracer:
    return _state.tracer


# ---------------------------------------------------------------- context


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The trace context a message or call carries (None when it carries none)."""
    if not carrier or TRACEPARENT not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def inject(carrier: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write ``context`` (default: the current one) into ``carrier`` as W3C headers."""
    _PROPAGATOR.inject(carrier, context=context)


def context_from(traceparent: str | None) -> Context | None:
    """A stored ``traceparent`` as a parent context (None when absent or invalid)."""
    return extract({TRACEPARENT: traceparent}) if traceparent else None


def current_traceparent() -> str | None:
    """The current span's ``traceparent``, to be stored (None when tracing is off)."""
    if not enabled():
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get(TRACEPARENT)


# ---------------------------------------------------------------- spans


@contextlib.contextmanager
def span(name: str, *, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None) -> Iterator[Span | None]:
    """A current span (child of ``parent``, default the current context); yields None and
    records nothing when tracing is off."""
    if _state.provider is None:
        yield None
        return
    with _state.tracer.start_as_current_span(name, context=parent, kind=kind,
                                             attributes=_attrs(attributes)) as s:
        yield s


def event_span(name: str, *, parent: Context | None, attributes: Mapping[str, Any] | None = None,
               error: str = "") -> None:
    """A point-in-time span (e.g. ``playbook.completed``) under ``parent``."""
    if _state.provider is None:
        return
    s = _state.tracer.start_span(name, context=parent, attributes=_attrs(attributes))
    if error:
        s.set_status(Status(StatusCode.ERROR, error))
    s.end()


def as_parent(s: Span) -> Context:
    """A context whose current span is ``s`` (to parent spans started later, elsewhere)."""
    return trace.set_span_in_context(s)


def set_error(s: Span | None, description: str) -> None:
    if s is not None:
        s.set_status(Status(StatusCode.ERROR, description))


def set_attributes(s: Span | None, attributes: Mapping[str, Any]) -> None:
    if s is not None:
        s.set_attributes(_attrs(attributes) or {})


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None and v != ""}


# ---------------------------------------------------------------- NATS


@contextlib.contextmanager
def producer(subject: str, headers: MutableMapping[str, str], *, msg_id: str | None = None,
             parent: Context | None = None) -> Iterator[Span | None]:
    """The span of one JetStream publish; writes its context into ``headers``. ``parent``
    overrides the current context (the engine publishes on behalf of an execution)."""
    if _state.provider is None:
        yield None
        return
    with _state.tracer.start_as_current_span(
            f"publish {subject}", context=parent, kind=SpanKind.PRODUCER,
            attributes=_attrs({"messaging.system": "nats", "messaging.operation.type": "send",
                               "messaging.destination.name": subject, "messaging.message.id": msg_id})) as s:
        inject(headers)
        yield s


@contextlib.contextmanager
def consumer_span(subject: str, headers: Mapping[str, str] | None) -> Iterator[None]:
    """The current span of processing a message of ``subject``, whose parent is the trace
    context in its ``headers`` (the handling may come later than the message's arrival)."""
    if _state.provider is None:
        yield
        return
    with _state.tracer.start_as_current_span(
            f"process {subject}", context=extract(headers), kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.operation.type": "process",
                        "messaging.destination.name": subject}):
        yield


def consumer(fn: Callable[[Any, Any], Awaitable[R]]) -> Callable[[Any, Any], Awaitable[R]]:
    """Decorates ``async def handle(self, msg)``: the handling runs in a consumer span whose
    parent is the trace context in the message's headers."""

    @functools.wraps(fn)
    async def wrapper(self: Any, msg: Any) -> R:
        if _state.provider is None:
            return await fn(self, msg)
        with consumer_span(getattr(msg, "subject", "") or "", getattr(msg, "headers", None)):
            return await fn(self, msg)

    return wrapper


# ---------------------------------------------------------------- gRPC


def _method(details: Any) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


def _rpc_attrs(method: str) -> dict[str, Any]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _set_grpc_status(s: Span, code: grpc.StatusCode | None, details: str = "") -> None:
    code = code or grpc.StatusCode.UNKNOWN
    s.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        s.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """A server span per call, continuing the caller's trace (``traceparent`` metadata).
    Installed before ``grpcutil.ErrorInterceptor`` (outermost), so it sees final codes."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNTRACED_METHODS):
            return handler
        name = method.lstrip("/")
        attrs = _rpc_attrs(method)

        def parent(context: grpc.aio.ServicerContext) -> Context | None:
            return extract({k: v for k, v in (context.invocation_metadata() or ())
                            if k in (TRACEPARENT, "tracestate") and isinstance(v, str)})

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with _state.tracer.start_as_current_span(name, context=parent(context), kind=SpanKind.SERVER,
                                                         attributes=attrs, record_exception=False,
                                                         set_status_on_exception=False) as s:
                    try:
                        response = await inner_uu(request, context)
                    except BaseException:
                        _set_grpc_status(s, context.code() or grpc.StatusCode.UNKNOWN,  # type: ignore[arg-type]
                                         str(context.details() or ""))
                        raise
                    _set_grpc_status(s, context.code() or grpc.StatusCode.OK)  # type: ignore[arg-type]
                    return response

            return rewrapped(handler, unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                # Not made current: an async generator may be resumed in another context.
                s = _state.tracer.start_span(name, context=parent(context), kind=SpanKind.SERVER, attributes=attrs)
                code: grpc.StatusCode | None = grpc.StatusCode.OK
                try:
                    async for item in inner_us(request, context):
                        yield item
                except BaseException:
                    code = context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[assignment]
                    raise
                finally:
                    _set_grpc_status(s, code)
                    s.end()

            return rewrapped(handler, unary_stream=unary_stream)
        return handler


class ClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """A client span per unary call; its context travels in the call's metadata."""

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        method = _method(client_call_details)
        if method.startswith(UNTRACED_METHODS):
            return await continuation(client_call_details, request)
        with _state.tracer.start_as_current_span(method.lstrip("/"), kind=SpanKind.CLIENT,
                                                 attributes=_rpc_attrs(method), record_exception=False) as s:
            carrier: dict[str, str] = {}
            inject(carrier)
            metadata = [*(client_call_details.metadata or ()), *carrier.items()]
            details = client_call_details._replace(metadata=grpc.aio.Metadata(*metadata))
            call = await continuation(details, request)
            try:
                await call
            except grpc.RpcError:
                pass  # the caller gets it from the call
            _set_grpc_status(s, await call.code(), await call.details() or "")
            return call


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for a server built now (none while tracing is off)."""
    return [ServerInterceptor()] if enabled() else []


def client_interceptors() -> Sequence[grpc.aio.ClientInterceptor]:
    """Interceptors for a channel opened now (none while tracing is off)."""
    return [ClientInterceptor()] if enabled() else []


# ---------------------------------------------------------------- the jsonl exporter


def span_dict(s: ReadableSpan) -> dict[str, Any]:
    """One span as a flat JSON object (what the ``jsonl`` exporter writes)."""
    ctx = s.get_span_context()
    assert ctx is not None
    return {
        "name": s.name,
        "kind": s.kind.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
        "service": s.resource.attributes.get("service.name"),
        "pid": os.getpid(),
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "status": s.status.status_code.name,
        "status_description": s.status.description,
        "attributes": dict(s.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in s.events],
    }


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON line per span to a file (a file per process: for tests, debugging
    and log shippers). Each line is written and flushed whole, under a lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fh: IO[str] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_dict(s), default=str, separators=(",", ":")) + "\n" for s in spans)
        try:
            with self._lock:
                if self._fh is None:
                    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                    self._fh = open(self.path, "a", encoding="utf-8")
                self._fh.write(lines)
                self._fh.flush()
        except OSError as exc:
            logger.warning("writing spans to %s failed: %s", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_jsonl(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Every complete span line in ``paths`` (a line still being written is skipped)."""
    out: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    return out


__all__ = [
    "TRACEPARENT", "ClientInterceptor", "JsonlSpanExporter", "ServerInterceptor", "as_parent",
    "client_interceptors", "consumer", "context_from", "current_traceparent", "enabled", "event_span",
    "extract", "inject", "install", "otlp_traces_url", "producer", "read_jsonl", "server_interceptors",
    "set_attributes", "set_error", "setup", "shutdown", "span", "span_dict", "tracer",
]
