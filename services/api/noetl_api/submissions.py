"""SubmitExecution: validate, pin the catalog version, commit the request, nudge the owner.

The Postgres commit, not the NATS ack, makes a submission durable: the shard owner
also sweeps committed requests it has not started, so a lost nudge costs latency only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

from google.protobuf import struct_pb2
from nats.js import JetStreamContext

from noetl_client import values
from noetl_common import auth, natsio, tracing
from noetl_common.config import LimitSettings
from noetl_common.db import Pool, autocommit
from noetl_common.errors import InvalidInput, NoetlError, NotFound, PlaybookInvalid
from noetl_common.ids import SnowflakeGenerator, shard_for
from noetl_common.limits import check, check_depth, exceeded
from noetl_common.pools import priority_problem
from noetl_common.vocab import submit_msg_id
from noetl_db import requests
from noetl_dsl import Playbook, merged_workload
from noetl_proto.v1 import messages_pb2
from noetl_store import ResultStore, encode_json

from .admission import Admission
from .catalog import Catalog, CatalogEntry, parse
from .static_checks import check_templates, credential_refs, playbook_refs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    execution_id: int
    shard_id: int
    entry: CatalogEntry
    deduplicated: bool


def parse_payload(struct: struct_pb2.Struct, limits: LimitSettings | None = None) -> dict[str, Any]:
    """A submission's payload (``SubmitExecutionRequest.payload``, ``AddScheduleRequest.payload``)
    as a dict: within NOETL_LIMIT_PAYLOAD_BYTES (its encoded size) and
    NOETL_LIMIT_NESTING_DEPTH. Numbers read as ``noetl_client.values`` reads them."""
    check(struct.ByteSize(), "payload_bytes", limits, "payload", unit="bytes")
    value = values.from_struct(struct)
    check_depth(value, limits, what="payload")
    return value


async def decode_payload(struct: struct_pb2.Struct, limits: LimitSettings | None = None) -> tuple[dict[str, Any], int]:
    """``parse_payload`` off the event loop when the payload is large; (payload, its size)."""
    size = struct.ByteSize()
    payload = (await asyncio.to_thread(parse_payload, struct, limits) if size > 64 * 1024
               else parse_payload(struct, limits))
    return payload, size


# The result-store "task" of a workload stored by reference (NOETL_LIMIT_INLINE_WORKLOAD_BYTES).
WORKLOAD_TASK = "workload"


def _prepare(playbook_yaml: str, playbook: Playbook | None, payload: dict[str, Any],
             limits: LimitSettings) -> tuple[Playbook, dict[str, Any], bytes]:
    """The CPU part of a submission (parse, merge, compile every template), run off the
    event loop: (playbook, workload, the workload encoded)."""
    if playbook is None:
        playbook = parse(playbook_yaml, limits)
    workload = merged_workload(playbook, payload)
    check_templates(playbook, workload)
    return playbook, workload, encode_json(workload)


# A submission's CPU part (``_prepare``) runs on the event loop when its playbook was parsed
# before and both texts are at most this long: then it is the workload merge and the
# template checks, about 0.07 ms for the bench's 3-step playbook, far less than a hop to a
# thread (whose result waits for the loop's thread to let go of the GIL, up to 5 ms under
# load). A new or large text is parsed and checked in a thread.
INLINE_PREPARE_BYTES = 16 * 1024

# Hands a committed submission to this process's engine of its shard: (shard,
# execution_id, the request row as committed or None) -> whether one took it (then no NATS
# nudge is sent).
LocalEngines = Callable[[int, int, "dict[str, Any] | None"], bool]

# A request row whose payload is at most this large comes back from its insert to be handed
# to the engine with it (decoding a larger one would hold up the loop; the engine reads it).
HANDED_ROW_PAYLOAD_BYTES = 64 * 1024


class Submitter:
    def __init__(self, pool: Pool, catalog: Catalog, ids: SnowflakeGenerator,
                 js: JetStreamContext, *, shard_count: int, default_timeout_sec: float,
                 admission: Admission | None = None, limits: LimitSettings | None = None,
                 results: ResultStore | None = None, local: LocalEngines | None = None) -> None:
        self._limits = limits or LimitSettings.model_construct()
        self._results = results
        self._admission = admission
        self._pool = pool
        self._catalog = catalog
        self._ids = ids
        self._js = js
        self._shards = shard_count
        self._default_timeout = default_timeout_sec
        self._local = local

    async def submit(self, *, playbook_yaml: str = "", path: str = "", version: int = 0,
                     payload: struct_pb2.Struct | None = None, idempotency_key: str = "", timeout_sec: float = 0.0,
                     parent_execution_id: int = 0, parent_step: str = "", priority: str = "") -> Submission:
        """Validate, pin the catalog version, commit the request and nudge its shard's
        engine. A submission whose idempotency key is already committed returns that
        execution (``deduplicated``), whatever this call would have run into: its insert
        conflicts, or, when it fails on its way there (the playbook no longer valid, the
        runtime full), the committed one is looked up then. The usual submission is one
        statement: no read ahead of the insert."""
        try:
            return await self._submit(playbook_yaml=playbook_yaml, path=path, version=version, payload=payload,
                                      idempotency_key=idempotency_key, timeout_sec=timeout_sec,
                                      parent_execution_id=parent_execution_id, parent_step=parent_step,
                                      priority=priority)
        except NoetlError:
            if idempotency_key:
                try:
                    existing = await self.existing(idempotency_key)
                except NoetlError:
                    existing = None
                if existing is not None:
                    return existing
            raise

    async def _submit(self, *, playbook_yaml: str, path: str, version: int, payload: struct_pb2.Struct | None,
                      idempotency_key: str, timeout_sec: float, parent_execution_id: int, parent_step: str,
                      priority: str) -> Submission:
        fields, size = await decode_payload(payload if payload is not None else struct_pb2.Struct(), self._limits)
        if timeout_sec < 0:
            raise InvalidInput("timeout_seconds must not be negative")
        if priority and (why := priority_problem(priority)):
            raise InvalidInput(why)
        depth = await self._depth(parent_execution_id)
        known: Playbook | None = None
        entry: CatalogEntry | None = None
        if not playbook_yaml:
            if not path:
                raise InvalidInput("either playbook_yaml or a playbook reference (path) is required")
            entry = await self._catalog.get(path, version)
            known = (await self._catalog.compiled(entry.catalog_id)).playbook
            text_bytes = len(entry.content)
        else:
            known = self._catalog.parsed(playbook_yaml)  # the same text again: parsed once
            text_bytes = len(playbook_yaml)
        if known is not None and text_bytes <= INLINE_PREPARE_BYTES and size <= INLINE_PREPARE_BYTES:
            playbook, workload, encoded = _prepare(playbook_yaml, known, fields, self._limits)
        else:  # parsing and compiling templates never hold up the loop that drives engines and leases
            playbook, workload, encoded = await asyncio.to_thread(_prepare, playbook_yaml, known, fields,
                                                                  self._limits)
        if playbook_yaml:
            self._catalog.remember(playbook_yaml, playbook)
        await self._check_credentials(playbook, workload)
        await self._check_playbook_refs(playbook)
        if self._admission is not None:
            await self._admission.check()
        if idempotency_key and len(encoded) > self._limits.inline_workload_bytes:
            # a retry is answered before its workload is stored again (it would be left
            # behind, referenced by nothing)
            existing = await self.existing(idempotency_key)
            if existing is not None:
                return existing
        latest_of = ""
        if playbook_yaml:  # registered only once everything above accepted it
            entry = self._catalog.registered(playbook_yaml)
            if entry is not None:
                latest_of = entry.path  # still the latest? the insert checks
            else:
                entry, _ = await self._catalog.register(playbook_yaml, playbook)
        assert entry is not None
        execution_id = self._ids.next_id()
        workload_ref = await self._workload_reference(execution_id, workload, encoded)
        commit = functools.partial(self.commit, execution_id, payload=fields, idempotency_key=idempotency_key,
                                   parent_execution_id=parent_execution_id, parent_step=parent_step,
                                   timeout_sec=timeout_sec, depth=depth, workload_ref=workload_ref, size=size,
                                   priority=priority)
        sub = await commit(entry, latest_of=latest_of)
        if sub is None:  # the remembered version is no longer the latest: register the text again
            self._catalog.forget(entry)
            entry, _ = await self._catalog.register(playbook_yaml, playbook)
            sub = await commit(entry)
        assert sub is not None
        if not sub.deduplicated:
            logger.info("submitted execution %s (%s v%s) shard %s", execution_id, entry.path, entry.version,
                        sub.shard_id)
        return sub

    @overload
    async def commit(self, execution_id: int, entry: CatalogEntry, payload: dict[str, Any], *,
                     idempotency_key: str = "", parent_execution_id: int = 0, parent_step: str = "",
                     timeout_sec: float = 0.0, depth: int = 0, workload_ref: int | None = None, size: int = 0,
                     rerun_of: int | None = None, rerun_from: str | None = None, priority: str = "",
                     latest_of: Literal[""] = "") -> Submission: ...

    @overload
    async def commit(self, execution_id: int, entry: CatalogEntry, payload: dict[str, Any], *,
                     idempotency_key: str = "", parent_execution_id: int = 0, parent_step: str = "",
                     timeout_sec: float = 0.0, depth: int = 0, workload_ref: int | None = None, size: int = 0,
                     rerun_of: int | None = None, rerun_from: str | None = None, priority: str = "",
                     latest_of: str) -> Submission | None: ...

    async def commit(self, execution_id: int, entry: CatalogEntry, payload: dict[str, Any], *,
                     idempotency_key: str = "", parent_execution_id: int = 0, parent_step: str = "",
                     timeout_sec: float = 0.0, depth: int = 0, workload_ref: int | None = None, size: int = 0,
                     rerun_of: int | None = None, rerun_from: str | None = None, priority: str = "",
                     latest_of: str = "") -> Submission | None:
        """Commit an execution request (before the caller answers), then nudge its shard's
        engine; a request with the same idempotency key committed first wins (returned
        ``deduplicated``). ``rerun_of``/``rerun_from``: a rerun (reruns.py). ``priority``: the
        submission's, over the playbook's (empty: the playbook's). ``latest_of``: ``entry``
        must still be the latest version of that catalog path, else nothing is committed
        and None returned."""
        shard = shard_for(execution_id, self._shards)
        timeout = timeout_sec or self._default_timeout
        encoded = json.dumps(payload)
        async with autocommit(self._pool) as conn:  # one statement: its own transaction
            inserted = await requests.insert_submission_row(
                conn, execution_id=execution_id, shard_id=shard, catalog_id=entry.catalog_id,
                payload=encoded, idempotency_key=idempotency_key or None,
                parent_execution_id=parent_execution_id or None, parent_step=parent_step or None, timeout_sec=timeout,
                # the engine continues this trace for every command (engine/traces.py)
                traceparent=tracing.current_traceparent(), depth=depth, workload_ref_id=workload_ref,
                payload_bytes=size, submitted_by=who.token_id if (who := auth.require_identity()) is not None else None,
                rerun_of=rerun_of, rerun_from=rerun_from, priority=priority or None, latest_of=latest_of or None,
                whole=len(encoded) <= HANDED_ROW_PAYLOAD_BYTES)
        if inserted is None:
            # lost an idempotency race to a concurrent retry, or (latest_of) the version moved
            existing = await self.existing(idempotency_key) if idempotency_key else None
            if existing is not None or latest_of:
                return existing
            raise NoetlError(f"execution request {execution_id} was not recorded")
        if self._admission is not None:
            self._admission.admitted()
        row = {**inserted, "path": entry.path, "version": entry.version} if len(inserted) > 1 else None
        await self.nudge(shard, execution_id, row)
        return Submission(execution_id, shard, entry, False)

    def next_id(self) -> int:
        return self._ids.next_id()

    async def admit(self) -> None:
        """Backpressure (RESOURCE_EXHAUSTED with a retry-after hint when the runtime is full)."""
        if self._admission is not None:
            await self._admission.check()

    async def _depth(self, parent_execution_id: int) -> int:
        """How deep a sub-playbook nests (0 for a top-level execution); refused beyond
        NOETL_LIMIT_SUBPLAYBOOK_DEPTH (a playbook that calls itself stops there)."""
        if not parent_execution_id:
            return 0
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("SELECT depth FROM noetl.execution_request WHERE execution_id = %s",
                                     (parent_execution_id,))
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"parent execution {parent_execution_id} not found")
        depth = int(row["depth"]) + 1
        if depth > self._limits.subplaybook_depth:
            raise exceeded("sub-playbook nesting depth", depth, "subplaybook_depth", self._limits.subplaybook_depth)
        return depth

    async def _workload_reference(self, execution_id: int, workload: dict[str, Any], encoded: bytes) -> int | None:
        """A workload too large to ride inside every claim is stored once in the result
        store; claims carry its reference and workers read it (and cache it) from there."""
        if self._results is None or len(encoded) <= self._limits.inline_workload_bytes:
            return None
        ref = await self._results.put(workload, execution_id=execution_id, step="", command_id="",
                                      task=WORKLOAD_TASK, parent_ref_id=None)
        return ref.ref_id

    async def nudge(self, shard: int, execution_id: int, row: dict[str, Any] | None = None) -> None:
        """Tell the shard's engine: this process's own when it holds the shard (no NATS
        message; with the request ``row`` as committed, when given, which it need not read),
        else through the shard's events stream."""
        if self._local is not None:
            with tracing.span(f"hand {natsio.events_subject(shard, natsio.KIND_SUBMIT)}",
                              attributes={"noetl.execution_id": execution_id, "noetl.shard": shard}) as s:
                if self._local(shard, execution_id, row):
                    return
                tracing.set_attributes(s, {"noetl.handed": False})  # not held here: published below
        msg = messages_pb2.EngineInput(submitted=messages_pb2.ExecutionSubmitted(execution_id=execution_id))
        try:
            await natsio.publish(self._js, natsio.events_subject(shard, natsio.KIND_SUBMIT),
                                 msg.SerializeToString(), msg_id=submit_msg_id(execution_id))
        except NoetlError as exc:  # the sweep will find it
            logger.warning("nudge for execution %s not published (%s); the shard sweep will start it",
                           execution_id, exc)

    async def existing(self, key: str) -> Submission | None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT r.execution_id, r.shard_id, r.catalog_id FROM noetl.execution_request r"
                " WHERE r.idempotency_key = %s", (key,))
            row = await cur.fetchone()
        if row is None:
            return None
        compiled = await self._catalog.compiled(row["catalog_id"])
        return Submission(row["execution_id"], row["shard_id"], compiled.entry, True)

    async def _check_playbook_refs(self, playbook: Any) -> None:
        missing: list[tuple[str, str]] = []
        for field, path, version in playbook_refs(playbook):
            if path == playbook.path:
                continue  # a playbook calling itself: registered by this very submit
            try:
                await self._catalog.get(path, version)
            except NotFound:
                missing.append((field, f"sub-playbook {path!r}" + (f" version {version}" if version else "")))
        if missing:
            raise PlaybookInvalid(missing[0][0], "; ".join(
                f"{field}: {what} is not in the catalog (register it first)" for field, what in missing))

    async def _check_credentials(self, playbook: Any, workload: dict[str, Any]) -> None:
        refs = credential_refs(playbook, workload)
        if not refs:
            return
        names = sorted({name for _, name in refs})
        async with self._pool.connection() as conn:
            cur = await conn.execute("SELECT name FROM noetl.credential WHERE name = ANY(%s)", (names,))
            found = {r["name"] for r in await cur.fetchall()}
        missing = [(path, name) for path, name in refs if name not in found]
        if missing:
            path = missing[0][0]
            raise PlaybookInvalid(path, "; ".join(
                f"{p}: unknown credential {n!r} (register it with `noetl-rt credential add {n} ...`)"
                for p, n in missing))
