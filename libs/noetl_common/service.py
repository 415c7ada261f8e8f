"""The skeleton every role runs on: gRPC server with health and reflection, Prometheus
/metrics, membership with the shard-manager, shard leases, a ready file, and a
shutdown in named, time-limited steps.

A role subclasses ``Service`` and fills the hooks; ``main()`` builds settings and
calls ``run_service``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge, start_http_server

from noetl_proto.v1 import shard_manager_pb2 as sm_pb2
from noetl_proto.v1 import shard_manager_pb2_grpc as sm_grpc

from . import auth, faults, grpcmetrics, grpcutil, harden, metrics, reflection, tracing
from .config import AuthSettings, CoreSettings, ShardSettings, TlsSettings, TracingSettings, load
from .db import Pool, make_pool
from .errors import ConfigError, NoetlError
from .logs import setup_logging
from .shards import ShardOwnership

logger = logging.getLogger(__name__)

# 1 per shard held; the series is removed when the shard is lost (not set to 0).
SHARD_OWNER = Gauge("noetl_shard_owner", "1 for each shard this instance holds", ["role", "shard", "instance"])
DEPENDENCY_UP = Gauge("noetl_dependency_up", "1 while this process reaches the dependency (health check)",
                      ["dependency"])
SERVING = Gauge("noetl_serving", "1 while this process reports SERVING (its loops alive, its dependencies reachable)")
HEALTH_INTERVAL_SEC = 0.5
# The health "service" a liveness probe asks: SERVING for as long as the process answers at
# all. Readiness asks "" (and each gRPC service name), NOT_SERVING while a dependency is
# unreachable or a shard loop keeps crashing: an outage of Postgres must take replicas out
# of load balancing, not get them restarted.
LIVENESS = "noetl.liveness"
HEALTH_TIMEOUT_SEC = 2.0
LEASE_RENEWALS = Counter("noetl_lease_renewals_total", "Shard lease renewal rounds", ["role"])
LEASE_LOSSES = Counter("noetl_lease_losses_total", "Shard leases lost (reassigned or expired)", ["role"])


class Service:
    """Base of every role. Hooks: ``on_start``, ``add_servicers``, ``on_shards``,
    ``on_stop``, ``background``. Sharded roles set ``sharded = True``."""

    role: ClassVar[str] = "service"
    sharded: ClassVar[bool] = False
    # Every role but the shard-manager registers with the shard-manager.
    joins: ClassVar[bool] = True
    # A role that runs users' code drops its secrets from os.environ once its settings are
    # read, and is not dumpable (noetl_common.harden).
    hardened: ClassVar[bool] = False
    service_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, core: CoreSettings, shard: ShardSettings) -> None:
        self.core = core
        self.shard_cfg = shard
        self.pool: Pool | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.grpc_address = ""
        self.metrics_address = ""
        self.runtime_id = 0
        self.node_id = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._sm_channel: grpc.aio.Channel | None = None
        self._sm: sm_grpc.ShardManagerServiceStub | None = None
        self._assigned: dict[int, int] = {}
        self._wake_membership = asyncio.Event()
        self.ownership: ShardOwnership | None = None
        self._metrics_server: Any = None
        self._shut = False
        self._problems: list[str] = []
        self._postgres_down: str | None = None
        self._postgres_back_at: float | None = None  # monotonic: when Postgres last answered again
        self._health_conn: Any = None
        # Off unless configured (run_service reads NOETL_AUTH_* / NOETL_TLS_*, on by default).
        self.auth = AuthSettings.model_construct(enabled=False)
        self.tls = TlsSettings.model_construct()
        self._member_secret = ""
        self.verifier: auth.TokenVerifier | None = None
        self._health_server: grpc.aio.Server | None = None

    def configure_security(self, auth_cfg: AuthSettings, tls: TlsSettings) -> None:
        """Identity and TLS of this process (before ``run``): the token it sends, whether its
        servers check tokens, and its certificates."""
        self.auth = auth_cfg
        self.tls = tls

    @property
    def token(self) -> str:
        return self.auth.token.get_secret_value()

    def channel(self, target: str) -> Any:
        """A channel to another role, with this process's token and TLS."""
        return grpcutil.channel(target, token=self.token, tls=self.tls)

    def server_interceptors(self) -> list[Any]:
        """What every server of this process runs a call through, outermost first."""
        chain: list[Any] = [*tracing.server_interceptors(), grpcmetrics.ServerMetricsInterceptor(),
                            grpcutil.ErrorInterceptor(), grpcutil.GateInterceptor(self.gate)]
        if self.auth.enabled:
            if self.pool is None:
                raise ConfigError("NOETL_AUTH_ENABLED needs NOETL_POSTGRES_DSN (tokens are verified there)")
            self.verifier = self.verifier or auth.TokenVerifier(self.pool, cache_sec=self.auth.cache_sec)
            chain.append(auth.AuthInterceptor(self.verifier.verify))
        return chain

    def new_server(self, listen: str, what: str) -> tuple[Any, str]:
        """A gRPC server bound to ``listen`` (TLS when this process has a certificate);
        returns it and the address it serves on."""
        server = grpc.aio.server(interceptors=self.server_interceptors(),
                                 options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", self.max_receive_bytes()),
                                          ("grpc.max_send_message_length", 64 * 1024 * 1024),
                                          *grpcutil.pending_call_options(self.core.grpc_max_pending_calls),
                                          *grpcutil.SERVER_KEEPALIVE_OPTIONS])
        creds = grpcutil.server_credentials(self.tls)
        port = server.add_secure_port(listen, creds) if creds is not None else server.add_insecure_port(listen)
        if port == 0:
            raise ConfigError(f"{what}: cannot bind {listen}")
        host = listen.rsplit(":", 1)[0] or "127.0.0.1"
        return server, f"{'127.0.0.1' if host in ('0.0.0.0', '[::]') else host}:{port}"

    # ------------------------------------------------------------ hooks

    async def on_start(self) -> None:
        """Open pools and connections (before gRPC serves)."""

    def add_servicers(self, server: grpc.aio.Server) -> None:
        """Register the role's gRPC servicers."""

    async def on_shards(self, gained: dict[int, int], lost: set[int]) -> None:
        """Start work on gained shards {shard: epoch}; stop touching lost ones."""

    async def on_serving(self) -> None:
        """Called once the service is SERVING (start background loops here)."""

    async def on_joined(self) -> None:
        """Called after every Join (the first and each rejoin), before the assigned shards
        are taken: ``runtime_id`` and ``node_id`` are the new ones."""

    async def on_stop(self) -> None:
        """Stop loops and close connections (after gRPC stopped accepting calls)."""

    def on_reconciled(self) -> None:
        """Called after every lease renewal round (start shard loops that are due)."""

    async def check_health(self) -> list[str]:
        """What is wrong with this process now, beyond Postgres (checked by the base): an
        unreachable NATS, shard loops that keep crashing. Empty when healthy."""
        return []

    # ------------------------------------------------------------ helpers

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Run a background loop; a crash of the loop is logged and stops the service."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)

        def done(t: asyncio.Task[Any]) -> None:
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None and not self._stop.is_set():
                logger.error("background task %s crashed: %r; stopping", name, exc, exc_info=exc)
                self._stop.set()

        task.add_done_callback(done)
        self._tasks.append(task)
        return task

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        self._stop.set()

    async def sleep(self, seconds: float) -> bool:
        """Cancellable sleep: returns True when the service is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        return self._stop.is_set()

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        try:
            await self._start()
            await self._stop.wait()
        finally:
            await self.shutdown()

    async def _start(self) -> None:
        faults.configure(self.core.faults_file)
        if self.core.postgres_dsn:
            # A transaction left idle longer than a lease (this process froze mid-batch) is
            # ended by Postgres, so it cannot keep a lease row locked behind a takeover.
            self.pool = make_pool(self.core.postgres_dsn, min_size=1, max_size=self.pool_size(),
                                  name=self.role, idle_tx_timeout_sec=self.shard_cfg.lease_sec)
            await self.pool.open(wait=True, timeout=30)
        await self.on_start()

        self.server, self.grpc_address = self.new_server(self.core.grpc_listen, "NOETL_GRPC_LISTEN")
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.add_servicers(self.server)
        reflection.enable((*self.service_names, health.SERVICE_NAME), self.server)
        await self.server.start()
        if self.core.health_listen:
            # plaintext, health only (probes cannot speak TLS): nothing else is served here
            self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            if self._health_server.add_insecure_port(self.core.health_listen) == 0:
                raise ConfigError(f"NOETL_HEALTH_LISTEN: cannot bind {self.core.health_listen}")
            await self._health_server.start()

        metrics.expose(self.role)
        mhost, _, mport = self.core.metrics_listen.rpartition(":")
        self._metrics_server, _ = start_http_server(int(mport or 0), addr=mhost or "127.0.0.1")
        self.metrics_address = f"{'127.0.0.1' if mhost in ('', '0.0.0.0') else mhost}:{self._metrics_server.server_port}"

        if self.joins:
            await self._join()
            self.spawn(self._membership_loop(), "membership")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        for name in self.service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        SERVING.set(1)
        await self.on_serving()
        self.spawn(self._health_loop(), "health")
        self._write_ready_file()
        logger.info("%s serving grpc=%s metrics=%s runtime_id=%s", self.role, self.grpc_address,
                    self.metrics_address, self.runtime_id)

    def pool_size(self) -> int:
        return 10

    def ready_info(self) -> dict[str, object]:
        """What the role adds to its ready file (e.g. the api's worker API address)."""
        return {}

    def max_receive_bytes(self) -> int:
        """The largest request message this role's gRPC server accepts."""
        return 16 * 1024 * 1024

    # ------------------------------------------------------------ health

    def gate(self) -> str | None:
        """Why RPCs (other than health) are refused right now, or None: while Postgres is
        unreachable every call would fail after a pool timeout anyway."""
        return self._postgres_down

    @property
    def problems(self) -> list[str]:
        return list(self._problems)

    def postgres_recently_down(self, within_sec: float) -> bool:
        """True while Postgres is unreachable from here, and for ``within_sec`` after it
        answers again (what others could not write meanwhile, e.g. heartbeats and claim
        renewals, must not be judged yet)."""
        if self._postgres_down is not None:
            return True
        return self._postgres_back_at is not None and time.monotonic() - self._postgres_back_at < within_sec

    async def _ping_postgres(self) -> str | None:
        """None when a dedicated connection (not the pool's: a busy pool is not an outage)
        answers ``SELECT 1`` within HEALTH_TIMEOUT_SEC, else what failed."""
        import psycopg

        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_SEC):
                if self._health_conn is None or self._health_conn.closed:
                    self._health_conn = await psycopg.AsyncConnection.connect(
                        self.core.postgres_dsn, autocommit=True, application_name=f"noetl-{self.role}-health",
                        connect_timeout=max(1, int(HEALTH_TIMEOUT_SEC)))
                await self._health_conn.execute("SELECT 1")
            return None
        except (psycopg.Error, OSError, TimeoutError) as exc:
            await self._close_health_conn()
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return text or "no answer"

    async def _close_health_conn(self) -> None:
        conn, self._health_conn = self._health_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _health_loop(self) -> None:
        """Every HEALTH_INTERVAL_SEC: reach Postgres, ask the role (NATS, shard loops), and
        report SERVING / NOT_SERVING accordingly (readiness), logging every change."""
        serving = True
        while not self._stop.is_set():
            problems: list[str] = []
            if self.core.postgres_dsn:
                failure = await self._ping_postgres()
                DEPENDENCY_UP.labels("postgres").set(0 if failure else 1)
                if failure:
                    since = self._postgres_down or f"postgres unavailable: {failure}"
                    self._postgres_down = since
                    problems.append(since)
                else:
                    if self._postgres_down is not None:
                        self._postgres_back_at = time.monotonic()
                    self._postgres_down = None
            try:
                problems += await self.check_health()
            except Exception as exc:  # a health probe must never stop the role
                problems.append(f"health check failed: {type(exc).__name__}: {exc}")
            self._problems = problems
            ok = not problems
            if ok != serving:
                serving = ok
                status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ("", *self.service_names):
                    await self.health.set(name, status)
                SERVING.set(1 if ok else 0)
                if ok:
                    logger.warning("%s SERVING again", self.role)
                else:
                    logger.warning("%s NOT_SERVING: %s", self.role, "; ".join(problems))
            if await self.sleep(HEALTH_INTERVAL_SEC):
                break
        await self._close_health_conn()

    def _write_ready_file(self) -> None:
        if not self.core.ready_file:
            return
        data = {"role": self.role, "pid": os.getpid(), "grpc": self.grpc_address,
                "metrics": self.metrics_address, "runtime_id": self.runtime_id,
                "instance": self.core.instance, **self.ready_info()}
        tmp = self.core.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, self.core.ready_file)

    async def shutdown(self) -> None:
        """Idempotent shutdown in named, time-limited steps."""
        if self._shut:
            return
        self._shut = True
        self._stop.set()
        grace = self.core.shutdown_grace_sec

        async def step(name: str, fn: Callable[[], Awaitable[Any]], limit: float) -> None:
            try:
                await asyncio.wait_for(fn(), timeout=limit)
            except TimeoutError:
                logger.warning("shutdown step %r exceeded %.1fs", name, limit)
            except Exception:
                logger.exception("shutdown step %r failed", name)

        await step("health NOT_SERVING", self.health.enter_graceful_shutdown, 1)
        if self.server is not None:
            await step("grpc stop", lambda: self.server.stop(grace), grace + 1)  # type: ignore[union-attr]
        if self._health_server is not None:
            await step("health port stop", lambda: self._health_server.stop(0), 2)  # type: ignore[union-attr]
        await step("role stop", self.on_stop, grace)
        if self.ownership is not None:
            await step("release shards", self._release_all, 2)
        if self._sm is not None and self.runtime_id:
            await step("leave", self._leave, 2)

        async def cancel_tasks() -> None:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        await step("background tasks", cancel_tasks, 3)
        if self._sm_channel is not None:
            await step("shard-manager channel", lambda: self._sm_channel.close(), 1)  # type: ignore[union-attr]
        if self.pool is not None:
            await step("postgres pool", lambda: self.pool.close(timeout=2), 3)  # type: ignore[union-attr]
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        logger.info("%s stopped", self.role)

    # ------------------------------------------------------------ membership

    def join_fields(self) -> dict[str, Any]:
        """Extra ``JoinRequest`` fields of this role (a worker's pool, labels and tools)."""
        return {}

    async def _join(self) -> None:
        self.core.require("shard_manager_target")
        if self._sm_channel is None:  # a rejoin reuses the channel
            self._sm_channel = self.channel(self.core.shard_manager_target)
            self._sm = sm_grpc.ShardManagerServiceStub(self._sm_channel)
        assert self._sm is not None
        deadline = time.monotonic() + 60
        while True:
            try:
                resp = await self._sm.Join(sm_pb2.JoinRequest(
                    role=self.role, instance=self.core.instance, address=self.grpc_address,
                    metrics_address=self.metrics_address, pid=os.getpid(), **self.join_fields()), timeout=5)
                break
            except grpc.RpcError as exc:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise grpcutil.translate(exc) from exc
                logger.info("shard-manager not ready (%s); retrying", exc.code())
                await asyncio.sleep(0.3)
        self.runtime_id = resp.runtime_id
        self.node_id = resp.node_id
        self._member_secret = resp.member_secret
        if self.sharded:
            if self.pool is None:
                raise ConfigError("sharded roles need NOETL_POSTGRES_DSN")
            # One ownership object for the process's life: shard workers hold it, and after a
            # rejoin they must see the new runtime id and the leases renewed under it.
            if self.ownership is None:
                self.ownership = ShardOwnership(self.pool, self.role, lease_sec=self.shard_cfg.lease_sec,
                                                margin_sec=self.shard_cfg.margin_sec)
            self.ownership.runtime_id = self.runtime_id
            # Export the lease counters from the start (0), not only after the first loss.
            LEASE_RENEWALS.labels(self.role)
            LEASE_LOSSES.labels(self.role)
        await self.on_joined()
        if self.ownership is not None:
            await self._reconcile({a.shard_id: a.epoch for a in resp.assignments})

    async def _reconcile(self, assigned: dict[int, int]) -> None:
        self._assigned = assigned
        if self.ownership is None:
            return
        gained, lost = await self.ownership.renew(assigned)
        LEASE_RENEWALS.labels(self.role).inc()
        if lost:
            LEASE_LOSSES.labels(self.role).inc(len(lost))
        self._owner_lost(lost)
        for s in gained:
            SHARD_OWNER.labels(self.role, str(s), self.core.instance).set(1)
        if gained or lost:
            logger.info("%s shards gained=%s lost=%s", self.role, sorted(gained), sorted(lost))
            await self.on_shards(gained, lost)
        self.on_reconciled()

    def _owner_lost(self, shards: set[int]) -> None:
        """A lost shard's ``noetl_shard_owner`` series goes away (not 0: another member
        holds it now, and its per-shard gauges are dropped by ``ShardTasks`` likewise)."""
        for s in shards:
            with contextlib.suppress(KeyError):
                SHARD_OWNER.remove(self.role, str(s), self.core.instance)

    def wake_membership(self) -> None:
        """Heartbeat now (e.g. the leader announced new assignments)."""
        self._wake_membership.set()

    async def _membership_loop(self) -> None:
        assert self._sm is not None
        # Heartbeat fast for a lease period after joining or after any change, so new
        # assignments are picked up quickly; then settle to the configured interval.
        fast_until = time.monotonic() + self.shard_cfg.lease_sec
        while not self._stop.is_set():
            interval = self.shard_cfg.heartbeat_sec
            if time.monotonic() < fast_until:
                interval = min(interval, 0.5)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_membership.wait(), timeout=interval)
            self._wake_membership.clear()
            if self._stop.is_set():
                return
            assigned = self._assigned
            try:
                resp = await self._sm.Heartbeat(
                    sm_pb2.HeartbeatRequest(runtime_id=self.runtime_id, role=self.role,
                                            member_secret=self._member_secret), timeout=interval)
                if resp.rejoin:
                    lost = self.ownership.clear() if self.ownership is not None else set()
                    logger.warning("shard-manager asked %s to rejoin; dropping shards %s", self.role, sorted(lost))
                    if lost:
                        LEASE_LOSSES.labels(self.role).inc(len(lost))
                        self._owner_lost(lost)
                        await self.on_shards({}, lost)
                    await self._join()
                    continue
                assigned = {a.shard_id: a.epoch for a in resp.assignments}
                if assigned != self._assigned:
                    fast_until = time.monotonic() + self.shard_cfg.lease_sec
            except grpc.RpcError as exc:
                logger.warning("heartbeat failed (%s); renewing held leases directly", exc.code())
            try:
                await self._reconcile(assigned)
            except NoetlError as exc:
                logger.warning("lease renewal failed: %s", exc)
                if self.ownership is not None:
                    expired = self.ownership.expire()
                    if expired:
                        LEASE_LOSSES.labels(self.role).inc(len(expired))
                        self._owner_lost(expired)
                        await self.on_shards({}, expired)

    async def _release_all(self) -> None:
        assert self.ownership is not None
        lost = self.ownership.clear()
        self._owner_lost(lost)
        if lost:
            await self.on_shards({}, lost)

    async def _leave(self) -> None:
        assert self._sm is not None
        with contextlib.suppress(grpc.RpcError):
            await self._sm.Leave(sm_pb2.LeaveRequest(runtime_id=self.runtime_id, member_secret=self._member_secret),
                                 timeout=2)


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the event loop ``NOETL_EVENT_LOOP`` names (None: asyncio's own)."""
    if name == "asyncio":
        return None
    import uvloop
    return uvloop.new_event_loop


def run_service(factory: Callable[[], Service]) -> int:
    """Entry point helper: logging, tracing (``NOETL_OTEL_*``), signals, run; exit code 0 on
    a clean stop, 2 on bad config."""
    setup_logging(os.environ.get("NOETL_LOG_LEVEL", "INFO"))
    try:
        svc = factory()
        svc.configure_security(load(AuthSettings), load(TlsSettings))
        tracing.setup(load(TracingSettings), role=svc.role, instance=svc.core.instance)
        if svc.hardened:
            harden.forget_secret_env()
            if not harden.not_dumpable():
                logging.getLogger("noetl").warning("could not mark the process not dumpable (prctl)")
    except ConfigError as exc:
        logging.getLogger("noetl").error("%s", exc)
        print(f"error: {exc}", flush=True)
        return 2

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, svc.request_stop)
        await svc.run()

    try:
        with asyncio.Runner(loop_factory=event_loop_factory(svc.core.event_loop)) as runner:
            runner.run(main())
    except ConfigError as exc:
        logging.getLogger("noetl").error("%s", exc)
        return 2
    finally:
        tracing.shutdown()  # flushes the exporter
    return 0
