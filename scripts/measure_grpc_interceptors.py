"""What the gRPC interceptors cost per call: ours (``grpcmetrics``, ``tracing``) against the
maintained libraries that could replace them (docs/DEPLOY.md "gRPC metrics").

    .venv/bin/python scripts/measure_grpc_interceptors.py [--rounds 100] [--calls 200]

The libraries are not the project's dependencies: they are installed (pinned, ``pip
install --target``) into ``bench/.venv-interceptors`` (gitignored), which only the two
processes this script starts put on their path. A server process serves the same unary
method on one ``grpc.aio`` server per configuration, each with ``grpcutil.ErrorInterceptor``
innermost as in the roles, plus:

    baseline          nothing more
    metrics ours      grpcmetrics.ServerMetricsInterceptor
    metrics lib       py-async-grpc-prometheus' PromAsyncServerInterceptor (handling-time
                      histogram on; its own registry)
    tracing ours      tracing.ServerInterceptor; the client: tracing.ClientInterceptor
    tracing otel      opentelemetry-instrumentation-grpc's aio server interceptor; the
                      client: its aio client interceptors

Tracing samples every call into an SDK ``TracerProvider`` whose exporter drops the spans
(what is measured is the interceptors and span bookkeeping, not an export). A client
process calls each configuration ``--calls`` times in a row, in a shuffled order each
round (interleaved: the machine's load drifts alike over all of them), and measures per
call the wall time, its own CPU time and the server process's CPU time (read before and
after each block over a separate control server). Overheads are paired per round against
the baseline of the same round; the table gives their median and quartiles over the
rounds, in microseconds. Before measuring, each configuration's correctness is checked: a
call answered NOT_FOUND by ``ErrorInterceptor`` must be counted (metrics) or its span
marked (tracing) with that code. The sync py-grpc-prometheus is tried on a ``grpc.aio``
server too (it is refused).

On a shared 2-core machine those end-to-end figures carry tens of microseconds of noise, so
a second measure isolates the server interceptors: in one process, each configuration's
chain is run as grpc.aio runs it per call (``intercept_service`` down the chain, then the
wrapped behaviour), against a stand-in servicer context (a fixed peer and a
``traceparent`` in the metadata, as a traced client sends), ``--direct-calls`` calls per
configuration per round, interleaved likewise; CPU nanoseconds per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LIBS = REPO / "bench" / ".venv-interceptors"
PINS = ["py-grpc-prometheus==0.8.0", "py-async-grpc-prometheus==0.2.0", "opentelemetry-instrumentation==0.66b2",
        "opentelemetry-instrumentation-grpc==0.66b2", "wrapt==2.5.2"]
CONFIGS = ("baseline", "metrics ours", "metrics lib", "tracing ours", "tracing otel")
PING = "/bench.Echo/Ping"
MISSING = "/bench.Echo/Missing"
CPU = "/bench.Control/Cpu"


def ensure_libs() -> None:
    stamp = LIBS / ".installed"
    if stamp.exists() and stamp.read_text() == json.dumps(PINS):
        return
    print(f"installing {', '.join(PINS)} into {LIBS.relative_to(REPO)}", file=sys.stderr)
    # --no-deps: everything else they need (grpcio, prometheus-client, opentelemetry-api and
    # -sdk, the semantic conventions, packaging) is the project's own, at the project's versions
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--upgrade", "--target", str(LIBS), *PINS], check=True, timeout=600)
    stamp.write_text(json.dumps(PINS))


def provider() -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Keep(SpanExporter):
        """Keeps the last spans (the correctness check reads them); drops the rest."""

        def __init__(self) -> None:
            self.spans: list[Any] = []

        def export(self, spans: Any) -> SpanExportResult:
            self.spans = (self.spans + list(spans))[-8:]
            return SpanExportResult.SUCCESS

    p = TracerProvider(shutdown_on_exit=False)
    keep = Keep()
    p.add_span_processor(SimpleSpanProcessor(keep))
    p.keep = keep  # type: ignore[attr-defined]
    return p


# ---------------------------------------------------------------- the server process


async def serve() -> None:
    import grpc
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    from prometheus_client import CollectorRegistry, generate_latest
    from py_async_grpc_prometheus.prometheus_async_server_interceptor import PromAsyncServerInterceptor

    from noetl_common import grpcmetrics, grpcutil, tracing
    from noetl_common.errors import NotFound

    tp = provider()
    tracing.install(tp)
    lib_registry = CollectorRegistry()
    chains: dict[str, list[Any]] = {
        "baseline": [],
        "metrics ours": [grpcmetrics.ServerMetricsInterceptor()],
        "metrics lib": [PromAsyncServerInterceptor(enable_handling_time_histogram=True, registry=lib_registry)],
        "tracing ours": [tracing.ServerInterceptor()],
        "tracing otel": [aio_server_interceptor(tracer_provider=tp)],
    }

    async def ping(request: bytes, context: Any) -> bytes:
        return request

    async def missing(request: bytes, context: Any) -> bytes:
        raise NotFound("no such thing")

    async def cpu(request: bytes, context: Any) -> bytes:
        return repr(time.process_time()).encode()

    async def check(request: bytes, context: Any) -> bytes:
        """What each configuration recorded for the NOT_FOUND call (correctness)."""
        from prometheus_client import REGISTRY
        ours = [ln for ln in generate_latest(REGISTRY).decode().splitlines()
                if ln.startswith("grpc_server_handled_total") and "Missing" in ln]
        lib = [ln for ln in generate_latest(lib_registry).decode().splitlines()
               if ln.startswith("grpc_server_handled_total") and "Missing" in ln]
        spans = [(s.name, s.kind.name, s.status.status_code.name, dict(s.attributes).get("rpc.grpc.status_code"))
                 for s in tp.keep.spans if "Missing" in s.name]
        return json.dumps({"metrics ours": ours, "metrics lib": lib, "spans": spans}).encode()

    def ident(b: bytes) -> bytes:
        return b

    echo = grpc.method_handlers_generic_handler("bench.Echo", {
        "Ping": grpc.unary_unary_rpc_method_handler(ping, ident, ident),
        "Missing": grpc.unary_unary_rpc_method_handler(missing, ident, ident)})
    control = grpc.method_handlers_generic_handler("bench.Control", {
        "Cpu": grpc.unary_unary_rpc_method_handler(cpu, ident, ident),
        "Check": grpc.unary_unary_rpc_method_handler(check, ident, ident)})

    # the sync library on an aio server
    try:
        from py_grpc_prometheus.prometheus_server_interceptor import PromServerInterceptor
        grpc.aio.server(interceptors=[PromServerInterceptor(registry=CollectorRegistry())])
        sync_lib = "accepted"
    except Exception as exc:  # what grpc.aio says about a grpc.ServerInterceptor
        sync_lib = f"refused: {type(exc).__name__}: {exc}"

    servers, ports = [], {}
    for name, chain in {**chains, "control": []}.items():
        server = grpc.aio.server(interceptors=[*chain, grpcutil.ErrorInterceptor()])
        server.add_generic_rpc_handlers([control if name == "control" else echo])
        ports[name] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
    print(json.dumps({"ports": ports, "sync_lib": sync_lib}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client is done
    for server in servers:
        await server.stop(None)


# ---------------------------------------------------------------- the client process


async def client(ports: dict[str, int], rounds: int, calls: int, seed: int) -> dict[str, Any]:
    import grpc
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    from noetl_common import tracing

    tp = provider()
    tracing.install(tp)
    client_chains: dict[str, list[Any]] = {name: [] for name in CONFIGS}
    client_chains["tracing ours"] = [tracing.ClientInterceptor()]
    client_chains["tracing otel"] = list(aio_client_interceptors(tracer_provider=tp))
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{ports[name]}", interceptors=client_chains[name])
                for name in CONFIGS}
    control = grpc.aio.insecure_channel(f"127.0.0.1:{ports['control']}")
    cpu = control.unary_unary(CPU)

    async def server_cpu() -> float:
        return float(await cpu(b""))

    # correctness: a NOT_FOUND call through each configuration
    for name in CONFIGS:
        try:
            await channels[name].unary_unary(MISSING)(b"")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, (name, exc.code())
    checked = json.loads(await control.unary_unary("/bench.Control/Check")(b""))
    checked["client spans"] = [(s.name, s.kind.name, s.status.status_code.name) for s in tp.keep.spans
                               if "Missing" in s.name]

    payload = b"x" * 64
    rng = random.Random(seed)
    per_round: list[dict[str, tuple[float, float, float]]] = []
    for r in range(rounds + 1):  # round 0 warms up and is dropped
        order = list(CONFIGS)
        rng.shuffle(order)
        results = {}
        for name in order:
            call = channels[name].unary_unary(PING)
            s0, c0, w0 = await server_cpu(), time.process_time(), time.perf_counter()
            for _ in range(calls):
                await call(payload)
            w1, c1, s1 = time.perf_counter(), time.process_time(), await server_cpu()
            results[name] = ((w1 - w0) / calls * 1e6, (c1 - c0) / calls * 1e6, (s1 - s0) / calls * 1e6)
        if r:
            per_round.append(results)
    for ch in (*channels.values(), control):
        await ch.close()

    def quartiles(xs: list[float]) -> list[float]:
        q = statistics.quantiles(xs, n=4)
        return [round(q[0], 1), round(statistics.median(xs), 1), round(q[2], 1)]

    table = {}
    for name in CONFIGS:
        row: dict[str, Any] = {}
        for i, what in enumerate(("wall", "client_cpu", "server_cpu")):
            row[what] = quartiles([res[name][i] for res in per_round])
            row[f"{what}_overhead"] = quartiles([res[name][i] - res["baseline"][i] for res in per_round])
        table[name] = row
    return {"rounds": rounds, "calls": calls, "seed": seed, "table": table, "correctness": checked}


# ---------------------------------------------------------------- in-process, server side only


class _Metadatum(tuple):  # what grpc.aio's invocation_metadata() yields: (key, value) with names
    key = property(lambda self: self[0])
    value = property(lambda self: self[1])


class _Context:
    """Stands in for a grpc.aio servicer context: what the interceptors ask of one."""

    def __init__(self) -> None:
        self._code: Any = 0
        self._details = ""

    def invocation_metadata(self) -> tuple[Any, ...]:
        return (_Metadatum(("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
                _Metadatum(("user-agent", "grpc-python/1.85")))

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def time_remaining(self) -> float:
        return 30.0

    def code(self) -> Any:
        return self._code

    def set_code(self, code: Any) -> None:
        self._code = code

    def details(self) -> str:
        return self._details

    def set_details(self, details: str) -> None:
        self._details = details

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        import grpc
        self._code, self._details = code, details
        raise grpc.aio.AbortError()


async def direct(rounds: int, calls: int, seed: int) -> dict[str, Any]:
    import grpc
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    from prometheus_client import CollectorRegistry
    from py_async_grpc_prometheus.prometheus_async_server_interceptor import PromAsyncServerInterceptor

    from noetl_common import grpcmetrics, grpcutil, tracing

    tp = provider()
    tracing.install(tp)
    chains: dict[str, list[Any]] = {
        "baseline": [],
        "metrics ours": [grpcmetrics.ServerMetricsInterceptor()],
        "metrics lib": [PromAsyncServerInterceptor(enable_handling_time_histogram=True, registry=CollectorRegistry())],
        "tracing ours": [tracing.ServerInterceptor()],
        "tracing otel": [aio_server_interceptor(tracer_provider=tp)],
    }

    async def ping(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(ping)

    class Details:
        method = PING
        invocation_metadata = _Context().invocation_metadata()

    def continuation_of(chain: list[Any]) -> Any:
        async def last(details: Any) -> Any:
            return handler

        cont = last
        for icpt in reversed([*chain, grpcutil.ErrorInterceptor()]):
            def bind(i: Any = icpt, c: Any = cont) -> Any:
                async def step(details: Any) -> Any:
                    return await i.intercept_service(c, details)
                return step
            cont = bind()
        return cont

    conts = {name: continuation_of(chain) for name, chain in chains.items()}
    details = Details()

    async def block(cont: Any) -> float:
        c0 = time.process_time_ns()
        for _ in range(calls):
            h = await cont(details)
            await h.unary_unary(b"x", _Context())
        return (time.process_time_ns() - c0) / calls

    rng = random.Random(seed)
    per_round: list[dict[str, float]] = []
    for r in range(rounds + 1):
        order = list(CONFIGS)
        rng.shuffle(order)
        res = {name: await block(conts[name]) for name in order}
        if r:
            per_round.append(res)

    def quartiles(xs: list[float]) -> list[float]:
        q = statistics.quantiles(xs, n=4)
        return [round(q[0] / 1000, 2), round(statistics.median(xs) / 1000, 2), round(q[2] / 1000, 2)]

    return {"rounds": rounds, "calls": calls,
            "table": {name: {"cpu": quartiles([res[name] for res in per_round]),
                             "overhead": quartiles([res[name] - res["baseline"] for res in per_round])}
                      for name in CONFIGS}}


# ---------------------------------------------------------------- the driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--calls", type=int, default=200, help="calls per configuration per round")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--direct-rounds", type=int, default=60)
    ap.add_argument("--direct-calls", type=int, default=2000, help="in-process calls per configuration per round")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(serve())
        return 0
    if args.direct:
        print(json.dumps(asyncio.run(direct(args.direct_rounds, args.direct_calls, args.seed))))
        return 0
    if args.client:
        out = asyncio.run(client({k: int(v) for k, v in json.loads(args.client).items()}, args.rounds,
                                 args.calls, args.seed))
        print(json.dumps(out))
        return 0

    ensure_libs()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(LIBS)) if p),
           "OTEL_SDK_DISABLED": "false"}
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env, text=True, cwd=REPO)
    try:
        assert server.stdout is not None and server.stdin is not None
        started = json.loads(server.stdout.readline())
        out = subprocess.run([sys.executable, __file__, "--client", json.dumps(started["ports"]),
                              "--rounds", str(args.rounds), "--calls", str(args.calls), "--seed", str(args.seed)],
                             env=env, capture_output=True, text=True, cwd=REPO, timeout=1800)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["sync py-grpc-prometheus on grpc.aio"] = started["sync_lib"]
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(30)
    out = subprocess.run([sys.executable, __file__, "--direct", "--direct-rounds", str(args.direct_rounds),
                          "--direct-calls", str(args.direct_calls), "--seed", str(args.seed)],
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return 1
    result["direct"] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['rounds']} rounds x {result['calls']} calls per configuration, interleaved; "
          "microseconds per call, median [p25, p75] over the rounds")
    print(f"{'configuration':<14} {'wall':>22} {'overhead: wall':>24} {'client CPU':>22} {'server CPU':>22}")
    for name, row in result["table"].items():
        def fmt(q: list[float]) -> str:
            return f"{q[1]:.1f} [{q[0]:.1f}, {q[2]:.1f}]"
        print(f"{name:<14} {fmt(row['wall']):>22} {fmt(row['wall_overhead']):>24} "
              f"{fmt(row['client_cpu_overhead']):>22} {fmt(row['server_cpu_overhead']):>22}")
    print("(client and server CPU: overhead against the baseline of the same round)")
    d = result["direct"]
    print(f"\nserver interceptors alone, in process: {d['rounds']} rounds x {d['calls']} calls per configuration, "
          "interleaved; CPU microseconds per call, median [p25, p75] over the rounds")
    print(f"{'configuration':<14} {'CPU':>22} {'overhead':>22}")
    for name, row in d["table"].items():
        print(f"{name:<14} {row['cpu'][1]:>8.2f} [{row['cpu'][0]:.2f}, {row['cpu'][2]:.2f}] "
              f"{row['overhead'][1]:>8.2f} [{row['overhead'][0]:.2f}, {row['overhead'][2]:.2f}]")
    print(f"\nsync py-grpc-prometheus on grpc.aio: {result['sync py-grpc-prometheus on grpc.aio']}")
    print("correctness (a NOT_FOUND call):")
    for key, value in result["correctness"].items():
        print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
