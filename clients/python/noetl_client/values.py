"""JSON values <-> ``google.protobuf.Struct`` / ``Value``: the one converter of the client
API's JSON fields (payloads, step results, event envelopes, error details, credential
fields). The api uses it too, so both ends follow the same rules (docs/CLIENTS.md
"JSON values and numbers"):

- Numbers. A ``Value`` holds every number as a double. An integer travels exactly when
  ``|n| <= 2**53`` (``MAX_EXACT_INT``), and reads back as a Python ``int`` whenever the
  double is integral and within that range, so ``{"n": 3}`` round-trips as ``3``, not
  ``3.0`` (and ``2.0`` reads back as ``2``: JSON does not tell them apart either). An
  integer beyond 2**53 travels as its decimal string (``"9007199254740993"``), never
  rounded. NaN and infinities travel as null (JSON has neither).
- Nesting. protobuf decoders refuse a message nested deeper than 100 levels, and every
  level of a JSON object costs three of them (Struct, map entry, Value), so a value
  nests at most ``MAX_DEPTH`` (32) levels on the wire. ``to_value`` refuses a deeper
  one (``ValueError``), or with ``too_deep="json"`` sends each container at that depth as
  its JSON text (the api does this for results, so a deep result cannot make a response
  undecodable).
- Everything else as ``json.dumps`` does it: tuples are lists, mapping keys become
  strings, other objects go through ``default`` (``TypeError`` without one).
- Key order. A Struct's fields are a protobuf map: an object's keys arrive in no
  particular order.

Iterative, not recursive: a deep value costs no Python stack.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from google.protobuf import struct_pb2

MAX_EXACT_INT = 2**53
MAX_DEPTH = 32

Default = Callable[[Any], Any]


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _scalar(target: struct_pb2.Value, obj: Any) -> bool:
    """Set ``target`` to the scalar ``obj``; False when ``obj`` is not a scalar."""
    if obj is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        target.bool_value = obj
    elif isinstance(obj, int):
        if -MAX_EXACT_INT <= obj <= MAX_EXACT_INT:
            target.number_value = float(obj)
        else:
            target.string_value = str(obj)
    elif isinstance(obj, float):
        if math.isfinite(obj):
            target.number_value = obj
        else:
            target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, str):
        target.string_value = obj
    else:
        return False
    return True


def to_value(obj: Any, *, default: Default | None = None, too_deep: Literal["error", "json"] = "error",
             max_depth: int = MAX_DEPTH) -> struct_pb2.Value:
    """The ``Value`` of a JSON-like Python value (see the module docstring)."""
    root = struct_pb2.Value()
    # (target Value, python object, depth of the container that holds it)
    stack: list[tuple[struct_pb2.Value, Any, int]] = [(root, obj, 0)]
    while stack:
        target, item, depth = stack.pop()
        for _ in range(8):  # default() may return another object to convert (bounded)
            if _scalar(target, item) or isinstance(item, Mapping | list | tuple):
                break
            if default is None:
                raise TypeError(f"Object of type {type(item).__name__} is not JSON serializable")
            item = default(item)
        else:
            raise TypeError(f"default() did not return a JSON value for {type(obj).__name__}")
        if not isinstance(item, Mapping | list | tuple):
            continue
        if depth >= max_depth:
            if too_deep == "json":
                target.string_value = json.dumps(item, default=default, separators=(",", ":"))
                continue
            raise ValueError(f"the value nests deeper than {max_depth} levels, the most a protobuf Struct "
                             "carries (docs/CLIENTS.md \"JSON values and numbers\")")
        if isinstance(item, Mapping):
            fields = target.struct_value.fields
            target.struct_value.SetInParent()  # an empty object stays an object
            for k, v in item.items():
                stack.append((fields[_key(k)], v, depth + 1))
        else:
            values = target.list_value.values
            target.list_value.SetInParent()
            for v in item:
                stack.append((values.add(), v, depth + 1))
    return root


def to_struct(obj: Mapping[str, Any] | None, *, default: Default | None = None,
              too_deep: Literal["error", "json"] = "error", max_depth: int = MAX_DEPTH) -> struct_pb2.Struct:
    """The ``Struct`` of a mapping (None: an empty one)."""
    if obj is None:
        return struct_pb2.Struct()
    if not isinstance(obj, Mapping):
        raise TypeError(f"a Struct holds a JSON object (a mapping), not {type(obj).__name__}")
    return to_value(obj, default=default, too_deep=too_deep, max_depth=max_depth).struct_value


def _number(n: float) -> int | float:
    return int(n) if n.is_integer() and -MAX_EXACT_INT <= n <= MAX_EXACT_INT else n


def _drain(stack: list[tuple[struct_pb2.Value, Any, Any]]) -> None:
    """Read each (Value, container, key) of ``stack`` into ``container[key]``, iteratively."""
    while stack:
        src, parent, key = stack.pop()
        kind = src.WhichOneof("kind")
        result: Any
        if kind == "struct_value":
            result = {}
            stack.extend((v, result, k) for k, v in src.struct_value.fields.items())
        elif kind == "list_value":
            result = [None] * len(src.list_value.values)
            stack.extend((v, result, i) for i, v in enumerate(src.list_value.values))
        elif kind == "number_value":
            result = _number(src.number_value)
        elif kind == "string_value":
            result = src.string_value
        elif kind == "bool_value":
            result = src.bool_value
        else:  # null_value, or unset
            result = None
        parent[key] = result


def from_value(value: struct_pb2.Value) -> Any:
    """The Python value of a ``Value``: dict, list, str, bool, None, int (an integral
    number within 2**53) or float. An unset Value reads as None."""
    out: list[Any] = [None]
    _drain([(value, out, 0)])
    return out[0]


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """The dict of a ``Struct`` (numbers as ``from_value`` reads them)."""
    result: dict[str, Any] = {}
    _drain([(v, result, k) for k, v in struct.fields.items()])
    return result


__all__ = ["MAX_DEPTH", "MAX_EXACT_INT", "from_struct", "from_value", "to_struct", "to_value"]
