"""Thin gRPC adapters: protobuf <-> domain calls. Errors are mapped by the interceptor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import struct_pb2
from nats.aio.client import Client as NATS
from prometheus_client import Counter

from noetl_client import values
from noetl_common import auth, natsio
from noetl_common.coalesce import to_boundary
from noetl_common.errors import (
    InvalidInput,
    NoetlError,
    NotFound,
    NotQualified,
    PermissionDenied,
    Unavailable,
)
from noetl_common.grpcutil import set_timestamp
from noetl_common.pools import DEFAULT_POOL, Priority
from noetl_common.vocab import ExecutionStatus, StepViewStatus, cancel_msg_id
from noetl_proto.v1 import (
    catalog_pb2,
    catalog_pb2_grpc,
    common_pb2,
    execution_pb2,
    execution_pb2_grpc,
    messages_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

from .catalog import Catalog, CatalogEntry
from .claims import Claimed, Claims, WorkerPlacement
from .credentials import KINDS, CredentialStore
from .grants import CredentialGrants
from .queries import TERMINAL, Queries
from .reruns import Rerunner
from .submissions import Submitter
from .watching import WatchHub

logger = logging.getLogger(__name__)

RERUNS = Counter("noetl_reruns_total", "RerunExecution calls answered: a new rerun started, or a retried call's "
                 "rerun answered again (idempotency key)", ["outcome"])
for _outcome in ("started", "deduplicated"):
    RERUNS.labels(_outcome)  # the series exist (0) from the start


def json_value(value: Any) -> struct_pb2.Value:
    """A JSON value (a step's result) as the client API sends it: numbers and depth as
    ``noetl_client.values`` says; a container nested deeper than a Value can carry is sent
    as its JSON text (docs/CLIENTS.md "JSON values and numbers")."""
    return values.to_value(value, default=str, too_deep="json")


def json_struct(value: Any) -> struct_pb2.Struct:
    """A JSON object (an event's envelope or meta) as a Struct; anything else is wrapped
    as ``{"value": ...}`` (never the case for what the engine records)."""
    return values.to_struct(value if isinstance(value, dict) else {"value": value}, default=str, too_deep="json")


def _execution_pb(row: dict[str, Any]) -> execution_pb2.Execution:
    ex = execution_pb2.Execution(
        execution_id=row["execution_id"], shard_id=row["shard_id"] or 0,
        playbook_path=row.get("playbook_path") or "", playbook_version=row.get("playbook_version") or 0,
        status=common_pb2.ExecutionStatus.Value(ExecutionStatus(row["status"]).proto_name),
        error=row.get("error") or "", parent_execution_id=row.get("parent_execution_id") or 0,
        last_shard_seq=row.get("last_shard_seq") or 0, waiting=row.get("waiting") or "",
        rerun_of=row.get("rerun_of") or 0,
    )
    for field in ("created_at", "started_at", "ended_at"):
        set_timestamp(getattr(ex, field), row.get(field))
    for s in row.get("steps", []):
        step = ex.steps.add(name=s["step"], status=common_pb2.StepStatus.Value(StepViewStatus(s["status"]).proto_name),
                            attempts=s["attempts"] or 0, visits=s["visits"] or 0, error=s.get("error") or "",
                            waiting=s.get("waiting") or "")
        if "result" in s:
            step.result.CopyFrom(json_value(s["result"]))
        if s.get("result_ref_id"):
            step.result_ref.CopyFrom(common_pb2.ResultReference(ref_id=s["result_ref_id"],
                                                                type=s.get("result_tier") or "",
                                                                uri=s.get("result_uri") or ""))
        for field in ("started_at", "ended_at"):
            set_timestamp(getattr(step, field), s.get(field))
        if s.get("loop_total") is not None:  # a loop step (the projector saw its loop start)
            step.loop.CopyFrom(execution_pb2.LoopProgress(total=s["loop_total"], done=s.get("loop_done") or 0,
                                                          failed=s.get("loop_failed") or 0))
    return ex


def _trace_entry_pb(e: dict[str, Any]) -> execution_pb2.TraceEntry:
    out = execution_pb2.TraceEntry(
        ref_id=e["ref_id"], parent_ref_id=e.get("parent_ref_id") or 0, tier=e.get("tier") or "",
        uri=e.get("uri") or "", size_bytes=e.get("size_bytes") or 0, task=e.get("task") or "",
        command_id=e.get("command_id") or "", step=e.get("step") or "", sha256=e.get("sha256") or "")
    set_timestamp(out.created_at, e.get("created_at"))
    return out


def _entry_pb(e: CatalogEntry, with_content: bool = True) -> catalog_pb2.CatalogEntry:
    out = catalog_pb2.CatalogEntry(catalog_id=e.catalog_id, path=e.path, version=e.version, kind=e.kind,
                                   name=e.name, content=e.content if with_content else "",
                                   content_sha256=e.content_sha256)
    set_timestamp(out.created_at, e.created_at)
    return out


def check_parent_claim(claim_key: bytes, claim: execution_pb2.ParentClaim, parent_execution_id: int) -> None:
    """A worker token acts on sub-playbooks only: ``claim`` must be a claim the api handed
    out (its token verifies) of a command of ``parent_execution_id``."""
    who = auth.require_identity()
    if who is None or who.role is not auth.Role.WORKER:
        return
    if not claim.claim_token or not parent_execution_id:
        raise PermissionDenied("a worker token acts only on sub-playbooks of a command it holds (parent_claim)")
    if not claim.command_id.startswith(f"{parent_execution_id}:") or not auth.claim_token_valid(
            claim_key, claim.claim_token, claim.command_id, claim.attempt, claim.worker_id):
        raise PermissionDenied("parent_claim is not a claim of a command of the parent execution")


class ExecutionServicer(execution_pb2_grpc.ExecutionServiceServicer):
    def __init__(self, submitter: Submitter | None, queries: Queries, nc: NATS, js: Any,
                 claim_key: bytes = b"") -> None:
        self._submitter_ = submitter
        self._rerunner_: Rerunner | None = None
        self._queries = queries
        self._nc = nc
        self._js = js
        self._claim_key = claim_key
        self._hub: WatchHub | None = None

    def bind(self, submitter: Submitter, rerunner: Rerunner | None = None) -> None:
        self._submitter_ = submitter
        self._rerunner_ = rerunner

    @property
    def _submitter(self) -> Submitter:
        if self._submitter_ is None:
            raise Unavailable("the api is starting (not joined yet); retry")
        return self._submitter_

    async def SubmitExecution(self, request: execution_pb2.SubmitExecutionRequest,
                              context: grpc.aio.ServicerContext) -> execution_pb2.SubmitExecutionResponse:
        which = request.WhichOneof("playbook")
        check_parent_claim(self._claim_key, request.parent_claim, request.parent_execution_id)
        sub = await self._submitter.submit(
            playbook_yaml=request.playbook_yaml if which == "playbook_yaml" else "",
            path=request.ref.path if which == "ref" else "", version=request.ref.version if which == "ref" else 0,
            payload=request.payload, idempotency_key=request.idempotency_key,
            timeout_sec=request.timeout_seconds, parent_execution_id=request.parent_execution_id,
            priority=PRIORITY_NAMES.get(request.priority, ""))
        return execution_pb2.SubmitExecutionResponse(
            execution_id=sub.execution_id, shard_id=sub.shard_id, playbook_path=sub.entry.path,
            playbook_version=sub.entry.version, deduplicated=sub.deduplicated)

    async def RerunExecution(self, request: execution_pb2.RerunExecutionRequest,
                             context: grpc.aio.ServicerContext) -> execution_pb2.RerunExecutionResponse:
        if self._rerunner_ is None:
            raise Unavailable("the api is starting (not joined yet); retry")
        sub, plan = await self._rerunner_.rerun(request.execution_id, from_step=request.from_step,
                                                key=request.idempotency_key, timeout_sec=request.timeout_seconds)
        RERUNS.labels("deduplicated" if sub.deduplicated else "started").inc()
        return execution_pb2.RerunExecutionResponse(
            execution_id=sub.execution_id, shard_id=sub.shard_id, playbook_path=sub.entry.path,
            playbook_version=sub.entry.version, deduplicated=sub.deduplicated, rerun_of=request.execution_id,
            rerun_steps=list(plan.steps) if plan else [], kept_steps=list(plan.kept) if plan else [])

    async def GetExecution(self, request: execution_pb2.GetExecutionRequest,
                           context: grpc.aio.ServicerContext) -> execution_pb2.GetExecutionResponse:
        row = await self._queries.execution(request.execution_id, request.include_results)
        return execution_pb2.GetExecutionResponse(execution=_execution_pb(row))

    async def ListExecutions(self, request: execution_pb2.ListExecutionsRequest,
                             context: grpc.aio.ServicerContext) -> execution_pb2.ListExecutionsResponse:
        status = ""
        if request.status:
            status = common_pb2.ExecutionStatus.Name(request.status).removeprefix("EXECUTION_STATUS_")
        rows, token = await self._queries.list(page_size=request.page_size, page_token=request.page_token,
                                               status=status, path=request.playbook_path)
        return execution_pb2.ListExecutionsResponse(executions=[_execution_pb(r) for r in rows],
                                                    next_page_token=token)

    async def WatchExecution(self, request: execution_pb2.WatchExecutionRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[execution_pb2.WatchExecutionResponse]:
        """Reads the read model when the projector hints a change: at once for the hint of
        a terminal status, else at most every WATCH_MIN_INTERVAL_SEC (a running loop's hints
        come per projector batch; its watchers get the latest state, not every one).
        Without a hint, it checks the projected version every second and reads only if it
        moved. The streams of this replica share their subscriptions, reads and checks
        (``watching.WatchHub``)."""
        hub = self._watch_hub()
        eid = request.execution_id
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        async with hub.watching(eid, wake) as watched:
            last: tuple[Any, ...] | None = None
            while True:
                wake.clear()
                read_at = loop.time()
                row = await hub.read(eid, request.include_results, watched)
                key = (row["status"], row.get("last_shard_seq"), len(row["steps"]))
                if key != last:
                    last = key
                    yield execution_pb2.WatchExecutionResponse(execution=_execution_pb(row))
                if row["status"] in TERMINAL:
                    return
                seen = (str(row["status"]), int(row.get("last_shard_seq") or 0))
                while not wake.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), timeout=to_boundary(hub.backstop_sec))
                    if not wake.is_set() and (now := await hub.version(eid)) is not None and now != seen:
                        break  # it moved, and no hint said so
                while not watched.final and (pause := WATCH_MIN_INTERVAL_SEC - (loop.time() - read_at)) > 0:
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), timeout=pause)

    def _watch_hub(self) -> WatchHub:
        if self._hub is None:
            self._hub = WatchHub(self._nc, self._queries.execution, self._queries.versions)
        return self._hub

    async def CancelExecution(self, request: execution_pb2.CancelExecutionRequest,
                              context: grpc.aio.ServicerContext) -> execution_pb2.CancelExecutionResponse:
        """Committed to Postgres (``noetl.cancel_request``) before it is acknowledged; the
        NATS message is a nudge (the shard's engine sweeps committed cancellations)."""
        row = await self._queries.execution(request.execution_id)
        check_parent_claim(self._claim_key, request.parent_claim, row.get("parent_execution_id") or 0)
        auth.own_or_admin(await self._queries.submitted_by(request.execution_id))
        if row["status"] in TERMINAL:
            return execution_pb2.CancelExecutionResponse(accepted=False)
        reason = request.reason or "cancelled by request"
        await self._queries.request_cancel(request.execution_id, row["shard_id"], reason)
        msg = messages_pb2.EngineInput(cancel=messages_pb2.CancelRequested(
            execution_id=request.execution_id, reason=reason))
        try:
            await natsio.publish(self._js, natsio.events_subject(row["shard_id"], natsio.KIND_CANCEL),
                                 msg.SerializeToString(), msg_id=cancel_msg_id(request.execution_id))
        except NoetlError as exc:  # committed: the engine's sweep applies it
            logger.warning("cancel nudge for execution %s not published (%s); the shard sweep applies it",
                           request.execution_id, exc)
        return execution_pb2.CancelExecutionResponse(accepted=True)

    async def ListQuarantined(self, request: execution_pb2.ListQuarantinedRequest,
                              context: grpc.aio.ServicerContext) -> execution_pb2.ListQuarantinedResponse:
        rows = await self._queries.quarantined(request.execution_id, request.page_size)
        out = execution_pb2.ListQuarantinedResponse()
        for r in rows:
            item = out.inputs.add(quarantine_id=r["quarantine_id"], shard_id=r["shard_id"],
                                  execution_id=r["execution_id"], input_kind=r["input_kind"],
                                  stream_seq=r["stream_seq"] or 0, attempts=r["attempts"], error=r["error"])
            set_timestamp(item.created_at, r["created_at"])
        return out

    async def GetEvents(self, request: execution_pb2.GetEventsRequest,
                        context: grpc.aio.ServicerContext) -> execution_pb2.GetEventsResponse:
        rows = await self._queries.events(request.execution_id, request.after_event_id, request.page_size)
        out = execution_pb2.GetEventsResponse()
        for r in rows:
            ev = out.events.add(event_id=r["event_id"], execution_id=r["execution_id"], shard_id=r["shard_id"],
                                shard_seq=r["shard_seq"], event_type=r["event_type"], step=r["step"] or "",
                                command_id=r["command_id"] or "", meta=json_struct(r["meta"] or {}))
            if r["result"] is not None:
                ev.result.CopyFrom(json_struct(r["result"]))
            set_timestamp(ev.created_at, r["created_at"])
        return out


    async def GetTrace(self, request: execution_pb2.GetTraceRequest,
                       context: grpc.aio.ServicerContext) -> execution_pb2.GetTraceResponse:
        entries, from_manifest = await self._queries.trace(request.execution_id, request.step)
        return execution_pb2.GetTraceResponse(entries=[_trace_entry_pb(e) for e in entries],
                                              from_manifest=from_manifest)


class CatalogServicer(catalog_pb2_grpc.CatalogServiceServicer):
    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    async def RegisterPlaybook(self, request: catalog_pb2.RegisterPlaybookRequest,
                               context: grpc.aio.ServicerContext) -> catalog_pb2.RegisterPlaybookResponse:
        if not request.content.strip():
            raise InvalidInput("content is empty")
        entry, created = await self._catalog.register(request.content)
        return catalog_pb2.RegisterPlaybookResponse(entry=_entry_pb(entry), created=created)

    async def GetPlaybook(self, request: catalog_pb2.GetPlaybookRequest,
                          context: grpc.aio.ServicerContext) -> catalog_pb2.GetPlaybookResponse:
        return catalog_pb2.GetPlaybookResponse(entry=_entry_pb(await self._catalog.get(request.path, request.version)))

    async def ListPlaybooks(self, request: catalog_pb2.ListPlaybooksRequest,
                            context: grpc.aio.ServicerContext) -> catalog_pb2.ListPlaybooksResponse:
        size = min(max(request.page_size or 100, 1), 1000)
        entries = await self._catalog.list(request.path_prefix, size, request.page_token)
        token = entries[-1].path if len(entries) == size else ""
        return catalog_pb2.ListPlaybooksResponse(entries=[_entry_pb(e, False) for e in entries],
                                                 next_page_token=token)


class CredentialServicer(catalog_pb2_grpc.CredentialServiceServicer):
    """Stores credentials (sealed, ``credentials.py``) and lists their names. No RPC of
    this service returns a credential's data."""

    KINDS = KINDS

    def __init__(self, store: CredentialStore) -> None:
        self._store = store

    async def PutCredential(self, request: catalog_pb2.PutCredentialRequest,
                            context: grpc.aio.ServicerContext) -> catalog_pb2.PutCredentialResponse:
        created = await self._store.put(request.name, request.kind, values.from_struct(request.data))
        return catalog_pb2.PutCredentialResponse(name=request.name, created=created)

    async def ListCredentials(self, request: catalog_pb2.ListCredentialsRequest,
                              context: grpc.aio.ServicerContext) -> catalog_pb2.ListCredentialsResponse:
        out = catalog_pb2.ListCredentialsResponse()
        for r in await self._store.names():
            info = out.credentials.add(name=r["name"], kind=r["kind"])
            set_timestamp(info.updated_at, r["updated_at"])
        return out


# WatchExecution reads a running execution's read model at most this often (a terminal
# status is read as soon as the projector hints it).
WATCH_MIN_INTERVAL_SEC = 0.1

PRIORITY_NAMES = {execution_pb2.PRIORITY_HIGH: Priority.HIGH.value, execution_pb2.PRIORITY_NORMAL: Priority.NORMAL.value,
                  execution_pb2.PRIORITY_LOW: Priority.LOW.value}


def _placement(p: worker_pb2.WorkerPlacement) -> WorkerPlacement:
    return WorkerPlacement(tuple(p.pools) or (DEFAULT_POOL,), dict(p.labels), tuple(p.tools))


# A ClaimCommands answer stops carrying commands past this many bytes (the rest come back
# deferred): a batch of commands with large loop items never outgrows a gRPC message.
CLAIMS_ANSWER_BUDGET = 4 * 1024 * 1024


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, claims: Claims, grants: CredentialGrants | None = None) -> None:
        self._claims = claims
        self._grants = grants

    async def ClaimCommand(self, request: worker_pb2.ClaimCommandRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ClaimCommandResponse:
        if not request.command_id or not request.worker_id:
            raise InvalidInput("command_id and worker_id are required")
        got = await self._claims.claim(request.command_id, request.worker_id, request.attempt,
                                       _placement(request.placement))
        return worker_pb2.ClaimCommandResponse(command=got.to_proto())

    async def ClaimCommands(self, request: worker_pb2.ClaimCommandsRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.ClaimCommandsResponse:
        if not request.worker_id or any(not c.command_id for c in request.claims):
            raise InvalidInput("worker_id and every claim's command_id are required")
        if len(request.claims) > 1000:
            raise InvalidInput(f"at most 1000 claims per call, got {len(request.claims)}")
        outcomes = await self._claims.claim_many([(c.command_id, c.attempt) for c in request.claims],
                                                 request.worker_id, _placement(request.placement))
        out = worker_pb2.ClaimCommandsResponse()
        size = 0
        for c, got in zip(request.claims, outcomes, strict=True):
            if isinstance(got, Claimed):
                command = got.to_proto()
                size += command.ByteSize()
                if size > CLAIMS_ANSWER_BUDGET and len(out.outcomes) > 0:
                    # claimed for this worker all the same: it claims again and gets it back
                    out.outcomes.add(command_id=c.command_id, failure=worker_pb2.CLAIM_FAILURE_DEFERRED,
                                     message="claimed; the answer is deferred to keep this response small:"
                                             " claim it again")
                    continue
                out.outcomes.add(command_id=c.command_id, command=command)
            else:
                failure = (worker_pb2.CLAIM_FAILURE_NOT_FOUND if isinstance(got, NotFound)
                           else worker_pb2.CLAIM_FAILURE_NOT_QUALIFIED if isinstance(got, NotQualified)
                           else worker_pb2.CLAIM_FAILURE_NOT_CLAIMABLE)
                out.outcomes.add(command_id=c.command_id, failure=failure, message=str(got))
        return out

    async def RenewLease(self, request: worker_pb2.RenewLeaseRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.RenewLeaseResponse:
        until, reason = await self._claims.renew(request.command_id, request.worker_id, request.attempt,
                                                 request.progress_json)
        out = worker_pb2.RenewLeaseResponse(stop=until is None, stop_reason=reason)
        set_timestamp(out.lease_until, until)
        return out

    async def GetCredential(self, request: worker_pb2.GetCredentialRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.GetCredentialResponse:
        if not request.command_id or not request.worker_id or not request.name:
            raise InvalidInput("command_id, worker_id and name are required")
        if self._grants is None:
            raise Unavailable("this api does not serve credentials")
        cred = await self._grants.resolve(request.command_id, request.attempt, request.worker_id, request.name,
                                          request.claim_token)
        return worker_pb2.GetCredentialResponse(name=cred.name, kind=cred.kind, data_json=json.dumps(cred.data))


__all__ = ["CatalogServicer", "CredentialServicer", "ExecutionServicer", "NotFound", "WorkerServicer"]
