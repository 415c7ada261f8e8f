"""Where a step's commands run and in what order: its pool, the labels it requires, its
priority (``noetl_common.pools`` defines the words).

    spec:                      # the playbook's defaults
      pool: gpu
      requires: {accelerator: a100}
      priority: low
    workflow:
      - step: train
        spec: {pool: gpu, requires: {accelerator: a100}, priority: high}
        tool: {kind: python, spec: {pool: gpu, requires: {memory: large}}, ...}

A step's placement: its own ``spec`` over its tasks' ``spec`` (``pool``, ``requires``;
the tasks of a pipeline run on one worker, so they must agree on the pool, and their
required labels add up) over the playbook's ``spec``. Values are literals (not templates),
checked at submit (:func:`check_placement`). The submission's priority, when given,
overrides every ``spec.priority`` (the engine applies it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from noetl_common.pools import DEFAULT_POOL, label_value, pool_problem, priority_problem, requires_problem

from .model import Playbook

__all__ = ["Placement", "check_placement", "placements"]

_KEYS = ("pool", "requires", "priority")


@dataclass(frozen=True)
class Placement:
    pool: str = DEFAULT_POOL
    requires: Mapping[str, str] = field(default_factory=dict)
    priority: str | None = None  # None: the execution's (submission's, else normal)

    @property
    def requires_json(self) -> dict[str, str] | None:
        return dict(self.requires) or None


DEFAULT = Placement()


def _spec(node: Any) -> dict[str, Any]:
    spec = node.get("spec") if isinstance(node, dict) else None
    return spec if isinstance(spec, dict) else {}


def check_placement(doc: Mapping[str, Any], add: Any) -> None:
    """Report (``add(path, message)``) every malformed ``pool`` / ``requires`` / ``priority``
    of the playbook, its steps and their tasks, and pipelines whose tasks name different pools."""
    def one(spec: dict[str, Any], path: str, *, priority: bool = True) -> None:
        if "pool" in spec and (why := pool_problem(spec["pool"])):
            add(f"{path}.pool", why)
        if "requires" in spec and (why := requires_problem(spec["requires"])):
            add(f"{path}.requires", why)
        if "priority" in spec:
            if not priority:
                add(f"{path}.priority", "priority is set on the step or the playbook, not on a task")
            elif why := priority_problem(spec["priority"]):
                add(f"{path}.priority", why)

    one(_spec(doc), "spec")
    workflow = doc.get("workflow")
    for i, step in enumerate(workflow if isinstance(workflow, list) else []):
        if not isinstance(step, dict):
            continue
        one(_spec(step), f"workflow[{i}].spec")
        tool = step.get("tool")
        tasks = tool if isinstance(tool, list) else [tool] if isinstance(tool, dict) else []
        pools: set[str] = set()
        for j, task in enumerate(tasks):
            spec = _spec(task)
            base = f"workflow[{i}].tool[{j}].spec" if isinstance(tool, list) else f"workflow[{i}].tool.spec"
            one(spec, base, priority=False)
            if isinstance(spec.get("pool"), str):
                pools.add(spec["pool"])
        if len(pools) > 1 and "pool" not in _spec(step):
            add(f"workflow[{i}].tool", f"the tasks of one step run on one worker: they name pools {sorted(pools)}")


def placements(playbook: Playbook) -> dict[str, Placement]:
    """Every step's placement (steps left at the default are left out: ``get(step, DEFAULT)``)."""
    top = _spec(playbook.raw)
    out: dict[str, Placement] = {}
    for step in playbook.workflow:
        pool = top.get("pool")
        requires = {k: label_value(v) for k, v in (top.get("requires") or {}).items()}
        for task in step.tasks:
            spec = task.spec or {}
            pool = spec.get("pool", pool)
            requires.update({k: label_value(v) for k, v in (spec.get("requires") or {}).items()})
        own = step.spec or {}
        pool = own.get("pool", pool)
        requires.update({k: label_value(v) for k, v in (own.get("requires") or {}).items()})
        priority = own.get("priority", top.get("priority"))
        placed = Placement(str(pool or DEFAULT_POOL), requires, priority)
        if placed != DEFAULT:
            out[step.step] = placed
    return out
