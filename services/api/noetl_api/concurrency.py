"""ConcurrencyService: the limits an operator sets on catalog paths (the engine applies
them: ``engine/limits.py``; docs/ARCHITECTURE.md "Concurrency limits")."""

from __future__ import annotations

from typing import Any

import grpc

from noetl_common.db import Pool, autocommit
from noetl_common.errors import InvalidInput, NotFound
from noetl_common.grpcutil import set_timestamp
from noetl_db import limits as limits_db
from noetl_dsl.templates import TemplateError, referenced_names
from noetl_proto.v1 import concurrency_pb2, concurrency_pb2_grpc

from .catalog import Catalog

MAX_RUNNING = 1_000_000
MAX_TEMPLATE = 1000
# names a key template may read: the workload (the playbook's, merged with the payload)
KEY_NAMES = frozenset({"workload", "payload", "vars", "execution_id", "job"})


def key_template(text: str) -> str:
    template = text.strip()
    if len(template) > MAX_TEMPLATE:
        raise InvalidInput(f"key_template: at most {MAX_TEMPLATE} characters, got {len(template)}")
    if not template:
        return ""
    try:
        names = referenced_names(template)
    except TemplateError as exc:
        raise InvalidInput(f"key_template: {exc}") from exc
    if "{{" not in template and "{%" not in template:
        raise InvalidInput(f"key_template: {template!r} is not a template; every execution would share one "
                           "key (leave it empty for that): write e.g. '{{ workload.customer }}'")
    unknown = sorted(names - KEY_NAMES)
    if unknown:
        raise InvalidInput(f"key_template: reads {', '.join(unknown)}; a key may read only "
                           f"{', '.join(sorted(KEY_NAMES))}")
    return template


def limit_pb(row: dict[str, Any], keys: list[dict[str, Any]]) -> concurrency_pb2.ConcurrencyLimit:
    out = concurrency_pb2.ConcurrencyLimit(limit_id=row["limit_id"], playbook_path=row["path"],
                                           key_template=row["key_template"], max_running=row["max_running"])
    set_timestamp(out.created_at, row["created_at"])
    for k in keys:
        out.keys.add(key=k["key"], running=k["running"], waiting=k["waiting"])
    return out


class ConcurrencyServicer(concurrency_pb2_grpc.ConcurrencyServiceServicer):
    def __init__(self, pool: Pool, catalog: Catalog) -> None:
        self._pool = pool
        self._catalog = catalog

    async def SetLimit(self, request: concurrency_pb2.SetLimitRequest,
                       context: grpc.aio.ServicerContext) -> concurrency_pb2.SetLimitResponse:
        path = request.playbook_path.strip()
        if not path:
            raise InvalidInput("playbook_path: a limit is set on a catalog path")
        if not 0 < request.max_running <= MAX_RUNNING:
            raise InvalidInput(f"max_running: between 1 and {MAX_RUNNING}, got {request.max_running}")
        template = key_template(request.key_template)
        try:
            await self._catalog.get(path, 0)
        except NotFound as exc:
            raise InvalidInput(f"playbook_path: {exc} in the catalog (register it first)") from exc
        async with autocommit(self._pool) as conn:
            row = await limits_db.set_limit(conn, path, template, request.max_running)
        return concurrency_pb2.SetLimitResponse(limit=limit_pb(row, []))

    async def ListLimits(self, request: concurrency_pb2.ListLimitsRequest,
                         context: grpc.aio.ServicerContext) -> concurrency_pb2.ListLimitsResponse:
        async with autocommit(self._pool) as conn:
            rows = await limits_db.limits_of(conn, request.playbook_path)
            keys: dict[int, list[dict[str, Any]]] = {}
            for k in await limits_db.keys_of(conn, [r["limit_id"] for r in rows]):
                keys.setdefault(k["limit_id"], []).append(k)
        return concurrency_pb2.ListLimitsResponse(limits=[limit_pb(r, keys.get(r["limit_id"], [])) for r in rows])

    async def DeleteLimit(self, request: concurrency_pb2.DeleteLimitRequest,
                          context: grpc.aio.ServicerContext) -> concurrency_pb2.DeleteLimitResponse:
        async with autocommit(self._pool) as conn, conn.transaction():
            # its slots go; its queue stays until each waiter's shard sweeps it (a waiter
            # whose limit is gone starts: noetl_db.limits.heads)
            if not await limits_db.delete_limit(conn, request.limit_id):
                raise NotFound(f"concurrency limit {request.limit_id} not found")
        return concurrency_pb2.DeleteLimitResponse(deleted=True)


async def waiting_reason(conn: Any, execution_id: int) -> str:
    """Why a PENDING execution has not started ('' when it is not queued)."""
    parts = []
    for r in await limits_db.waits(conn, execution_id):
        if r["path"] is None:
            parts.append(f"concurrency limit {r['limit_id']} (deleted): starting at its shard's next sweep")
            continue
        key = f", key {r['key']!r}" if r["key"] else ""
        parts.append(f"concurrency limit {r['limit_id']} ({r['path']}{key}): {r['running']} of {r['max_running']}"
                     f" running, {r['ahead']} waiting ahead")
    return "; ".join(parts)


__all__ = ["ConcurrencyServicer", "key_template", "waiting_reason"]
