"""``noetl-rt limit set|list|delete``: concurrency limits on catalog paths
(docs/ARCHITECTURE.md "Concurrency limits")."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from noetl_proto.v1 import concurrency_pb2

from . import output
from .apichannel import Api, WithApi


def add_parsers(sub: Any, with_api: argparse.ArgumentParser, run: WithApi, count: Callable[[str], Any]) -> None:
    """The ``limit`` command group; ``run(args, fn)`` calls ``fn`` with the api."""
    lc = sub.add_parser("limit", help="concurrency limits: at most N running executions of a path (per key)"
                        ).add_subparsers(dest="action", metavar="ACTION")
    lc.required = True
    p = lc.add_parser("set", parents=[with_api], help="set a limit (admin); the rest wait in submission order")
    p.add_argument("path", help="the catalog path of the playbook")
    p.add_argument("--max", type=count, required=True, metavar="N", help="at most N running at once")
    p.add_argument("--key", default="", metavar="TEMPLATE",
                   help="one queue per value of this template over the workload, e.g. '{{ workload.customer }}'")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: run(a, lambda api: set_limit(api, a.path, a.max, a.key, as_json=a.json)))
    p = lc.add_parser("list", parents=[with_api], help="limits with what runs and waits per key")
    p.add_argument("--path", default="", help="only this catalog path's")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: run(a, lambda api: list_limits(api, a.path, as_json=a.json)))
    p = lc.add_parser("delete", parents=[with_api], help="delete a limit (admin): its waiting executions start")
    p.add_argument("limit_id", type=int, metavar="ID")
    p.set_defaults(handler=lambda a: run(a, lambda api: delete_limit(api, a.limit_id)))


def limit_dict(limit: concurrency_pb2.ConcurrencyLimit) -> dict[str, Any]:
    return {"limit_id": limit.limit_id, "playbook_path": limit.playbook_path, "key_template": limit.key_template,
            "max_running": limit.max_running,
            "keys": [{"key": k.key, "running": k.running, "waiting": k.waiting} for k in limit.keys]}


def set_limit(api: Api, path: str, max_running: int, key: str, *, as_json: bool) -> int:
    resp = api.call(api.concurrency.SetLimit, concurrency_pb2.SetLimitRequest(
        playbook_path=path, key_template=key, max_running=max_running))
    if as_json:
        output.print_json(limit_dict(resp.limit))
    else:
        per = f" per {resp.limit.key_template}" if resp.limit.key_template else ""
        print(f"limit {resp.limit.limit_id}: at most {resp.limit.max_running} running of {path}{per}")
    return 0


def list_limits(api: Api, path: str, *, as_json: bool) -> int:
    resp = api.call(api.concurrency.ListLimits, concurrency_pb2.ListLimitsRequest(playbook_path=path))
    found = [limit_dict(limit) for limit in resp.limits]
    if as_json:
        output.print_json(found)
        return 0
    if not found:
        print("no concurrency limits")
        return 0
    rows = []
    for d in found:
        keys = ", ".join(f"{k['key'] or '-'}: {k['running']} running, {k['waiting']} waiting" for k in d["keys"])
        rows.append((str(d["limit_id"]), d["playbook_path"], d["key_template"] or "-", str(d["max_running"]),
                     keys or "idle"))
    print(output.table(rows, header=("ID", "PATH", "KEY", "MAX", "NOW")))
    return 0


def delete_limit(api: Api, limit_id: int) -> int:
    api.call(api.concurrency.DeleteLimit, concurrency_pb2.DeleteLimitRequest(limit_id=limit_id))
    print(f"limit {limit_id} deleted")
    return 0


__all__ = ["add_parsers", "limit_dict"]
