"""``noetl-rt schedule ...``: schedules (docs/ARCHITECTURE.md "Schedules").

    schedule add NAME --path P [--version N] (--cron EXPR [--tz ZONE] | --every SECONDS)
                 [--payload JSON] [--catch-up skip|once|all] [--paused]     (admin token)
    schedule list [--next N] [--json]                                       (any reader)
    schedule pause NAME | resume NAME | delete NAME                         (admin token)
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from noetl_client import values
from noetl_common.schedules import CatchUp
from noetl_proto.v1 import schedule_pb2

from . import output
from .apichannel import Api, WithApi
from .client import parse_payload

POLICIES = {CatchUp.SKIP.value: schedule_pb2.CATCH_UP_POLICY_SKIP, CatchUp.ONCE.value: schedule_pb2.CATCH_UP_POLICY_ONCE,
            CatchUp.ALL.value: schedule_pb2.CATCH_UP_POLICY_ALL}
_POLICY_NAMES = {v: k for k, v in POLICIES.items()}

def add_parsers(sub: Any, with_api: argparse.ArgumentParser, run: WithApi) -> None:
    """The ``schedule`` command group; ``run(args, fn)`` calls ``fn`` with the api."""
    sc = sub.add_parser("schedule", help="schedules: run a catalog playbook on a cron or an interval"
                        ).add_subparsers(dest="action", metavar="ACTION")
    sc.required = True
    p = sc.add_parser("add", parents=[with_api], help="add a schedule (admin)")
    p.add_argument("name")
    p.add_argument("--path", required=True, help="the catalog path of the playbook (register it first)")
    p.add_argument("--version", type=int, default=0, help="a pinned version (default: the latest at each tick)")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help="five-field cron expression, e.g. '0 9 * * 1-5'")
    when.add_argument("--every", type=float, metavar="SECONDS", help="a fixed interval")
    p.add_argument("--tz", default="UTC", help="the cron's time zone (IANA name, default UTC)")
    p.add_argument("--payload", default="", help="a JSON object: the payload of each execution")
    p.add_argument("--catch-up", choices=list(POLICIES), default=CatchUp.SKIP.value,
                   help="missed ticks: skip them (default), run once for all, or run all")
    p.add_argument("--paused", action="store_true", help="create it paused")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: run(a, lambda api: add(api, a)))
    p = sc.add_parser("list", parents=[with_api], help="list schedules with their next runs")
    p.add_argument("--next", type=int, default=3, metavar="N", help="next runs shown per schedule (default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: run(a, lambda api: list_schedules(api, a.next, as_json=a.json)))
    for action, what in (("pause", "pause a schedule (admin): its ticks do not fire"),
                         ("resume", "resume a schedule (admin): from its next tick after now"),
                         ("delete", "delete a schedule (admin)")):
        p = sc.add_parser(action, parents=[with_api], help=what)
        p.add_argument("name")
        p.set_defaults(handler=lambda a, action=action: run(a, lambda api: change(api, action, a.name)))


def schedule_dict(s: schedule_pb2.Schedule) -> dict[str, Any]:
    return {"schedule_id": s.schedule_id, "name": s.name, "playbook_path": s.playbook_path,
            "playbook_version": s.playbook_version, "payload": values.from_struct(s.payload),
            "cron": s.cron, "time_zone": s.time_zone, "interval_ms": s.interval_ms,
            "catch_up": _POLICY_NAMES.get(s.catch_up, CatchUp.SKIP.value), "paused": s.paused, "shard_id": s.shard_id,
            "next_runs": [t.ToJsonString() for t in s.next_runs],
            "last_tick": s.last_tick.ToJsonString() if s.HasField("last_tick") else "",
            "last_execution_id": s.last_execution_id}


def _when(s: dict[str, Any]) -> str:
    if s["cron"]:
        return f"cron '{s['cron']}' {s['time_zone']}"
    return f"every {s['interval_ms'] / 1000:g}s"


def add(api: Api, a: argparse.Namespace) -> int:
    request = schedule_pb2.AddScheduleRequest(
        name=a.name, playbook_path=a.path, playbook_version=a.version, payload=values.to_struct(parse_payload(a.payload)),
        cron=a.cron or "", time_zone=a.tz if a.cron else "", interval_ms=round((a.every or 0) * 1000),
        catch_up=POLICIES[a.catch_up], paused=a.paused)
    s = schedule_dict(api.call(api.schedules.AddSchedule, request).schedule)
    if a.json:
        print(json.dumps(s))
    else:
        print(f"schedule {s['name']} ({_when(s)}, catch-up {s['catch_up']}): next runs "
              + (", ".join(s["next_runs"]) or "- (paused)"))
    return 0


def list_schedules(api: Api, next_runs: int, *, as_json: bool) -> int:
    resp = api.call(api.schedules.ListSchedules, schedule_pb2.ListSchedulesRequest(next_runs=next_runs))
    rows = [schedule_dict(s) for s in resp.schedules]
    if as_json:
        print(json.dumps(rows))
        return 0
    print(output.table([(r["name"], r["playbook_path"], _when(r), r["catch_up"],
                         "paused" if r["paused"] else "active", " ".join(r["next_runs"]) or "-",
                         r["last_execution_id"] or "-") for r in rows],
                       header=["NAME", "PATH", "WHEN", "CATCH-UP", "STATE", "NEXT RUNS", "LAST EXECUTION"]))
    return 0


def change(api: Api, action: str, name: str) -> int:
    if action == "delete":
        api.call(api.schedules.DeleteSchedule, schedule_pb2.DeleteScheduleRequest(name=name))
        print(f"deleted {name}")
        return 0
    if action == "pause":
        s = api.call(api.schedules.PauseSchedule, schedule_pb2.PauseScheduleRequest(name=name)).schedule
    else:
        s = api.call(api.schedules.ResumeSchedule, schedule_pb2.ResumeScheduleRequest(name=name)).schedule
    d = schedule_dict(s)
    print(f"{action}d {name}" + (f": next runs {', '.join(d['next_runs'])}" if d["next_runs"] else ""))
    return 0


__all__ = ["add_parsers", "schedule_dict"]
