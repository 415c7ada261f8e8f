"""Where a new command goes: its pool, the labels it requires and its priority
(docs/ARCHITECTURE.md "Worker pools and priorities"). Pure: the step's placement comes
from the pinned playbook (``Compiled.placements``), the submission's priority from
``noetl.execution_request.priority`` (the engine keeps it with the execution's workload,
reloading it with the request when not cached)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from noetl_common.pools import DEFAULT_POOL, Priority
from noetl_dsl import Placement


class Placed(NamedTuple):
    pool: str
    requires: dict[str, str] | None
    priority: str


DEFAULT = Placed(DEFAULT_POOL, None, Priority.NORMAL.value)


def place(placements: Mapping[str, Placement], step: str, submitted: str | None) -> Placed:
    """The submission's priority (when given) over the step's (its own, else the playbook's)."""
    p = placements.get(step)
    if p is None:
        return DEFAULT if not submitted else Placed(DEFAULT_POOL, None, submitted)
    return Placed(p.pool, p.requires_json, submitted or p.priority or Priority.NORMAL.value)
