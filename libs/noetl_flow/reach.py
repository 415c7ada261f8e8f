"""Reachability between steps, for the fan-in barrier, in linear memory.

The barrier asks one question: *can any running step still reach this armed step?* A
transitive closure answers it in O(1) but costs O(n^2) time and memory to build (a
10,000-step playbook took minutes and most of a gigabyte). Instead, built once in
O(n + e):

* the strongly connected components (iterative Tarjan), numbered in topological order:
  an edge never goes to a lower rank, so a step of higher rank than the target can
  never reach it, and a different step of the same component always can;
* each step's predecessors.

A query first tries those O(1) answers and direct predecessors; otherwise it walks
backwards from the target over steps whose rank is at least the lowest candidate's
(nothing below can lie on a path from a candidate), stopping at the first candidate:
O(the steps between) per query, no memory kept between queries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["Reachability"]


class Reachability:
    """Answers "can one of these steps reach that one by one or more arcs" over a static
    graph (step name -> names it may route to)."""

    def __init__(self, successors: Mapping[str, Iterable[str]]) -> None:
        names = list(successors)
        for targets in successors.values():
            names.extend(t for t in targets if t not in successors)
        self._index = {name: i for i, name in enumerate(dict.fromkeys(names))}
        index = self._index
        self._succ: list[list[int]] = [[] for _ in index]
        self._preds: list[set[int]] = [set() for _ in index]
        for src, targets in successors.items():
            s = index[src]
            for dst in targets:
                d = index[dst]
                self._succ[s].append(d)
                self._preds[d].add(s)
        self._rank = _topological_component_ranks(self._succ)

    def any_reaches(self, sources: Iterable[str], target: str) -> bool:
        """Whether a step of ``sources`` other than ``target`` itself can reach
        ``target``. Unknown names reach nothing and cannot be reached."""
        t = self._index.get(target)
        if t is None:
            return False
        rank, preds = self._rank, self._preds[t]
        candidates: set[int] = set()
        for name in sources:
            s = self._index.get(name)
            if s is None or s == t or rank[s] > rank[t]:
                continue
            if rank[s] == rank[t] or s in preds:  # same component, or one arc away
                return True
            candidates.add(s)
        if not candidates:
            return False
        floor = min(rank[s] for s in candidates)
        seen = {t}
        stack = [t]
        while stack:
            for p in self._preds[stack.pop()]:
                if p in seen or rank[p] < floor:
                    continue
                if p in candidates:
                    return True
                seen.add(p)
                stack.append(p)
        return False

    def reaches(self, source: str, target: str) -> bool:
        """Whether ``target`` is reachable from ``source`` by one or more arcs (a step
        reaches itself only on a cycle)."""
        s, t = self._index.get(source), self._index.get(target)
        if s is None or t is None:
            return False
        if s == t:
            return any(self._rank[p] == self._rank[t] for p in self._preds[t])
        return self.any_reaches((source,), target)


def _topological_component_ranks(succ: list[list[int]]) -> list[int]:
    """For each node, the rank of its strongly connected component in a topological
    order of the components (iterative Tarjan: components complete sinks first)."""
    n = len(succ)
    order = [-1] * n  # discovery index
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    component = [-1] * n
    count = 0
    counter = 0
    for root in range(n):
        if order[root] != -1:
            continue
        work = [(root, 0)]
        order[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, i = work[-1]
            if i < len(succ[v]):
                work[-1] = (v, i + 1)
                w = succ[v][i]
                if order[w] == -1:
                    order[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w] and order[w] < low[v]:
                    low[v] = order[w]
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                if low[v] < low[parent]:
                    low[parent] = low[v]
            if low[v] == order[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    component[w] = count
                    if w == v:
                        break
                count += 1
    # Tarjan completes a component only after every component it reaches: reverse.
    return [count - 1 - c for c in component]
