"""JSON encoding of result values, the one place that decides how non-JSON Python
values are written (every result, envelope context and sandbox reply goes through it).

Conversions: datetime/date/time -> ISO 8601 text; Decimal -> int when integral, else
float; UUID -> text; bytes -> UTF-8 text (base64 when not UTF-8); set/frozenset/tuple
-> list; dataclasses -> dict; objects with ``tolist()`` / ``item()`` (numpy) or
``model_dump()`` (pydantic) -> their plain form. Anything else is a TypeError.

This module imports only the standard library: the python sandbox child imports it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID


def json_default(value: Any) -> Any:
    """``json.dumps(default=...)`` hook implementing the conversions above."""
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        if value.is_finite() and value == value.to_integral_value():
            return int(value)
        return float(value)
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode("ascii")
    if isinstance(value, set | frozenset | tuple):
        items = list(value)
        if isinstance(value, set | frozenset):
            try:
                items.sort()
            except TypeError:
                pass
        return items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    for method in ("model_dump", "tolist", "item"):
        fn = getattr(value, method, None)
        if callable(fn):
            return fn()
    raise TypeError(f"object of type {type(value).__name__} is not JSON serialisable")


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON. Non-finite floats become null (JSON has no NaN)."""
    try:
        text = json.dumps(value, default=json_default, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(value), default=json_default, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def decode_json(data: bytes | bytearray | memoryview | str) -> Any:
    if isinstance(data, memoryview):
        data = bytes(data)
    return json.loads(data)


def to_jsonable(value: Any) -> Any:
    """The value as it will read back from the store (plain dict/list/str/number/bool/None)."""
    return json.loads(encode_json(value))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
