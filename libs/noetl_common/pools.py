"""Worker pools, labels and priorities: the vocabulary, spelled once.

A command is placed in one **pool** (``spec.pool`` of its step, its tasks or the playbook;
``default`` when none says) and may **require labels** (``spec.requires: {key: value}``,
merged the same way). Its **priority** is one of ``high``, ``normal``, ``low``: the
submission's (``SubmitExecutionRequest.priority``, ``noetl-rt run --priority``) when it
gives one, else its step's ``spec.priority``, else the playbook's, else ``normal``.

A worker serves one pool or several (``NOETL_WORKER_POOL``, comma-separated, its own
first: ``gpu,default`` backfills default work on a gpu node), has labels
(``NOETL_WORKER_LABELS``, ``key=value,key=value``) and may limit the tool kinds it runs
(``NOETL_WORKER_TOOLS``, comma-separated; empty: every kind). It *qualifies* for a
command when it serves the command's pool, has the labels it requires, and runs its
kind (:func:`qualifies`; the claim and :func:`no_live_worker` say the same in SQL).

Notices travel on ``noetl.commands.{pool}.{priority}.{shard}`` (``natsio``), and each
(pool, priority) has its own durable consumer (:func:`consumer_name`), so a worker only
ever fetches its own pool's notices, higher priorities first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import StrEnum

from noetl_common.vocab import MemberStatus

__all__ = [
    "DEFAULT_POOL",
    "PRIORITIES",
    "Priority",
    "consumer_name",
    "label_value",
    "no_live_worker",
    "parse_labels",
    "parse_pools",
    "parse_tools",
    "pool_problem",
    "priority_problem",
    "qualifies",
    "requires_problem",
    "waiting_reason",
]

DEFAULT_POOL = "default"
# A pool name is a NATS subject token and part of a consumer name.
_POOL_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")


class Priority(StrEnum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


#: fetch order: a worker takes a higher priority's notices first
PRIORITIES: tuple[Priority, ...] = (Priority.HIGH, Priority.NORMAL, Priority.LOW)


def parse_pools(text: str) -> tuple[str, ...]:
    """``gpu,default`` as names in order (empty: the default pool); ValueError naming a bad one."""
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip())) or (DEFAULT_POOL,)
    for name in names:
        if why := pool_problem(name):
            raise ValueError(why)
    return names


def pool_problem(value: object) -> str | None:
    """Why ``value`` is not a pool name, or None."""
    if not isinstance(value, str) or not _POOL_RE.match(value):
        return (f"pool must be a name of lowercase letters, digits, '-' or '_' (at most 40, starting with"
                f" a letter or digit), got {value!r}")
    return None


def priority_problem(value: object) -> str | None:
    if value not in {p.value for p in Priority}:
        return f"priority must be one of {', '.join(p.value for p in PRIORITIES)}, got {value!r}"
    return None


def requires_problem(value: object) -> str | None:
    if not isinstance(value, Mapping):
        return f"requires must be a mapping of label to value, got {type(value).__name__}"
    for k, v in value.items():
        if not isinstance(k, str) or not _LABEL_RE.match(k):
            return f"label name {k!r} is not a label (letters, digits, '_', '-', '.', '/')"
        if not isinstance(v, str | int | bool) or isinstance(v, float):
            return f"label {k!r} must be a string, got {type(v).__name__}"
    return None


def label_value(value: object) -> str:
    """Labels compare as strings (``gpu: true`` in YAML requires ``gpu=true``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_labels(text: str) -> dict[str, str]:
    """``key=value,key=value`` (a bare ``key`` is ``key=true``) as a mapping; ValueError
    naming a bad entry."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip() if _ else "true"
        if not _LABEL_RE.match(key):
            raise ValueError(f"label {part!r}: {key!r} is not a label name")
        out[key] = value
    return out


def parse_tools(text: str) -> tuple[str, ...]:
    return tuple(sorted({t.strip() for t in text.split(",") if t.strip()}))


def qualifies(serves: Iterable[str], labels: Mapping[str, str], tools: Iterable[str], *, command_pool: str,
              requires: Mapping[str, str] | None, kind: str) -> bool:
    """Whether a worker (its pools, labels, tools; empty tools: every kind) may take a command."""
    if (command_pool or DEFAULT_POOL) not in (tuple(serves) or (DEFAULT_POOL,)):
        return False
    if any(labels.get(k) != v for k, v in (requires or {}).items()):
        return False
    allowed = tuple(tools)
    return not allowed or kind in allowed


def no_live_worker(c: str = "c") -> str:
    """SQL: the ``noetl.command`` row aliased ``c`` has no live worker that qualifies for it
    (``noetl.runtime``: what alive workers declared when they joined; a worker that joined
    without a pool serves the default one). The same test as :func:`qualifies`."""
    return (f"NOT EXISTS (SELECT 1 FROM noetl.runtime r WHERE r.role = 'worker' AND r.status = '{MemberStatus.ALIVE}'"
            f" AND {c}.pool = ANY(COALESCE(r.pools, ARRAY['{DEFAULT_POOL}']))"
            f" AND ({c}.requires IS NULL OR {c}.requires <@ COALESCE(r.labels, '{{}}'::jsonb))"
            f" AND (r.tools IS NULL OR {c}.kind = ANY(r.tools)))")


def waiting_reason(pool: str, requires: Mapping[str, str] | None, kind: str) -> str:
    """How a step waiting for a worker reads (``StepState.waiting``, ``noetl-rt status``)."""
    what = f"no live worker in pool {pool}"
    if requires:
        what += " with labels " + ",".join(f"{k}={v}" for k, v in sorted(requires.items()))
    return what + f" (running {kind} tasks)" if kind else what


def consumer_name(pool: str, priority: str) -> str:
    """The durable consumer of one pool's notices of one priority."""
    return f"noetl-workers-{pool}-{priority}"
