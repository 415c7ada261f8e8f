"""The engine's part of an execution's trace (``noetl_common.tracing``).

SubmitExecution commits the execution's trace context with its request
(``noetl.execution_request.traceparent``), so whichever api replica owns the shard now
(also after a takeover) continues the same trace: each input it folds is a span under
that context, each command notice it publishes is a producer span under the fold that
issued it (its ``traceparent`` goes to the worker in the notice headers), and a terminal
event (``playbook.completed|failed|cancelled``) or a dead letter is a span of its own.

Everything returns at once while tracing is off. The contexts are cached per execution
(bounded; dropped when the execution ends) and loaded in the batch's transaction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry.context import Context

from noetl_common import tracing
from noetl_common.vocab import EventType

TRACED_EVENTS = (EventType.PLAYBOOK_COMPLETED, EventType.PLAYBOOK_FAILED, EventType.PLAYBOOK_CANCELLED, EventType.COMMAND_DEAD_LETTERED, EventType.COMMAND_REDRIVEN)
_ERROR_EVENTS = (EventType.PLAYBOOK_FAILED, EventType.COMMAND_DEAD_LETTERED)
T = TypeVar("T")


class EngineTraces:
    def __init__(self, max_items: int = 10_000) -> None:
        self._max = max_items
        self._contexts: OrderedDict[int, Context | None] = OrderedDict()
        # The fold span that issued an execution's latest commands (until they are published).
        self._issuers: dict[int, Context] = {}

    def _remember(self, execution_id: int, traceparent: str | None) -> None:
        self._contexts[execution_id] = tracing.context_from(traceparent)
        self._contexts.move_to_end(execution_id)
        while len(self._contexts) > self._max:
            self._contexts.popitem(last=False)

    async def load(self, conn: Any, execution_ids: Iterable[int], requests: Mapping[int, Mapping[str, Any]]) -> None:
        """Know the trace context of ``execution_ids``: from the request rows the batch
        loaded already, else one query for those not cached."""
        if not tracing.enabled():
            return
        missing = []
        for eid in execution_ids:
            if eid in requests:
                self._remember(eid, requests[eid].get("traceparent"))
            elif eid not in self._contexts:
                missing.append(eid)
        if missing:
            cur = await conn.execute(
                "SELECT execution_id, traceparent FROM noetl.execution_request WHERE execution_id = ANY(%s)",
                (missing,))
            for row in await cur.fetchall():
                self._remember(row["execution_id"], row["traceparent"])

    async def fold(self, inp: Any, shard: int, work: Awaitable[T]) -> T:
        """Await ``work`` (folding one input into its execution: a ``Transition`` or None)
        in a span ``engine.<kind>``; a fold that issued commands parents their notices."""
        if not tracing.enabled():
            return await work
        eid = int(inp.execution_id)
        command_id = getattr(inp.msg, "command_id", "") if inp.msg is not None else ""
        with tracing.span(f"engine.{inp.kind}", parent=self._contexts.get(eid),
                          attributes={"noetl.execution_id": eid, "noetl.shard": shard,
                                      "noetl.command_id": command_id}) as s:
            t = await work
            commands = len(getattr(t, "commands", ()) or ()) + len(getattr(t, "republish", ()) or ())
            tracing.set_attributes(s, {"noetl.events": len(getattr(t, "events", ()) or ()),
                                       "noetl.commands": commands})
            if commands and s is not None:
                self._issuers[eid] = tracing.as_parent(s)
            return t

    def notice_parent(self, execution_id: int) -> Context | None:
        """The parent of a command notice's publish span."""
        if not tracing.enabled():
            return None
        return self._issuers.get(execution_id) or self._contexts.get(execution_id)

    def committed(self, events: Sequence[tuple[Any, ...]]) -> None:
        """After a batch committed (and published): spans for its terminal events and dead
        letters; executions that ended are forgotten. ``events`` are the batch's rows
        ``(execution_id, shard, shard_seq, event_type, step, command_id, ...)``."""
        if not tracing.enabled():
            return
        for eid, shard, seq, event_type, step, command_id, *_ in events:
            self._issuers.pop(eid, None)
            if event_type not in TRACED_EVENTS:
                continue
            tracing.event_span(event_type, parent=self._contexts.get(eid),
                               attributes={"noetl.execution_id": eid, "noetl.shard": shard, "noetl.shard_seq": seq,
                                           "noetl.step": step, "noetl.command_id": command_id},
                               error=event_type if event_type in _ERROR_EVENTS else "")
            if event_type.startswith("playbook."):
                self._contexts.pop(eid, None)
