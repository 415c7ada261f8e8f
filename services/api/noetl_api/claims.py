"""WorkerService logic: claim a queued command, renew its lease.

A claim (``noetl_db.commands.claim``) takes a queued command of the asked attempt in one
statement: losing the race means someone else has it. A claim is idempotent for its worker: the same worker
claiming the same attempt again gets the command back (its first claim committed but the
answer was lost with a dying api replica), so the command need not wait for its lease to
expire and be re-issued. The worker never runs a command twice on its own account (it
drops attempts it has already taken). The claim response carries the step's raw tool
spec (from the pinned catalog version) and the render context (the command's snapshot
plus the execution's workload), so the worker renders where the data is.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from noetl_common import auth, pools
from noetl_common.db import Pool, autocommit
from noetl_common.errors import Conflict, NoetlError, NotFound, NotQualified
from noetl_common.grpcutil import set_timestamp
from noetl_common.vocab import CommandStatus, StopReason, execution_of_command
from noetl_db import commands
from noetl_dsl import merged_workload
from noetl_dsl.credrefs import keychain_entries, keychain_reads
from noetl_proto.v1 import messages_pb2

from .catalog import Catalog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlacement:
    """What a claiming worker serves (``noetl_common.pools``)."""

    pools: tuple[str, ...] = (pools.DEFAULT_POOL,)
    labels: dict[str, str] = field(default_factory=dict)
    tools: tuple[str, ...] = ()


DEFAULT_PLACEMENT = WorkerPlacement()


@dataclass
class Claimed:
    row: dict[str, Any]
    spec: dict[str, Any]
    context: dict[str, Any]
    # the proof of this claim its result must echo (auth.claim_token)
    claim_token: str = ""

    def to_proto(self) -> messages_pb2.Command:
        """The command as its worker gets it (a claim's answer, or a handoff)."""
        row = self.row
        cmd = messages_pb2.Command(
            command_id=row["command_id"], execution_id=row["execution_id"], shard_id=row["shard_id"],
            step=row["step"], attempt=row["attempt"], kind=row["kind"],
            spec_json=json.dumps(self.spec, default=str), context_json=json.dumps(self.context, default=str),
            timeout_seconds=row["timeout_sec"] or 0.0, claim_token=self.claim_token)
        set_timestamp(cmd.lease_until, row["lease_until"])
        return cmd


class Claims:
    def __init__(self, pool: Pool, catalog: Catalog, lease_sec: float, claim_key: bytes = b"") -> None:
        self._pool = pool
        self._catalog = catalog
        self._lease = lease_sec
        self.claim_key = claim_key
        self._workloads: dict[int, dict[str, Any]] = {}

    async def claim(self, command_id: str, worker_id: str, attempt: int,
                    placement: WorkerPlacement = DEFAULT_PLACEMENT) -> Claimed:
        """Claim one command; NotFound / Conflict / NotQualified when it cannot be claimed."""
        outcome = (await self.claim_many([(command_id, attempt)], worker_id, placement))[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def claim_many(self, wanted: list[tuple[str, int]], worker_id: str,
                         placement: WorkerPlacement = DEFAULT_PLACEMENT) -> list[Claimed | NoetlError]:
        """Claim several commands in ONE statement (one round trip, its own transaction): the
        claims, the loop items collection-loop iterations need, and the submitted payloads
        not cached yet. Returns, per requested claim in order, the claim or why it failed.
        A worker claims only commands it qualifies for (``placement``; NotQualified)."""
        ids = [c for c, _ in wanted]
        heads = {e for c in ids if (e := execution_of_command(c)) is not None}
        need = [e for e in heads if e not in self._workloads]
        async with autocommit(self._pool) as conn:
            rows = await commands.claim(conn, wanted, worker_id, self._lease,
                                        pools=list(placement.pools or (pools.DEFAULT_POOL,)),
                                        labels=dict(placement.labels), tools=list(placement.tools), need_payload=need)
            missing = [c for c in ids if c not in rows]
            current = await commands.placement_of(conn, missing) if missing else {}
        out: list[Claimed | NoetlError] = []
        asked: set[str] = set()
        for command_id, attempt in wanted:
            if command_id in asked:  # given once per call, however often it is asked for
                out.append(Conflict(f"command {command_id} was asked for twice in one claim"))
                continue
            asked.add(command_id)
            row = rows.get(command_id)
            if row is None:
                now = current.get(command_id)
                if now is None:
                    out.append(NotFound(f"command {command_id} not found"))
                elif not pools.qualifies(placement.pools, placement.labels, placement.tools, command_pool=now["pool"],
                                         requires=now["requires"], kind=now["kind"]):
                    out.append(NotQualified(
                        f"command {command_id} is placed in pool {now['pool']}"
                        + (f" requiring {now['requires']}" if now["requires"] else "")
                        + f" (kind {now['kind']}); worker {worker_id} serves pools {','.join(placement.pools)}"
                        + f" with labels {placement.labels or {}}"
                        + (f" and tools {list(placement.tools)}" if placement.tools else "")))
                else:
                    out.append(Conflict(f"command {command_id} is {now['status']} (attempt {now['attempt']},"
                                        f" worker {now['worker_id'] or '-'}), not claimable as attempt {attempt}"))
                continue
            try:
                out.append(await self.assemble(row))
            except NoetlError as exc:
                out.append(exc)
        return out

    async def assemble(self, row: dict[str, Any], workload: dict[str, Any] | None = None) -> Claimed:
        """A claimed command row as its worker gets it: the step's raw tool spec from the
        pinned playbook and the render context. ``workload``: the execution's merged
        workload when the caller has it (the engine, handing a command off); else this
        replica's cache of them, or the row's ``payload``."""
        loop = (row["context"] or {}).get("loop") or {}
        if loop and loop.get("mode") != "cursor" and not row["has_item"]:
            raise NotFound(f"loop item {loop['instance']}[{loop['index']}] of command {row['command_id']} not found")
        count = int(loop.get("count") or 1) if loop else 1
        if count > 1 and len(row.get("loop_items") or ()) != count:
            raise NotFound(f"loop items {loop['instance']}[{loop['index']}:{int(loop['index']) + count}] of command"
                           f" {row['command_id']} not found")
        compiled = await self._catalog.compiled(row["catalog_id"])
        playbook = compiled.playbook
        if row.get("workload_ref_id"):  # a large workload travels by reference
            workload = None
        elif workload is None:
            workload = self._workloads.get(row["execution_id"])
            if workload is None:
                workload = merged_workload(playbook, row.get("payload") or {})
                self._workloads[row["execution_id"]] = workload
                if len(self._workloads) > 5000:
                    self._workloads.pop(next(iter(self._workloads)))
        step = playbook.step(row["step"])
        spec = {
            "step": step.step,
            "tool": step.raw_tool,
            "input": step.input or {},
            "workbook": _workbook_refs(playbook, step.raw_tool),
            "loop": None,
            "playbook_path": playbook.path,  # where the worker looks up `script: {source: {type: file}}`
        }
        keychain = _keychain_refs(playbook, step.step)
        if keychain:  # the entries its templates read (`{{ keychain.<name>.<field> }}`): names, never secrets
            spec["keychain"] = keychain
        context = dict(row["context"])
        context.update(execution_id=row["execution_id"], known_steps=playbook.step_names)
        if workload is None:
            context["workload_ref"] = {"ref_id": int(row["workload_ref_id"])}
        else:
            context["workload"] = workload
        if loop:
            index = int(loop["index"])
            if loop.get("mode") == "cursor":
                # A slot re-issued after its worker died resumes with the row it had claimed,
                # and with its counts before that row (they cover every attempt).
                progress = row.get("progress") or {}
                context["resume"] = progress.get("row")
                context["resume_counts"] = progress.get("counts")
                context["iter"] = {"_index": index}
            else:
                context["iter"] = {str(loop["iterator"]): row["loop_item"], "_index": index}
                if count > 1:  # a batch: the worker runs each item in turn (noetl_worker.runner)
                    context["batch_items"] = row["loop_items"]
            context["loop_index"] = index
        token = auth.claim_token(self.claim_key, row["command_id"], row["attempt"], row["worker_id"]) \
            if self.claim_key else ""
        return Claimed(row, spec, context, token)

    async def holder(self, command_id: str) -> dict[str, Any] | None:
        """The command as GetCredential checks it: who holds which attempt, its step and
        pinned playbook, the cursor the engine rendered, and the execution's payload (or
        the reference of its workload). None when there is no such command."""
        async with autocommit(self._pool) as conn:
            return await commands.holder(conn, command_id)

    async def renew(self, command_id: str, worker_id: str, attempt: int,
                    progress: str) -> tuple[datetime | None, str]:
        """Returns (new lease expiry, "") or (None, why the worker must stop)."""
        async with autocommit(self._pool) as conn:
            row = await commands.renew(conn, command_id, worker_id, attempt, self._lease, progress or None)
            if row is not None:
                return row["lease_until"], ""
            current = await commands.state(conn, command_id)
        if current is None:
            return None, StopReason.NOT_FOUND
        if current["status"] == CommandStatus.CANCELLED:
            return None, StopReason.CANCELLED
        return None, (f"command is {current['status']} (attempt {current['attempt']},"
                      f" worker {current['worker_id'] or '-'})")


def _workbook_refs(playbook: Any, tool: Any) -> dict[str, Any]:
    tasks = tool if isinstance(tool, list) else [tool]
    out = {}
    for task in tasks:
        if isinstance(task, dict) and task.get("kind") == "workbook":
            entry = playbook.workbook_task(str(task.get("name")))
            if entry is not None:
                out[str(task["name"])] = entry
    return out


def _keychain_refs(playbook: Any, step: str) -> dict[str, Any]:
    entries = keychain_entries(playbook)
    if not entries:
        return {}
    reads = keychain_reads(playbook, step)
    return {alias: entry for alias, (_, entry) in entries.items() if reads is None or alias in reads}


def dumps(value: Any) -> str:
    return json.dumps(value, default=str)
