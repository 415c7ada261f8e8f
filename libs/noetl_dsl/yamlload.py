"""YAML within budgets: a document is measured before anything is built from it.

PyYAML's own composers cannot be trusted with hostile text: libyaml's (``CParser``)
recurses in C once per nesting level (a 200 KB ``[[[[...`` crashes the process) and
expands nothing but builds cyclic graphs from recursive aliases; the pure-Python one
raises RecursionError. So the node graph is composed here, iteratively, from the
parser's events (libyaml's when PyYAML has it), and while composing:

* the depth of every node, counting what an alias brings in, stays within
  ``nesting_depth`` (the parser never reads past the first level too deep);
* the nodes and scalar characters of the document *as it would be after alias
  expansion* stay within ``yaml_nodes`` and ``playbook_bytes``. Each anchored node's
  expanded size is remembered, so measuring costs O(document) and a billion-laughs
  document is refused after reading its first few levels, never expanded;
* an alias to a node that is still open (a recursive structure) is refused.

Only then does SafeConstructor build Python values from the nodes (anchors still
share one object, as with ``yaml.safe_load``). The text's size is checked first.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from noetl_common.config import LimitSettings
from noetl_common.errors import PlaybookInvalid
from noetl_common.limits import check, defaults, env_name, exceeded

__all__ = ["load_yaml"]

# libyaml's parser (events only) when PyYAML was built with it: ~10x faster than the
# pure-Python one, same safe constructors and resolvers.
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str, limits: LimitSettings | None = None) -> Any:
    """Parse one YAML document of a playbook with SafeLoader semantics, refusing text
    beyond the limits (``PlaybookLimitExceeded``) before building anything from it.
    Malformed YAML raises ``yaml.YAMLError`` as ``yaml.safe_load`` does."""
    limits = limits or defaults()
    check_text_size(text, limits)
    loader = _Loader(text)
    try:
        node = _Composer(loader, limits).single_node()
        return None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        if _LIBYAML_DEPTH in str(exc.problem or ""):
            raise _libyaml_too_deep(exc, limits) from exc
        raise
    finally:
        loader.dispose()


# libyaml >= 0.2.6 (PyYAML 6.0.4's wheels) stops its scanner at 1,000 open levels: it
# scans ahead of the events for a possible simple key, so a long run of ``[`` reaches
# that bound before this composer sees the level past ``nesting_depth``.
_LIBYAML_DEPTH = "maximum nesting depth"
_LIBYAML_MAX_DEPTH = 1000


def _libyaml_too_deep(exc: yaml.MarkedYAMLError, limits: LimitSettings) -> Exception:
    """The error the composer raises at the level past ``nesting_depth``, whichever bound
    was met first; a ``nesting_depth`` of 1,000 or more is bounded by libyaml's, and says so."""
    if limits.nesting_depth >= _LIBYAML_MAX_DEPTH:
        return PlaybookInvalid("", f"playbook nests deeper than the YAML parser's own bound of {_LIBYAML_MAX_DEPTH}"
                                   f" levels ({env_name('nesting_depth')}={limits.nesting_depth} is above it)")
    return exceeded("playbook nesting depth", limits.nesting_depth + 1, "nesting_depth", limits.nesting_depth,
                    at_least=True, path="")


def check_text_size(text: str, limits: LimitSettings) -> None:
    """``playbook_bytes`` against the UTF-8 size of ``text`` (no copy for ASCII text)."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    check(size, "playbook_bytes", limits, "playbook", unit="bytes", path="")


class _Open:
    """A collection being composed, and what its expansion has cost so far."""

    __slots__ = ("anchor", "chars", "height", "key", "node", "nodes")

    def __init__(self, node: SequenceNode | MappingNode, anchor: str | None) -> None:
        self.node = node
        self.anchor = anchor
        self.nodes = 1
        self.chars = 0
        self.height = 0
        self.key: Node | None = None


# What a node costs wherever it appears: (nodes, scalar characters, height), height
# counting collection levels (a scalar 0, [] 1, [[]] 2).
_Cost = tuple[int, int, int]


class _Composer:
    """``yaml.composer.Composer.get_single_node`` without recursion, with budgets."""

    def __init__(self, loader: Any, limits: LimitSettings) -> None:
        self.loader = loader
        self.limits = limits
        self.anchors: dict[str, Node] = {}
        self.costs: dict[str, _Cost] = {}  # closed anchored nodes
        self.stack: list[_Open] = []
        self.nodes = 0  # of the expanded document, so far
        self.chars = 0
        self.expanded = False  # an alias was met

    def single_node(self) -> Node | None:
        loader = self.loader
        loader.get_event()  # stream start
        node = None
        if not loader.check_event(yaml.StreamEndEvent):
            loader.get_event()  # document start
            node = self._compose()
            loader.get_event()  # document end
        if not loader.check_event(yaml.StreamEndEvent):
            event = loader.get_event()
            raise yaml.composer.ComposerError("expected a single document in the stream",
                                              node.start_mark if node is not None else None,
                                              "but found another document", event.start_mark)
        loader.get_event()  # stream end
        return node

    def _compose(self) -> Node:
        """Compose the document's root node; the hot loop of parsing, kept flat."""
        get_event, resolve, stack = self.loader.get_event, self.loader.resolve, self.stack
        max_nodes, max_chars = self.limits.yaml_nodes, self.limits.playbook_bytes
        while True:
            event = get_event()
            kind = type(event)
            node: Node
            if kind is yaml.ScalarEvent:
                tag = event.tag
                if tag is None or tag == "!":
                    tag = resolve(ScalarNode, event.value, event.implicit)
                node = ScalarNode(tag, event.value, event.start_mark, event.end_mark, style=event.style)
                cost = (1, len(event.value), 0)
                if event.anchor is not None:
                    self._anchor(event, node)
                    self.costs[event.anchor] = cost
                self.nodes += 1
                self.chars += cost[1]
                if self.nodes > max_nodes or self.chars > max_chars:
                    self._refuse()
            elif kind is yaml.SequenceStartEvent or kind is yaml.MappingStartEvent:
                self._open(event)
                continue
            elif kind is yaml.AliasEvent:
                node, cost = self._alias(event)
            else:  # the end of the innermost open collection
                top = stack.pop()
                node = top.node
                node.end_mark = event.end_mark
                cost = (top.nodes, top.chars, top.height + 1)
                if top.anchor is not None:
                    self.costs[top.anchor] = cost
            if not stack:
                return node
            parent = stack[-1]
            if parent.node.__class__ is SequenceNode:
                parent.node.value.append(node)
            elif parent.key is None:
                parent.key = node
            else:
                parent.node.value.append((parent.key, node))
                parent.key = None
            parent.nodes += cost[0]
            parent.chars += cost[1]
            if cost[2] > parent.height:
                parent.height = cost[2]

    def _open(self, event: Any) -> None:
        cls = SequenceNode if isinstance(event, yaml.SequenceStartEvent) else MappingNode
        node = cls(self._tag(cls, event, None), [], event.start_mark, None, flow_style=event.flow_style)
        self._anchor(event, node)
        depth = len(self.stack) + 1
        if depth > self.limits.nesting_depth:
            raise exceeded("playbook nesting depth", depth, "nesting_depth", self.limits.nesting_depth,
                           at_least=True, path="")
        self.stack.append(_Open(node, event.anchor))
        self.nodes += 1
        if self.nodes > self.limits.yaml_nodes:
            self._refuse()

    def _alias(self, event: Any) -> tuple[Node, _Cost]:
        anchor = event.anchor
        if anchor not in self.anchors:
            raise yaml.composer.ComposerError(None, None, f"found undefined alias {anchor!r}", event.start_mark)
        cost = self.costs.get(anchor)
        if cost is None:  # the anchored collection is still open: the alias would contain itself
            mark = event.start_mark
            raise PlaybookInvalid("", f"recursive alias *{anchor} (line {mark.line + 1}, column {mark.column + 1}):"
                                      " a node cannot contain itself")
        depth = len(self.stack) + cost[2]
        if depth > self.limits.nesting_depth:
            raise exceeded(f"playbook nesting depth (alias *{anchor} expanded)", depth, "nesting_depth",
                           self.limits.nesting_depth, path="")
        self.expanded = True
        self.nodes += cost[0]
        self.chars += cost[1]
        if self.nodes > self.limits.yaml_nodes or self.chars > self.limits.playbook_bytes:
            self._refuse()
        return self.anchors[anchor], cost

    def _anchor(self, event: Any, node: Node) -> None:
        anchor = event.anchor
        if anchor is None:
            return
        if anchor in self.anchors:
            raise yaml.composer.ComposerError(f"found duplicate anchor {anchor!r}; first occurrence",
                                              self.anchors[anchor].start_mark, "second occurrence",
                                              event.start_mark)
        self.anchors[anchor] = node

    def _tag(self, kind: type[Node], event: Any, value: str | None) -> str:
        tag = event.tag
        if tag is None or tag == "!":
            tag = self.loader.resolve(kind, value, event.implicit)
        return str(tag)

    def _refuse(self) -> None:
        what = "playbook after alias expansion" if self.expanded else "playbook"
        limits = self.limits
        if self.nodes > limits.yaml_nodes:
            raise exceeded(what, self.nodes, "yaml_nodes", limits.yaml_nodes, unit="YAML nodes", at_least=True,
                           path="")
        raise exceeded(what, self.chars, "playbook_bytes", limits.playbook_bytes, unit="characters of scalars",
                       at_least=True, path="")
