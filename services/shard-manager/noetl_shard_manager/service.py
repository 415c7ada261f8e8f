"""The shard-manager process: serves membership RPCs; the leader rebalances."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import grpc
from prometheus_client import Counter, Gauge

from noetl_common.config import CoreSettings, ShardSettings
from noetl_common.errors import NoetlError
from noetl_common.service import Service
from noetl_proto.v1 import shard_manager_pb2, shard_manager_pb2_grpc

from .membership import Membership
from .servicer import ShardManagerServicer

logger = logging.getLogger(__name__)

IS_LEADER = Gauge("noetl_shard_manager_leader", "1 while this replica is the leader", ["instance"])
MOVES = Counter("noetl_shard_moves_total", "Shard ownership changes made by the leader")


class ShardManagerService(Service):
    role = "shard-manager"
    joins = False
    service_names = (shard_manager_pb2.DESCRIPTOR.services_by_name["ShardManagerService"].full_name,)

    def __init__(self, core: CoreSettings, shard: ShardSettings) -> None:
        core.require("postgres_dsn")
        super().__init__(core, shard)
        self.leader_epoch: int | None = None
        self._kick = asyncio.Event()

    async def on_start(self) -> None:
        assert self.pool is not None
        self.membership = Membership(self.pool, shard_count=self.shard_cfg.count, lease_sec=self.shard_cfg.lease_sec)

    def add_servicers(self, server: grpc.aio.Server) -> None:
        shard_manager_pb2_grpc.add_ShardManagerServiceServicer_to_server(
            ShardManagerServicer(self.membership, self.shard_cfg, on_change=self._kick.set), server)

    async def on_serving(self) -> None:
        row = await self.membership.join(self.role, self.core.instance, self.grpc_address, self.metrics_address,
                                         os.getpid())
        self.runtime_id = int(row["runtime_id"])
        self.spawn(self._lead_loop(), "leader")

    async def _lead_loop(self) -> None:
        """Heartbeat, lead, rebalance. After an outage of Postgres that this replica saw,
        nobody could heartbeat during it: members are not declared dead until a lease has
        passed since it ended (they heartbeat again meanwhile)."""
        tick = min(self.shard_cfg.heartbeat_sec, 1.0) / 2
        outage_ended: float | None = None
        failing = False
        while not self.stopping:
            try:
                if not await self.membership.heartbeat(self.runtime_id):
                    row = await self.membership.join(self.role, self.core.instance, self.grpc_address,
                                                     self.metrics_address, os.getpid())
                    self.runtime_id = int(row["runtime_id"])
                epoch = await self.membership.try_lead(self.runtime_id, self.core.instance)
                if epoch != self.leader_epoch:
                    logger.info("leadership: %s", f"leader (epoch {epoch})" if epoch is not None else "standby")
                    self.leader_epoch = epoch
                IS_LEADER.labels(self.core.instance).set(1 if epoch is not None else 0)
                if failing:
                    failing, outage_ended = False, time.monotonic()
                    logger.warning("the database answers again; nobody is declared dead for %.1fs",
                                   self.shard_cfg.lease_sec)
                grace = outage_ended is not None and time.monotonic() - outage_ended < self.shard_cfg.lease_sec
                if epoch is not None:
                    MOVES.inc(await self.membership.rebalance(declare_dead=not grace))
            except NoetlError as exc:
                failing = True
                logger.warning("leader loop: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout=tick)
            self._kick.clear()

    async def on_stop(self) -> None:
        if self.leader_epoch is not None and self.pool is not None:
            try:
                await self.membership.resign(self.runtime_id)
            except NoetlError as exc:
                logger.warning("resign failed: %s", exc)
        if self.runtime_id and self.pool is not None:
            try:
                await self.membership.leave(self.runtime_id)
            except NoetlError:
                pass
