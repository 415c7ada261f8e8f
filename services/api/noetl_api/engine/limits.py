"""Concurrency limits in the engine (docs/ARCHITECTURE.md "Concurrency limits").

An execution of a path that has limits starts only when it holds a slot of each: the
engine asks ``noetl.take_slot`` in its fenced batch (serialised per limit and key across
shards by an advisory lock; granted in submission order). An execution that cannot have
one is queued (``noetl.concurrency_wait``) and left unstarted: no engine state, no event.
The batch that ends an execution frees its slots; after the commit the engine nudges the
shard of each queue's oldest waiter, and every sweep retries the heads of its shard's
queues (a lost nudge costs a sweep interval). Slots and queues live in Postgres only.

The limits themselves (a small table an operator edits) are read at most once a second
per replica: a new or changed limit applies to executions started within a second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from noetl_db import limits as limits_db
from noetl_dsl.templates import RenderContext, TemplateError, add_upstream_names, render_text

logger = logging.getLogger(__name__)

QUEUED = Counter("noetl_engine_concurrency_queued_total",
                 "Executions queued by a concurrency limit when they were to start", ["shard"])
REFRESH_SEC = 1.0


@dataclass(frozen=True)
class Limit:
    limit_id: int
    path: str
    key_template: str
    max_running: int


def render_key(template: str, workload: Mapping[str, Any], execution_id: int) -> str:
    """A limit's key for one execution: its template rendered over the workload (''
    when the limit has no template: one queue for the path). A template that fails to
    render is the key ``'!'`` plus the error's class, logged: the execution still waits
    its turn, in a queue of its own kind, rather than escaping the limit."""
    if not template:
        return ""
    data: dict[str, Any] = {"workload": dict(workload), "payload": dict(workload)}
    add_upstream_names(data, workload, execution_id)
    try:
        return render_text(template, RenderContext(data)).strip()
    except TemplateError as exc:
        logger.warning("concurrency key %r of execution %s did not render: %s", template, execution_id, exc)
        return f"!{type(exc).__name__}"


class EngineLimits:
    """The limits table, cached for ``REFRESH_SEC``, and the slot statements."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._by_path: dict[str, list[Limit]] = {}
        self._read_at = float("-inf")

    @property
    def any(self) -> bool:
        return bool(self._by_path)

    @property
    def due(self) -> bool:
        """Whether ``refresh`` would read the table."""
        return self._clock() - self._read_at >= REFRESH_SEC

    async def refresh(self, conn: Any) -> None:
        if not self.due:
            return
        by_path: dict[str, list[Limit]] = {}
        for r in await limits_db.all_limits(conn):
            by_path.setdefault(r["path"], []).append(Limit(r["limit_id"], r["path"], r["key_template"],
                                                           r["max_running"]))
        self._by_path = by_path
        self._read_at = self._clock()

    def of(self, path: str) -> list[Limit]:
        return self._by_path.get(path, [])

    async def admit(self, conn: Any, shard: int, execution_id: int, path: str,
                    workload: Mapping[str, Any], *, queued: bool = True) -> bool:
        """Take a slot of every limit of ``path`` for the execution, or queue it (False).
        A partial grant is given back and queued too, so an execution never holds one
        limit's slot while it waits for another's. ``queued=False``: the execution cannot be
        in a queue (a submission handed over by its api; its batch checks that it is not)."""
        await self.refresh(conn)
        limits = self.of(path)
        if not limits:
            # no limit (any more): leave any queue it was in
            if queued:
                await limits_db.dequeue(conn, execution_id)
            return True
        wanted = sorted((lim.limit_id, render_key(lim.key_template, workload, execution_id), lim.max_running)
                        for lim in limits)
        granted: list[tuple[int, str]] = []
        for limit_id, key, max_running in wanted:  # a fixed order: no two engines wait on each other
            if await limits_db.take_slot(conn, limit_id, key, max_running, execution_id, shard):
                granted.append((limit_id, key))
        if len(granted) == len(wanted):
            await limits_db.dequeue(conn, execution_id)
            return True
        for limit_id, key in granted:
            await limits_db.give_back(conn, limit_id, key, execution_id)
            await limits_db.enqueue(conn, limit_id, key, execution_id, shard)
        QUEUED.labels(str(shard)).inc()
        return False


__all__ = ["QUEUED", "EngineLimits", "Limit", "render_key"]
