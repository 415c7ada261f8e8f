"""Pure graph helpers over a playbook's routing: who follows whom.

Edges are every ``next`` arc, regardless of its ``when`` (a static over-approximation of
what can run), plus the implicit end rule: a step with no arcs routes to the step named
``end`` when there is one (and it is not ``end`` itself); otherwise it has no successors.
"""

from __future__ import annotations

from collections import deque

from .model import END_STEP, Playbook, Step


def step_successors(playbook: Playbook, step: Step) -> set[str]:
    """The steps one step may route to (arcs, else the implicit end)."""
    if step.arcs:
        return {arc.step for arc in step.arcs}
    if step.step != END_STEP and playbook.has_step(END_STEP):
        return {END_STEP}
    return set()


def successors(playbook: Playbook) -> dict[str, set[str]]:
    """Step name -> the names it may route to; every step is a key."""
    return {s.step: step_successors(playbook, s) for s in playbook.workflow}


def predecessors(playbook: Playbook) -> dict[str, set[str]]:
    """Step name -> the names that may route to it; every step is a key."""
    preds: dict[str, set[str]] = {name: set() for name in playbook.step_names}
    for src, targets in successors(playbook).items():
        for dst in targets:
            preds.setdefault(dst, set()).add(src)
    return preds


def reachable_from(playbook: Playbook, step: str) -> set[str]:
    """Every step reachable from ``step`` by one or more edges (``step`` itself only
    when it is on a cycle). KeyError for an unknown step."""
    playbook.step(step)
    succ = successors(playbook)
    seen: set[str] = set()
    queue = deque(succ.get(step, set()))
    while queue:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        queue.extend(succ.get(name, set()) - seen)
    return seen
