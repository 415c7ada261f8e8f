"""ScheduleService: a thin adapter over ``noetl_db.schedules`` (validation here,
firing in the reaper; docs/ARCHITECTURE.md "Schedules")."""

from __future__ import annotations

from typing import Any

import grpc

from noetl_client import values
from noetl_common import auth
from noetl_common.config import LimitSettings, ScheduleSettings
from noetl_common.errors import InvalidInput, NotFound
from noetl_common.grpcutil import set_timestamp
from noetl_common.schedules import CatchUp, Spec, next_runs, parse_catch_up
from noetl_db.schedules import ScheduleStore, spec_of
from noetl_proto.v1 import schedule_pb2, schedule_pb2_grpc

from .catalog import Catalog
from .submissions import parse_payload

MAX_NAME = 200
MAX_NEXT_RUNS = 100

_POLICY_PB = {CatchUp.SKIP: schedule_pb2.CATCH_UP_POLICY_SKIP, CatchUp.ONCE: schedule_pb2.CATCH_UP_POLICY_ONCE,
              CatchUp.ALL: schedule_pb2.CATCH_UP_POLICY_ALL}
_POLICY = {v: k for k, v in _POLICY_PB.items()} | {schedule_pb2.CATCH_UP_POLICY_UNSPECIFIED: CatchUp.SKIP}


def schedule_pb(row: dict[str, Any], runs: int = 3) -> schedule_pb2.Schedule:
    spec = spec_of(row)
    out = schedule_pb2.Schedule(
        schedule_id=row["schedule_id"], name=row["name"], playbook_path=row["catalog_path"],
        playbook_version=row["catalog_version"], payload=values.to_struct(row["payload"], default=str, too_deep="json"), cron=spec.cron,
        time_zone=spec.time_zone, interval_ms=spec.interval_ms, catch_up=_POLICY_PB[parse_catch_up(row["catch_up"])],
        paused=row["paused"], shard_id=row["shard_id"], last_execution_id=row.get("last_execution_id") or 0)
    set_timestamp(out.created_at, row["created_at"])
    set_timestamp(out.last_tick, row.get("last_tick"))
    if not row["paused"]:
        for t in next_runs(spec, row["next_tick"], runs):
            set_timestamp(out.next_runs.add(), t)
    return out


def _name(text: str) -> str:
    name = text.strip()
    if not name:
        raise InvalidInput("name: a schedule needs a name")
    if len(name) > MAX_NAME:
        raise InvalidInput(f"name: at most {MAX_NAME} characters, got {len(name)}")
    return name


class ScheduleServicer(schedule_pb2_grpc.ScheduleServiceServicer):
    def __init__(self, store: ScheduleStore, catalog: Catalog, settings: ScheduleSettings,
                 limits: LimitSettings) -> None:
        self._store = store
        self._catalog = catalog
        self._settings = settings
        self._limits = limits

    async def AddSchedule(self, request: schedule_pb2.AddScheduleRequest,
                          context: grpc.aio.ServicerContext) -> schedule_pb2.AddScheduleResponse:
        name = _name(request.name)
        if request.catch_up not in _POLICY:
            raise InvalidInput(f"catch_up: unknown policy {request.catch_up}")
        spec = Spec(cron=request.cron.strip(), time_zone=request.time_zone.strip() or "UTC",
                    interval_ms=request.interval_ms).validate(self._settings.min_interval_sec)
        try:
            payload = parse_payload(request.payload, self._limits)
        except InvalidInput as exc:
            raise InvalidInput(f"payload: {exc}") from exc
        if not request.playbook_path:
            raise InvalidInput("playbook_path: a schedule runs a catalog playbook (register it first)")
        try:
            await self._catalog.get(request.playbook_path, request.playbook_version)
        except NotFound as exc:
            raise InvalidInput(f"playbook_path: {exc} in the catalog (register it first)") from exc
        who = auth.require_identity()
        row = await self._store.add(name=name, path=request.playbook_path, version=request.playbook_version,
                                    payload=payload, spec=spec, catch_up=_POLICY[request.catch_up],
                                    paused=request.paused, created_by=who.token_id if who else None)
        return schedule_pb2.AddScheduleResponse(schedule=schedule_pb(row))

    async def ListSchedules(self, request: schedule_pb2.ListSchedulesRequest,
                            context: grpc.aio.ServicerContext) -> schedule_pb2.ListSchedulesResponse:
        runs = request.next_runs or 3
        if not 0 < runs <= MAX_NEXT_RUNS:
            raise InvalidInput(f"next_runs: between 1 and {MAX_NEXT_RUNS}, got {runs}")
        return schedule_pb2.ListSchedulesResponse(schedules=[schedule_pb(r, runs) for r in await self._store.all()])

    async def PauseSchedule(self, request: schedule_pb2.PauseScheduleRequest,
                            context: grpc.aio.ServicerContext) -> schedule_pb2.PauseScheduleResponse:
        return schedule_pb2.PauseScheduleResponse(schedule=schedule_pb(await self._store.pause(_name(request.name))))

    async def ResumeSchedule(self, request: schedule_pb2.ResumeScheduleRequest,
                             context: grpc.aio.ServicerContext) -> schedule_pb2.ResumeScheduleResponse:
        return schedule_pb2.ResumeScheduleResponse(schedule=schedule_pb(await self._store.resume(_name(request.name))))

    async def DeleteSchedule(self, request: schedule_pb2.DeleteScheduleRequest,
                             context: grpc.aio.ServicerContext) -> schedule_pb2.DeleteScheduleResponse:
        name = _name(request.name)
        if not await self._store.delete(name):
            raise NotFound(f"schedule {name!r} not found")
        return schedule_pb2.DeleteScheduleResponse(deleted=True)
