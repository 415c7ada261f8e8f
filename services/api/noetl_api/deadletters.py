"""DeadLetterService: list, inspect and redrive dead letters (docs/ARCHITECTURE.md "Dead
letters (as built)").

The engine writes ``noetl.dead_letter`` (``noetl_db.dead_letters``); this module reads it and
commits redrive requests (``noetl.redrive_request``), like a cancellation: the row is in
Postgres before the call answers, the NATS message is a nudge, and the shard's engine
sweeps committed requests. A redrive is checked here (``noetl_flow.refusal`` on the
execution's engine state, so a refusal is a clear FAILED_PRECONDITION at once) and again
by the engine when it applies it (what it refuses then is recorded in the row's
``refusal``)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from nats.js import JetStreamContext

from noetl_client import values
from noetl_common import auth, natsio
from noetl_common.db import Pool, autocommit, transaction
from noetl_common.errors import Conflict, InvalidInput, NoetlError, NotFound
from noetl_common.grpcutil import set_timestamp
from noetl_common.vocab import DeadLetterStatus, redrive_msg_id
from noetl_db import requests
from noetl_flow import ExecState, RedriveItem, refusal
from noetl_proto.v1 import common_pb2, deadletter_pb2, deadletter_pb2_grpc, messages_pb2

logger = logging.getLogger(__name__)

DEFAULT_PAGE = 100
MAX_PAGE = 1000

_STATUS_SQL: dict[int, str] = {
    deadletter_pb2.DEAD_LETTER_STATUS_DEAD: f"d.status = '{DeadLetterStatus.DEAD}' AND r.dead_letter_id IS NULL",
    deadletter_pb2.DEAD_LETTER_STATUS_REDRIVE_PENDING: "r.dead_letter_id IS NOT NULL",
    deadletter_pb2.DEAD_LETTER_STATUS_REDRIVEN: f"d.status = '{DeadLetterStatus.REDRIVEN}'",
}
_SELECT = (
    "SELECT d.*, x.playbook_path, r.dead_letter_id IS NOT NULL AS pending FROM noetl.dead_letter d"
    " LEFT JOIN noetl.redrive_request r ON r.dead_letter_id = d.dead_letter_id"
    " LEFT JOIN noetl.execution x ON x.execution_id = d.execution_id"
)
# ErrorInfo's own fields; anything else the error carries goes to details
_ERROR_FIELDS = ("code", "message", "kind", "retryable", "exception_type", "traceback", "status_code")


def error_pb(error: dict[str, Any]) -> common_pb2.ErrorInfo:
    details = {k: v for k, v in error.items() if k not in _ERROR_FIELDS and k != "type"}
    status_code = error.get("status_code")
    return common_pb2.ErrorInfo(
        code=str(error.get("code") or ""), message=str(error.get("message") or ""), kind=str(error.get("kind") or ""),
        retryable=bool(error.get("retryable")), exception_type=str(error.get("exception_type") or ""),
        traceback=str(error.get("traceback") or ""),
        status_code=status_code if isinstance(status_code, int) and not isinstance(status_code, bool) else 0,
        details=values.to_struct(details, default=str, too_deep="json") if details else None)


def dead_letter_pb(row: dict[str, Any]) -> deadletter_pb2.DeadLetter:
    if row["status"] == "redriven":
        status = deadletter_pb2.DEAD_LETTER_STATUS_REDRIVEN
    elif row.get("pending"):
        status = deadletter_pb2.DEAD_LETTER_STATUS_REDRIVE_PENDING
    else:
        status = deadletter_pb2.DEAD_LETTER_STATUS_DEAD
    out = deadletter_pb2.DeadLetter(
        dead_letter_id=row["dead_letter_id"], execution_id=row["execution_id"], shard_id=row["shard_id"],
        command_id=row["command_id"], step=row["step"], loop_instance=row["loop_instance"] or "",
        loop_index=row["loop_index"] or 0, attempts=row["attempts"], reason=row["reason"],
        error=error_pb(row["error"] or {}), worker_id=row["worker_id"] or "", status=status,
        redrive_command_id=row["redrive_command_id"] or "", redriven_by=row["redriven_by"] or "",
        refusal=row["refusal"] or "", playbook_path=row.get("playbook_path") or "")
    set_timestamp(out.created_at, row["created_at"])
    set_timestamp(out.redriven_at, row["redriven_at"])
    return out


def _item(row: dict[str, Any]) -> RedriveItem:
    return RedriveItem(int(row["dead_letter_id"]), row["command_id"], row["step"], row["reason"],
                       row["loop_instance"], row["loop_index"], row["status"], row["redrive_command_id"])


class DeadLetterStore:
    """The api's reads of dead letters and its writes of redrive requests."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    async def page(self, *, execution_id: int, status: int, step: str, path: str, size: int,
                   before: int) -> list[dict[str, Any]]:
        where, params = [], []
        for cond, value in (("d.execution_id = %s", execution_id), ("d.step = %s", step),
                            ("x.playbook_path = %s", path), ("d.dead_letter_id < %s", before)):
            if value:
                where.append(cond)
                params.append(value)
        if status:
            where.append(_STATUS_SQL[status])
        sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY d.dead_letter_id DESC LIMIT %s"
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(sql, (*params, size))
            return list(await cur.fetchall())

    async def get(self, dead_letter_id: int) -> dict[str, Any]:
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(_SELECT + " WHERE d.dead_letter_id = %s", (dead_letter_id,))
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"dead letter {dead_letter_id} not found")
        return dict(row)

    async def why_not(self, conn: Any, row: dict[str, Any]) -> str | None:
        """Why the dead letter cannot be redriven now (None: it can)."""
        cur = await conn.execute("SELECT 1 AS x FROM noetl.manifest WHERE execution_id = %s", (row["execution_id"],))
        if await cur.fetchone() is not None:
            return (f"execution {row['execution_id']} was compacted (its events are gone, past"
                    " NOETL_RETENTION_DAYS): it cannot be redriven")
        cur = await conn.execute("SELECT state FROM noetl.engine_state WHERE execution_id = %s",
                                 (row["execution_id"],))
        state = await cur.fetchone()
        return refusal(ExecState.from_json(state["state"]) if state else None, _item(row))

    async def redrivable(self, row: dict[str, Any]) -> str | None:
        if row.get("pending"):
            return f"a redrive of dead letter {row['dead_letter_id']} is pending already"
        async with autocommit(self._pool) as conn:
            return await self.why_not(conn, row)

    async def request_redrive(self, dead_letter_id: int, requested_by: str) -> tuple[dict[str, Any], bool]:
        """Commit a redrive request (Conflict naming why it cannot be redriven); returns
        the dead letter and whether a request was pending already."""
        async with transaction(self._pool) as conn:
            cur = await conn.execute(_SELECT + " WHERE d.dead_letter_id = %s", (dead_letter_id,))
            row = await cur.fetchone()
            if row is None:
                raise NotFound(f"dead letter {dead_letter_id} not found")
            row = dict(row)
            cur = await conn.execute("SELECT submitted_by FROM noetl.execution_request WHERE execution_id = %s",
                                     (row["execution_id"],))
            req = await cur.fetchone()
            try:
                auth.own_or_admin(req["submitted_by"] if req else None)
            except NotFound:
                raise NotFound(f"dead letter {dead_letter_id} not found") from None
            if row["pending"]:
                return row, True
            why = await self.why_not(conn, row)
            if why is not None:
                raise Conflict(f"dead letter {dead_letter_id} cannot be redriven: {why}")
            await requests.request_redrive(conn, dead_letter_id, row["execution_id"], row["shard_id"], requested_by)
        row["pending"] = True
        return row, False


class DeadLetterServicer(deadletter_pb2_grpc.DeadLetterServiceServicer):
    def __init__(self, store: DeadLetterStore, js: JetStreamContext) -> None:
        self._store = store
        self._js = js

    async def ListDeadLetters(self, request: deadletter_pb2.ListDeadLettersRequest,
                              context: grpc.aio.ServicerContext) -> deadletter_pb2.ListDeadLettersResponse:
        size = request.page_size or DEFAULT_PAGE
        if not 0 < size <= MAX_PAGE:
            raise InvalidInput(f"page_size: between 1 and {MAX_PAGE}, got {request.page_size}")
        if request.status and request.status not in _STATUS_SQL:
            raise InvalidInput(f"status: unknown dead letter status {request.status}")
        before = 0
        if request.page_token:
            try:
                before = int(request.page_token)
            except ValueError:
                raise InvalidInput(f"page_token: {request.page_token!r} is not a token ListDeadLetters returned"
                                   ) from None
        rows = await self._store.page(execution_id=request.execution_id, status=request.status,
                                      step=request.step, path=request.playbook_path, size=size, before=before)
        return deadletter_pb2.ListDeadLettersResponse(
            dead_letters=[dead_letter_pb(r) for r in rows],
            next_page_token=str(rows[-1]["dead_letter_id"]) if len(rows) == size else "")

    async def GetDeadLetter(self, request: deadletter_pb2.GetDeadLetterRequest,
                            context: grpc.aio.ServicerContext) -> deadletter_pb2.GetDeadLetterResponse:
        row = await self._store.get(request.dead_letter_id)
        why = await self._store.redrivable(row)
        return deadletter_pb2.GetDeadLetterResponse(dead_letter=dead_letter_pb(row), redrivable=why is None,
                                                    not_redrivable_reason=why or "")

    async def RedriveDeadLetter(self, request: deadletter_pb2.RedriveDeadLetterRequest,
                                context: grpc.aio.ServicerContext) -> deadletter_pb2.RedriveDeadLetterResponse:
        """Committed to Postgres (``noetl.redrive_request``) before it is acknowledged;
        the NATS message is a nudge (the shard's engine sweeps committed requests)."""
        if request.dead_letter_id <= 0:
            raise InvalidInput("dead_letter_id: a dead letter id is a positive number")
        who = auth.current.get()
        row, already = await self._store.request_redrive(request.dead_letter_id, who.name if who else "")
        if not already:
            msg = messages_pb2.EngineInput(redrive=messages_pb2.RedriveRequested(execution_id=row["execution_id"]))
            try:
                await natsio.publish(self._js, natsio.events_subject(row["shard_id"], natsio.KIND_REDRIVE),
                                     msg.SerializeToString(), msg_id=redrive_msg_id(request.dead_letter_id))
            except NoetlError as exc:  # committed: the engine's sweep applies it
                logger.warning("redrive nudge for dead letter %s not published (%s); the shard sweep applies it",
                               request.dead_letter_id, exc)
        return deadletter_pb2.RedriveDeadLetterResponse(dead_letter=dead_letter_pb(row), already_requested=already)


__all__ = ["DeadLetterServicer", "DeadLetterStore", "dead_letter_pb"]
