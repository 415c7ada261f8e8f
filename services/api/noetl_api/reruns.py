"""RerunExecution: a new execution that reruns a finished one from its failed step (or a
named one), keeping the completed steps' results by reference (docs/ARCHITECTURE.md "Rerun").

The decision is the pure ``noetl_flow.rerun.plan`` over the original's terminal engine
state, read from Postgres (``noetl.engine_state``), never from memory. Before answering,
the request is committed to ``noetl.execution_request`` (``rerun_of``, ``rerun_from``;
idempotency key ``rerun/<original>/<key>``: a retried call returns the same execution);
the engine that starts it reads the original's state again and seeds the new execution
(``ShardEngine._rerun``).

Refused, naming why: an unknown execution (NOT_FOUND), an unknown step (INVALID_ARGUMENT),
an execution still running, a step the original never reached, a completed execution
without a step named, an original whose state or kept results are gone
(FAILED_PRECONDITION).
"""

from __future__ import annotations

import logging
from typing import Any

from noetl_common import auth
from noetl_common.db import Pool
from noetl_common.errors import Conflict, InvalidInput, NotFound
from noetl_flow import ExecState, RerunPlan, RerunRefused, rerun

from .catalog import Catalog
from .submissions import Submission, Submitter

logger = logging.getLogger(__name__)


def idempotency_key(original: int, key: str) -> str:
    """The request's key: per original, apart from SubmitExecution's keys."""
    return f"rerun/{original}/{key}" if key else ""


class Rerunner:
    def __init__(self, pool: Pool, catalog: Catalog, submitter: Submitter) -> None:
        self._pool = pool
        self._catalog = catalog
        self._submitter = submitter

    async def rerun(self, execution_id: int, *, from_step: str = "", key: str = "",
                    timeout_sec: float = 0.0) -> tuple[Submission, RerunPlan | None]:
        """Commit a rerun of ``execution_id``; (the new execution, its plan; None when the
        key matched an earlier rerun)."""
        if execution_id <= 0:
            raise InvalidInput("execution_id is required")
        if timeout_sec < 0:
            raise InvalidInput("timeout_seconds must not be negative")
        req = await self._original(execution_id)
        auth.own_or_admin(req["submitted_by"])
        full_key = idempotency_key(execution_id, key)
        if full_key:
            existing = await self._submitter.existing(full_key)
            if existing is not None:
                return existing, None
        state = _terminal_state(execution_id, req)
        compiled = await self._catalog.compiled(int(req["catalog_id"]))
        try:
            plan = rerun.plan(compiled.flow, state, from_step.strip())
        except RerunRefused as exc:
            if exc.reason == rerun.UNKNOWN_STEP:
                raise InvalidInput(f"from_step: {exc}") from exc
            raise Conflict(str(exc)) from exc
        await self._check_kept(execution_id, state, plan)
        await self._submitter.admit()
        sub = await self._submitter.commit(
            self._submitter.next_id(), compiled.entry, dict(req["payload"] or {}), idempotency_key=full_key,
            timeout_sec=timeout_sec or float(req["timeout_sec"]), workload_ref=req["workload_ref_id"],
            size=int(req["payload_bytes"] or 0), rerun_of=execution_id, rerun_from=from_step.strip() or None)
        if not sub.deduplicated:
            logger.info("execution %s reruns %s from %s (keeps %s) shard %s", sub.execution_id, execution_id,
                        ", ".join(plan.steps), ", ".join(plan.kept) or "nothing", sub.shard_id)
        return sub, plan

    async def _original(self, execution_id: int) -> dict[str, Any]:
        """The original's request row with its engine state (None before it started)."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT r.catalog_id, r.payload, r.timeout_sec, r.workload_ref_id, r.payload_bytes, r.submitted_by,"
                " s.state, (SELECT q.error FROM noetl.quarantine q WHERE q.execution_id = r.execution_id"
                " ORDER BY q.quarantine_id LIMIT 1) AS quarantined"
                " FROM noetl.execution_request r LEFT JOIN noetl.engine_state s USING (execution_id)"
                " WHERE r.execution_id = %s", (execution_id,))
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"execution {execution_id} not found")
        return row

    async def _check_kept(self, execution_id: int, state: ExecState, plan: RerunPlan) -> None:
        """What the rerun will reference must still be there: the kept steps' result
        references and the items of the loops it resumes (nothing deletes them today;
        this refuses, naming what is gone, rather than start a rerun that cannot work)."""
        refs = {int(ref["ref_id"]): name for name in plan.kept
                if (ref := ((state.steps[name].result or {}).get("reference") or {})).get("ref_id")}
        async with self._pool.connection() as conn:
            found: set[int] = set()
            if refs:
                cur = await conn.execute("SELECT ref_id FROM noetl.result_ref WHERE ref_id = ANY(%s)", (list(refs),))
                found = {int(r["ref_id"]) for r in await cur.fetchall()}
            for name, lr in plan.resume.items():
                cur = await conn.execute("SELECT count(*) AS n FROM noetl.loop_item WHERE execution_id = %s"
                                         " AND loop_instance = %s", (execution_id, lr.instance))
                row = await cur.fetchone()
                if row is None or int(row["n"]) != lr.total:
                    raise Conflict(f"the items of loop step {name!r} of execution {execution_id} are gone"
                                   f" ({row['n'] if row else 0} of {lr.total} stored): it cannot be resumed;"
                                   " rerun it whole with from_step")
        missing = sorted((name, ref) for ref, name in refs.items() if ref not in found)
        if missing:
            raise Conflict(f"execution {execution_id} cannot be rerun: the result of step {missing[0][0]!r}"
                           f" (reference {missing[0][1]}) is gone" + (f" (and {len(missing) - 1} more)"
                                                                      if len(missing) > 1 else ""))


def _terminal_state(execution_id: int, row: dict[str, Any]) -> ExecState:
    if row["state"] is None:
        if row["quarantined"]:
            raise Conflict(f"execution {execution_id} never started (its start was quarantined:"
                           f" {row['quarantined']}): there is no state to rerun from; submit it again")
        raise Conflict(f"execution {execution_id} has not started yet: a rerun starts from a finished execution")
    return ExecState.from_json(row["state"])
