"""WorkerService logic: claim a queued command, renew its lease.

A claim is ``UPDATE ... WHERE status = 'queued' AND attempt = $a RETURNING``: losing the
race means someone else has it. The claim response carries the step's raw tool spec
(from the pinned catalog version) and the render context (the command's snapshot plus
the execution's workload), so the worker renders where the data is.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from noetl_common.db import Pool, autocommit
from noetl_common.errors import Conflict, NotFound
from noetl_dsl import merged_workload

from .catalog import Catalog

logger = logging.getLogger(__name__)


_CLAIM = """
WITH claimed AS (
  UPDATE noetl.command SET status = 'claimed', worker_id = %(worker)s, claimed_at = now(),
         lease_until = now() + make_interval(secs => %(lease)s), updated_at = now()
  WHERE command_id = %(command_id)s AND status = 'queued' AND (attempt = %(attempt)s OR %(attempt)s = 0)
  RETURNING *
)
SELECT c.*, li.item AS loop_item, li.idx IS NOT NULL AS has_item,
       CASE WHEN %(need_payload)s THEN
         (SELECT r.payload FROM noetl.execution_request r WHERE r.execution_id = c.execution_id) END AS payload
FROM claimed c
LEFT JOIN noetl.loop_item li
  ON li.execution_id = c.execution_id AND li.loop_instance = c.context->'loop'->>'instance'
 AND li.idx = (c.context->'loop'->>'index')::int
"""


class Claims:
    def __init__(self, pool: Pool, catalog: Catalog, lease_sec: float) -> None:
        self._pool = pool
        self._catalog = catalog
        self._lease = lease_sec
        self._workloads: dict[int, dict[str, Any]] = {}

    async def claim(self, command_id: str, worker_id: str, attempt: int) -> dict[str, Any]:
        # One statement (one round trip, its own transaction): the claim, the loop item a
        # collection-loop iteration needs, and the submitted payload unless it is cached.
        head = command_id.split(":", 1)[0]
        need_payload = not (head.isdigit() and int(head) in self._workloads)
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(_CLAIM, {"worker": worker_id, "lease": self._lease, "command_id": command_id,
                                              "attempt": attempt, "need_payload": need_payload})
            row = await cur.fetchone()
            if row is None:
                cur = await conn.execute("SELECT status, attempt, worker_id FROM noetl.command WHERE command_id = %s",
                                         (command_id,))
                current = await cur.fetchone()
                if current is None:
                    raise NotFound(f"command {command_id} not found")
                raise Conflict(f"command {command_id} is {current['status']} (attempt {current['attempt']},"
                               f" worker {current['worker_id'] or '-'}), not claimable as attempt {attempt}")
        loop = (row["context"] or {}).get("loop") or {}
        item: Any = row["loop_item"]
        if loop and loop.get("mode") != "cursor" and not row["has_item"]:
            raise NotFound(f"loop item {loop['instance']}[{loop['index']}] of command {command_id} not found")
        req = {"payload": row["payload"]} if need_payload else None
        compiled = await self._catalog.compiled(row["catalog_id"])
        playbook = compiled.playbook
        workload = self._workloads.get(row["execution_id"])
        if workload is None:
            workload = merged_workload(playbook, (req or {}).get("payload") or {})
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
        }
        context = dict(row["context"])
        context.update(execution_id=row["execution_id"], workload=workload, known_steps=playbook.step_names)
        if loop:
            index = int(loop["index"])
            if loop.get("mode") == "cursor":
                # A slot re-issued after its worker died resumes with the row it had claimed.
                context["resume"] = (row.get("progress") or {}).get("row")
                context["iter"] = {"_index": index}
            else:
                context["iter"] = {str(loop["iterator"]): item, "_index": index}
            context["loop_index"] = index
        return {"row": row, "spec": spec, "context": context}

    async def renew(self, command_id: str, worker_id: str, attempt: int,
                    progress: str) -> tuple[datetime | None, str]:
        """Returns (new lease expiry, "") or (None, why the worker must stop)."""
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(
                "UPDATE noetl.command SET lease_until = now() + make_interval(secs => %s),"
                " progress = COALESCE(%s::jsonb, progress), updated_at = now()"
                " WHERE command_id = %s AND worker_id = %s AND attempt = %s AND status = 'claimed'"
                " RETURNING lease_until",
                (self._lease, progress or None, command_id, worker_id, attempt),
            )
            row = await cur.fetchone()
            if row is not None:
                return row["lease_until"], ""
            cur = await conn.execute("SELECT status, attempt, worker_id FROM noetl.command WHERE command_id = %s",
                                     (command_id,))
            current = await cur.fetchone()
        if current is None:
            return None, "command not found"
        if current["status"] == "cancelled":
            return None, "cancelled"
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


def dumps(value: Any) -> str:
    return json.dumps(value, default=str)
