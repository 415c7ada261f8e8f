"""Read side: executions from the projected read models, events from the log, lineage
from the references (or, once compacted, from the execution's manifest)."""

from __future__ import annotations

import builtins
from typing import Any

from noetl_common import pools
from noetl_common.db import Column, Pool, autocommit
from noetl_common.errors import InvalidInput, NotFound
from noetl_common.vocab import PUBLIC_TERMINAL, CommandStatus, ExecutionStatus
from noetl_db import requests
from noetl_store import ResultStore, entry_from_json, trace

from .concurrency import waiting_reason

STATUSES = tuple(ExecutionStatus)
TERMINAL = PUBLIC_TERMINAL


class Queries:
    def __init__(self, pool: Pool, results: ResultStore) -> None:
        self._pool = pool
        self._results = results

    async def execution(self, execution_id: int, include_results: bool = False) -> dict[str, Any]:
        """The read model of one execution; PENDING from the request while not yet projected."""
        async with autocommit(self._pool) as conn, conn.pipeline():
            # the execution and its steps in one round trip (pipeline mode, no BEGIN/COMMIT)
            cur = await conn.execute("SELECT * FROM noetl.execution WHERE execution_id = %s", (execution_id,))
            step_cur = await conn.execute(
                "SELECT s.*, r.tier AS result_tier, r.uri AS result_uri FROM noetl.execution_step s"
                " LEFT JOIN noetl.result_ref r ON r.ref_id = s.result_ref_id WHERE s.execution_id = %s"
                " ORDER BY s.started_at NULLS LAST, s.step", (execution_id,))
            # queued commands no live worker qualifies for: why their steps wait (StepState.waiting)
            waiting_cur = await conn.execute(
                "SELECT DISTINCT ON (c.step) c.step, c.pool, c.requires, c.kind FROM noetl.command c"
                f" WHERE c.execution_id = %s AND c.status = '{CommandStatus.QUEUED}' AND {pools.no_live_worker('c')}"
                " ORDER BY c.step", (execution_id,))
            row = await cur.fetchone()
            steps: list[dict[str, Any]] = list(await step_cur.fetchall())
            waiting = {w["step"]: pools.waiting_reason(w["pool"], w["requires"], w["kind"])
                       for w in await waiting_cur.fetchall()}
            for s in steps:
                s["waiting"] = waiting.get(s["step"], "")
            if row is None:
                cur = await conn.execute(
                    "SELECT r.execution_id, r.shard_id, r.catalog_id, c.path AS playbook_path,"
                    " c.version AS playbook_version, r.parent_execution_id, r.rerun_of, r.requested_at AS created_at"
                    " FROM noetl.execution_request r JOIN noetl.catalog c USING (catalog_id)"
                    " WHERE r.execution_id = %s", (execution_id,))
                req = await cur.fetchone()
                if req is None:
                    raise NotFound(f"execution {execution_id} not found")
                row = {**req, "status": ExecutionStatus.PENDING, "error": None, "started_at": None, "ended_at": None,
                       "last_shard_seq": 0}
                # never started because its first input was quarantined: it will not start
                cur = await conn.execute("SELECT error, created_at FROM noetl.quarantine WHERE execution_id = %s"
                                         " ORDER BY quarantine_id LIMIT 1", (execution_id,))
                bad = await cur.fetchone()
                if bad is not None:
                    row.update(status=ExecutionStatus.FAILED, ended_at=bad["created_at"],
                               error=f"ENGINE_INPUT_QUARANTINED: {bad['error']}")
                else:
                    row["waiting"] = await waiting_reason(conn, execution_id)
        if include_results:
            refs = [s["result_ref_id"] for s in steps if s.get("result_ref_id")]
            values = await self._results.get_many(refs) if refs else {}
            for s in steps:
                ref = s.get("result_ref_id")
                if ref in values:  # "result" absent: no result (a present None is a JSON null)
                    s["result"] = values[ref]
        return {**row, "steps": steps}

    async def versions(self, execution_ids: builtins.list[int]) -> dict[int, tuple[str, int]]:
        """(status, last_shard_seq) of each projected one of ``execution_ids`` (one query)."""
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("SELECT execution_id, status, last_shard_seq FROM noetl.execution"
                                     " WHERE execution_id = ANY(%t::bigint[])", (Column(execution_ids),))
            return {int(r["execution_id"]): (str(r["status"]), int(r["last_shard_seq"] or 0))
                    for r in await cur.fetchall()}

    async def submitted_by(self, execution_id: int) -> int | None:
        """The token that submitted an execution (None: unknown, or submitted without one)."""
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("SELECT submitted_by FROM noetl.execution_request WHERE execution_id = %s",
                                     (execution_id,))
            row = await cur.fetchone()
        return row["submitted_by"] if row else None

    async def request_cancel(self, execution_id: int, shard_id: int, reason: str) -> None:
        """Commit a cancellation (the shard's engine applies and deletes it)."""
        async with autocommit(self._pool) as conn:
            await requests.request_cancel(conn, execution_id, shard_id, reason)

    async def quarantined(self, execution_id: int, page_size: int) -> builtins.list[dict[str, Any]]:
        size = min(max(page_size or 100, 1), 1000)
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(
                "SELECT quarantine_id, shard_id, execution_id, input_kind, stream_seq, attempts, error, created_at"
                " FROM noetl.quarantine WHERE (%s = 0 OR execution_id = %s) ORDER BY quarantine_id DESC LIMIT %s",
                (execution_id, execution_id, size))
            return list(await cur.fetchall())

    async def list(self, *, page_size: int, page_token: str, status: str, path: str) -> tuple[list[dict[str, Any]], str]:
        size = min(max(page_size or 50, 1), 500)
        try:
            before = int(page_token) if page_token else 2**63 - 1
        except ValueError as exc:
            raise InvalidInput(f"invalid page_token {page_token!r}") from exc
        clauses = ["execution_id < %s"]
        params: list[Any] = [before]
        if status:
            clauses.append("status = %s")
            params.append(status)
        if path:
            clauses.append("playbook_path = %s")
            params.append(path)
        params.append(size)
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                f"SELECT * FROM noetl.execution WHERE {' AND '.join(clauses)} ORDER BY execution_id DESC LIMIT %s",
                params)
            rows = list(await cur.fetchall())
        token = str(rows[-1]["execution_id"]) if len(rows) == size else ""
        return [{**r, "steps": []} for r in rows], token

    async def events(self, execution_id: int, after_event_id: int,
                     page_size: int) -> builtins.list[dict[str, Any]]:
        size = min(max(page_size or 1000, 1), 10_000)
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT * FROM noetl.event WHERE execution_id = %s AND event_id > %s ORDER BY event_id LIMIT %s",
                (execution_id, after_event_id, size))
            rows = list(await cur.fetchall())
            if not rows and after_event_id == 0:
                cur = await conn.execute("SELECT 1 FROM noetl.execution_request WHERE execution_id = %s",
                                         (execution_id,))
                if await cur.fetchone() is None:
                    raise NotFound(f"execution {execution_id} not found")
        return rows

    async def trace(self, execution_id: int, step: str) -> tuple[builtins.list[dict[str, Any]], bool]:
        """(chain entries newest first, from_manifest) of a step's result. The step's
        terminal reference is its latest accepted result (``execution_step.result_ref_id``
        in the read model); a compacted execution answers from ``noetl.manifest_part``.
        NotFound for an unknown execution or a step that never ran."""
        if not step:
            raise InvalidInput("step is required")
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT m.execution_id, p.step, p.chain FROM noetl.manifest m"
                " LEFT JOIN noetl.manifest_part p ON p.execution_id = m.execution_id AND p.step = %s"
                " WHERE m.execution_id = %s", (step, execution_id))
            manifest = await cur.fetchone()
            if manifest is not None:
                if manifest["step"] is None:
                    raise NotFound(f"step {step!r} of execution {execution_id} not found")
                return [entry_from_json(e) for e in manifest["chain"] or []], True
            cur = await conn.execute(
                "SELECT s.step, s.result_ref_id FROM noetl.execution_step s WHERE s.execution_id = %s AND s.step = %s",
                (execution_id, step))
            row = await cur.fetchone()
            if row is None:
                cur = await conn.execute(
                    "SELECT 1 FROM noetl.execution WHERE execution_id = %s"
                    " UNION ALL SELECT 1 FROM noetl.execution_request WHERE execution_id = %s LIMIT 1",
                    (execution_id, execution_id))
                if await cur.fetchone() is None:
                    raise NotFound(f"execution {execution_id} not found")
                raise NotFound(f"step {step!r} of execution {execution_id} not found")
            entries = await trace(conn, int(row["result_ref_id"])) if row["result_ref_id"] else []
        return entries, False
