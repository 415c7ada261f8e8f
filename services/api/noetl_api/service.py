"""The api role's process: wires settings, pools, NATS and the servicers together."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from nats.aio.client import Client as NATS

from noetl_common import natsio, reflection
from noetl_common.auth import runtime_secret
from noetl_common.config import (
    CommandSettings,
    CoreSettings,
    CredentialSettings,
    ExecutionSettings,
    LimitSettings,
    NatsSettings,
    ResultStoreSettings,
    ScheduleSettings,
    ShardSettings,
)
from noetl_common.ids import SnowflakeGenerator
from noetl_common.retry import retry_transient
from noetl_common.service import Service
from noetl_common.shardtasks import ShardTasks, shard_health
from noetl_db.schedules import ScheduleStore
from noetl_dsl import templates
from noetl_proto.v1 import (
    auth_pb2,
    auth_pb2_grpc,
    catalog_pb2,
    catalog_pb2_grpc,
    concurrency_pb2,
    concurrency_pb2_grpc,
    deadletter_pb2,
    deadletter_pb2_grpc,
    execution_pb2,
    execution_pb2_grpc,
    schedule_pb2,
    schedule_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from noetl_store import CachedResultStore, make_result_store

from .admission import GAUGE_REFRESH_SEC, Admission
from .catalog import Catalog
from .claims import Claims
from .concurrency import ConcurrencyServicer
from .credentials import CredentialStore
from .deadletters import DeadLetterServicer, DeadLetterStore
from .decoding import UndecodableRequests
from .engine.shard import EngineDeps, ShardEngine
from .grants import CredentialGrants
from .keyring import Keyring
from .queries import Queries
from .reruns import Rerunner
from .schedules import ScheduleServicer
from .servicers import CatalogServicer, CredentialServicer, ExecutionServicer, WorkerServicer
from .submissions import Submitter
from .tokens import AuthServicer

CLAIM_KEY = "claim_key"

logger = logging.getLogger(__name__)

# Results the api keeps in process (engine templates, GetExecution with results).
RESULT_CACHE_ITEMS = 2048
# How long the start waits out an unreachable Postgres for the credential check.
STARTUP_RETRY_SEC = 60.0


class ApiService(Service):
    role = "api"
    sharded = True
    # the client API; WorkerService is served on its own port (NOETL_WORKER_API_LISTEN)
    service_names = (
        execution_pb2.DESCRIPTOR.services_by_name["ExecutionService"].full_name,
        catalog_pb2.DESCRIPTOR.services_by_name["CatalogService"].full_name,
        catalog_pb2.DESCRIPTOR.services_by_name["CredentialService"].full_name,
        auth_pb2.DESCRIPTOR.services_by_name["AuthService"].full_name,
        schedule_pb2.DESCRIPTOR.services_by_name["ScheduleService"].full_name,
        concurrency_pb2.DESCRIPTOR.services_by_name["ConcurrencyService"].full_name,
        deadletter_pb2.DESCRIPTOR.services_by_name["DeadLetterService"].full_name,
    )
    worker_service_names = (worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,)

    def __init__(self, core: CoreSettings, shard: ShardSettings, commands: CommandSettings,
                 executions: ExecutionSettings, results: ResultStoreSettings | None = None,
                 limits: LimitSettings | None = None, nats: NatsSettings | None = None,
                 credentials: CredentialSettings | None = None, schedules: ScheduleSettings | None = None) -> None:
        self.results_cfg = results or ResultStoreSettings()
        # Parsed at once: a malformed NOETL_CREDENTIALS_KEYS stops the process before it starts.
        self.keyring = Keyring.parse((credentials or CredentialSettings.model_construct()).keys.get_secret_value())
        core.require("postgres_dsn", "nats_url", "shard_manager_target")
        super().__init__(core, shard)
        self.commands = commands
        self.executions = executions
        self.limits = limits or LimitSettings.model_construct()
        self.nats_cfg = nats or NatsSettings.model_construct()
        self.schedules_cfg = schedules or ScheduleSettings.model_construct()
        self.nc: NATS | None = None
        self.reconnects = natsio.Reconnects()
        self.engines: ShardTasks | None = None
        self.worker_server: grpc.aio.Server | None = None
        self.worker_grpc_address = ""

    def server_interceptors(self) -> list[Any]:
        # innermost: a request protobuf cannot decode (a payload nested too deep) is refused
        # as INVALID_ARGUMENT saying why (decoding.py)
        return [*super().server_interceptors(), UndecodableRequests()]

    def max_receive_bytes(self) -> int:
        # Twice a playbook and a payload at their limits: a request somewhat over a limit
        # gets the limit's own message (INVALID_ARGUMENT naming the setting); one far
        # beyond is refused by gRPC before it is read (RESOURCE_EXHAUSTED).
        return 2 * (self.limits.playbook_bytes + self.limits.payload_bytes) + 4 * 1024 * 1024

    def pool_size(self) -> int:
        return 24

    async def on_start(self) -> None:
        assert self.pool is not None
        templates.configure(self.limits)  # the engine renders `when` / `set` / loop collections
        self.nc = await natsio.connect(self.core.nats_url, name=self.core.instance, reconnects=self.reconnects,
                                       role=self.role, **self.core.nats_options())
        self.js = self.nc.jetstream()
        await self._ensure_streams()
        # A NATS that lost its store comes back without the streams; workers may not
        # create them (their NATS user), the api does, at once.
        self.reconnects.listen(self._on_reconnect)
        self.catalog = Catalog(self.pool, limits=self.limits, loop_batch=self.executions.loop_batch_max,
                               loop_batch_ms=self.executions.loop_batch_ms)
        # The api reads every tier (engine templates, GetExecution with results).
        self.results = CachedResultStore(await make_result_store(self.results_cfg, self.pool, self.js),
                                         max_items=RESULT_CACHE_ITEMS)
        self.queries = Queries(self.pool, self.results)
        # the replicas' shared key of claim tokens (a result must echo its claim's)
        self.claim_key = await runtime_secret(self.pool, CLAIM_KEY)
        self.claims = Claims(self.pool, self.catalog, self.commands.lease_sec, self.claim_key)
        # Before serving: no plaintext credential left, every row opens with the keys given
        # (ConfigError naming NOETL_CREDENTIALS_KEYS otherwise; credentials.py).
        self.credentials = CredentialStore(self.pool, self.keyring)
        await retry_transient("checking the stored credentials", self.credentials.prepare,
                              deadline_sec=STARTUP_RETRY_SEC, initial=0.2, cap=5.0)
        self.grants = CredentialGrants(self.claims, self.catalog, self.credentials, self.results)

    async def _ensure_streams(self) -> None:
        assert self.js is not None
        await natsio.ensure_streams(self.js, command_ack_wait_sec=max(5.0, self.commands.lease_sec),
                                    replicas=self.nats_cfg.stream_replicas)

    def _on_reconnect(self) -> None:
        self.spawn(self._streams_after_reconnect(), "nats-streams")

    async def _streams_after_reconnect(self) -> None:
        try:
            await retry_transient("re-creating the nats streams after a reconnect", self._ensure_streams,
                                  deadline_sec=STARTUP_RETRY_SEC, initial=0.2, cap=2.0)
        except Exception as exc:
            logger.warning("nats streams not ensured after a reconnect: %s", exc)

    def add_servicers(self, server: grpc.aio.Server) -> None:
        assert self.nc is not None and self.pool is not None
        # The submitter needs the snowflake node id, known only after Join: bound in _ready().
        self.execution_servicer = ExecutionServicer(None, self.queries, self.nc, self.js, self.claim_key)
        execution_pb2_grpc.add_ExecutionServiceServicer_to_server(self.execution_servicer, server)
        catalog_pb2_grpc.add_CatalogServiceServicer_to_server(CatalogServicer(self.catalog), server)
        catalog_pb2_grpc.add_CredentialServiceServicer_to_server(CredentialServicer(self.credentials), server)
        auth_pb2_grpc.add_AuthServiceServicer_to_server(AuthServicer(self.pool), server)
        schedule_pb2_grpc.add_ScheduleServiceServicer_to_server(ScheduleServicer(
            ScheduleStore(self.pool, shard_count=self.shard_cfg.count), self.catalog, self.schedules_cfg,
            self.limits), server)
        concurrency_pb2_grpc.add_ConcurrencyServiceServicer_to_server(ConcurrencyServicer(self.pool, self.catalog),
                                                                      server)
        deadletter_pb2_grpc.add_DeadLetterServiceServicer_to_server(
            DeadLetterServicer(DeadLetterStore(self.pool), self.js), server)
        # the worker API: its own server and port, so the client port can be the only one
        # reachable from outside the release (docs/DEPLOY.md "Security")
        self.worker_server, self.worker_grpc_address = self.new_server(self.core.worker_api_listen,
                                                                       "NOETL_WORKER_API_LISTEN")
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(self.claims, self.grants),
                                                            self.worker_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.worker_server)
        reflection.enable((*self.worker_service_names, health.SERVICE_NAME), self.worker_server)

    def _ready(self) -> ShardTasks:
        """Bind what needs the Join answer (node id, shard ownership); idempotent."""
        if self.engines is None:
            assert self.pool is not None and self.nc is not None and self.ownership is not None
            self.ids = SnowflakeGenerator(self.node_id)
            self.admission = admission = Admission(self.pool, max_active=self.executions.max_active,
                                                   max_queued=self.executions.max_queued_commands)
            submitter = Submitter(
                self.pool, self.catalog, self.ids, self.js, shard_count=self.shard_cfg.count,
                default_timeout_sec=self.executions.default_timeout_sec, admission=admission, limits=self.limits,
                results=self.results, local=self._local_submission)
            self.execution_servicer.bind(submitter, Rerunner(self.pool, self.catalog, submitter))
            deps = EngineDeps(self.pool, self.nc, self.js, self.catalog, self.results, self.ownership,
                              self.commands, self.executions, limits=self.limits, reconnects=self.reconnects,
                              claim_key=self.claim_key, claims=self.claims)
            ownership = self.ownership
            self.engines = ShardTasks("engine", lambda shard, epoch: ShardEngine(deps, shard, epoch),
                                      still_held=lambda shard, epoch: ownership.epoch(shard) == epoch)
        return self.engines

    def _local_submission(self, shard: int, execution_id: int, row: dict[str, Any] | None) -> bool:
        """Hand a submission to this process's engine of ``shard``, if it runs one."""
        engine = self.engines.worker(shard) if self.engines is not None else None
        return isinstance(engine, ShardEngine) and engine.take_submission(execution_id, row)

    async def on_joined(self) -> None:
        # A rejoin hands out a new node id (the old one was freed when this member was
        # declared dead and may be in use elsewhere): new execution ids must use it.
        if self.engines is not None and self.ids.node_id != self.node_id:
            self.ids.rebind(self.node_id)

    async def on_shards(self, gained: dict[int, int], lost: set[int]) -> None:
        await self._ready().apply(gained, lost)

    def on_reconciled(self) -> None:
        if self.engines is not None:
            self.engines.ensure()

    async def check_health(self) -> list[str]:
        if self.engines is None:
            return []
        return shard_health(self.engines, self.nc)

    async def on_serving(self) -> None:
        self._ready()
        assert self.worker_server is not None
        await self.worker_server.start()
        for name in self.worker_service_names:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.spawn(self._measure_loop(), "admission-gauges")

    def ready_info(self) -> dict[str, object]:
        return {"worker_grpc": self.worker_grpc_address}

    async def _measure_loop(self) -> None:
        """Keep noetl_active_executions / noetl_queued_commands current without submissions."""
        while True:
            try:
                await self.admission.measure()
            except Exception as exc:  # a gauge refresh: never worth stopping the api for
                logger.warning("measuring active executions failed: %s", exc)
            if await self.sleep(GAUGE_REFRESH_SEC):
                return

    async def on_stop(self) -> None:
        if self.worker_server is not None:
            await self.worker_server.stop(self.core.shutdown_grace_sec)
        try:
            if self.engines is not None:
                await self.engines.stop_all()
            if self.nc is not None:
                await self.nc.drain()
        finally:
            if getattr(self, "results", None) is not None:
                await self.results.close()
