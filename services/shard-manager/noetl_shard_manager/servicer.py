"""ShardManagerService: thin adapter over Membership."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from noetl_common import auth
from noetl_common.config import ShardSettings
from noetl_common.errors import InvalidInput, PermissionDenied
from noetl_common.grpcutil import set_timestamp
from noetl_common.pools import DEFAULT_POOL, pool_problem
from noetl_proto.v1 import shard_manager_pb2 as pb
from noetl_proto.v1 import shard_manager_pb2_grpc

from .membership import Membership


class ShardManagerServicer(shard_manager_pb2_grpc.ShardManagerServiceServicer):
    def __init__(self, membership: Membership, cfg: ShardSettings, on_change: Callable[[], None]) -> None:
        self._m = membership
        self._cfg = cfg
        self._on_change = on_change  # wakes the leader loop: membership changed

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        if not request.role or not request.instance:
            raise InvalidInput("role and instance are required")
        who = auth.require_identity()
        if who is not None and who.role is auth.Role.WORKER and request.role != "worker":
            raise PermissionDenied(f"a worker token may join as a worker only, not as {request.role!r}")
        placement = None
        if request.role == "worker":  # what it serves: read by the reaper and GetExecution (unschedulable commands)
            for name in request.pools:
                if why := pool_problem(name):
                    raise InvalidInput(why)
            placement = (list(request.pools) or [DEFAULT_POOL], dict(request.labels), list(request.tools) or None)
        row = await self._m.join(request.role, request.instance, request.address, request.metrics_address,
                                 request.pid, placement)
        self._on_change()
        out = pb.JoinResponse(runtime_id=row["runtime_id"], node_id=row["node_id"], shard_count=self._cfg.count,
                              heartbeat_seconds=self._cfg.heartbeat_sec, lease_seconds=self._cfg.lease_sec,
                              member_secret=row["member_secret"])
        for a in await self._m.assignments(request.role, row["runtime_id"]):
            set_timestamp(out.assignments.add(shard_id=a["shard_id"], epoch=a["epoch"]).leased_until, a["leased_until"])
        return out

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        if not await self._m.heartbeat(request.runtime_id, request.member_secret):
            return pb.HeartbeatResponse(rejoin=True)
        out = pb.HeartbeatResponse()
        for a in await self._m.assignments(request.role, request.runtime_id):
            set_timestamp(out.assignments.add(shard_id=a["shard_id"], epoch=a["epoch"]).leased_until, a["leased_until"])
        return out

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        if not await self._m.leave(request.runtime_id, request.member_secret):
            raise PermissionDenied(f"runtime {request.runtime_id}: not this membership (its member secret is needed)")
        self._on_change()
        return pb.LeaveResponse()

    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        d = await self._m.describe(request.role)
        out = pb.DescribeResponse()
        if d["leader"]:
            out.leader_instance = d["leader"]["holder_instance"] or ""
            out.leader_epoch = d["leader"]["epoch"]
        for m in d["members"]:
            member = out.members.add(runtime_id=m["runtime_id"], role=m["role"], instance=m["instance"],
                                     address=m["address"] or "", metrics_address=m["metrics_address"] or "",
                                     alive=bool(m["alive"]), pid=m["pid"] or 0)
            set_timestamp(member.heartbeat_at, m["heartbeat_at"])
        for s in d["shards"]:
            owner = out.shards.add(role=s["role"], shard_id=s["shard_id"], owner_runtime_id=s["owner_runtime_id"] or 0,
                                   owner_instance=s["owner_instance"] or "", epoch=s["epoch"])
            set_timestamp(owner.leased_until, s["leased_until"])
        return out
