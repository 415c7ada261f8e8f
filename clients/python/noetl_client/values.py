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

Reading is iterative; writing recurses at most ``max_depth`` levels.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any, Literal

from google.protobuf import struct_pb2

MAX_EXACT_INT = 2**53
MAX_DEPTH = 32

Default = Callable[[Any], Any]


_pack_double = struct.Struct("<d").pack
# Value's fields on the wire: null_value (1, varint), number_value (2, 64-bit), string_value
# (3), struct_value (5), list_value (6); Struct's map entries (1) of key (1) and value (2);
# ListValue's values (1).
_NULL, _TRUE, _FALSE = b"\x08\x00", b"\x20\x01", b"\x20\x00"
_NUMBER, _STRING, _STRUCT, _LIST, _ENTRY_KEY, _ENTRY_VALUE, _ITEM = (
    b"\x11", b"\x1a", b"\x2a", b"\x32", b"\x0a", b"\x12", b"\x0a")


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


class _Encoder:
    """Python value -> the wire bytes of a ``Value`` (or a ``Struct``), written directly:
    several times faster than building the message field by field (a 1,000,000-number
    list: 0.6 s instead of 2.2 s), which matters to the api, whose results share the CPU
    with its engine. Recursion is bounded by ``max_depth``."""

    def __init__(self, default: Default | None, too_deep: str, max_depth: int) -> None:
        self.default = default
        self.too_deep = too_deep
        self.max_depth = max_depth

    def value(self, obj: Any, depth: int) -> bytes:
        kind = type(obj)
        if kind is str:
            raw = obj.encode("utf-8")
            return _STRING + _varint(len(raw)) + raw
        if kind is int:
            if -MAX_EXACT_INT <= obj <= MAX_EXACT_INT:
                return _NUMBER + _pack_double(obj)
            raw = str(obj).encode()
            return _STRING + _varint(len(raw)) + raw
        if kind is float:
            return _NUMBER + _pack_double(obj) if math.isfinite(obj) else _NULL
        if obj is None:
            return _NULL
        if kind is bool:
            return _TRUE if obj else _FALSE
        if isinstance(obj, Mapping | list | tuple):
            if depth >= self.max_depth:
                if self.too_deep == "json":
                    return self.value(json.dumps(obj, default=self.default, separators=(",", ":")), depth)
                raise ValueError(f"the value nests deeper than {self.max_depth} levels, the most a protobuf "
                                 "Struct carries (docs/CLIENTS.md \"JSON values and numbers\")")
            if isinstance(obj, Mapping):
                body = self.struct_body(obj, depth)
                return _STRUCT + _varint(len(body)) + body
            items = [self.value(item, depth + 1) for item in obj]
            body = b"".join(_ITEM + _varint(len(v)) + v for v in items)
            return _LIST + _varint(len(body)) + body
        return self.value(self.plain(obj), depth)

    def struct_body(self, obj: Mapping[Any, Any], depth: int) -> bytes:
        parts = []
        for k, item in obj.items():
            key = _key(k).encode("utf-8")
            v = self.value(item, depth + 1)
            entry = _ENTRY_KEY + _varint(len(key)) + key + _ENTRY_VALUE + _varint(len(v)) + v
            parts.append(_ITEM + _varint(len(entry)) + entry)
        return b"".join(parts)

    def plain(self, obj: Any) -> Any:
        """A subclass of a JSON type as that type, else ``default(obj)``."""
        for base in (bool, int, float, str):
            if isinstance(obj, base):
                return base(obj)
        if self.default is None:
            raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
        for _ in range(8):  # default() may return another object to convert (bounded)
            obj = self.default(obj)
            if obj is None or isinstance(obj, bool | int | float | str | Mapping | list | tuple):
                return obj
        raise TypeError(f"default() did not return a JSON value for {type(obj).__name__}")


def to_value(obj: Any, *, default: Default | None = None, too_deep: Literal["error", "json"] = "error",
             max_depth: int = MAX_DEPTH) -> struct_pb2.Value:
    """The ``Value`` of a JSON-like Python value (see the module docstring)."""
    return struct_pb2.Value.FromString(_Encoder(default, too_deep, max_depth).value(obj, 0))


def to_struct(obj: Mapping[str, Any] | None, *, default: Default | None = None,
              too_deep: Literal["error", "json"] = "error", max_depth: int = MAX_DEPTH) -> struct_pb2.Struct:
    """The ``Struct`` of a mapping (None: an empty one)."""
    if obj is None:
        return struct_pb2.Struct()
    if not isinstance(obj, Mapping):
        raise TypeError(f"a Struct holds a JSON object (a mapping), not {type(obj).__name__}")
    if max_depth <= 0:
        raise ValueError(f"the value nests deeper than {max_depth} levels")
    return struct_pb2.Struct.FromString(_Encoder(default, too_deep, max_depth).struct_body(obj, 0))


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
