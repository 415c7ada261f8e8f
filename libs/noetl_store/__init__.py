"""The result store: payloads behind references (envelope v3), persist-before-emit.

    ResultStore                  put(value, ...) -> Reference, get(ref_id), get_many(ids)
    ├── PostgresResultStore      tier "db": noetl.result_ref + noetl.result_payload
    ├── MemoryResultStore        process-local, for tests and tooling
    └── CachedResultStore        read-through LRU over another store

Helpers: ``encode_json`` (the one JSON encoder for results), ``envelope`` /
``context_of`` (the v3 envelope), ``envelope_to_proto`` / ``envelope_from_proto``.

``PostgresResultStore`` and the protobuf helpers are imported lazily so that light
importers (the python sandbox child) do not pay for psycopg or protobuf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._codec import decode_json, encode_json, json_default, to_jsonable
from ._envelope import MAX_CONTEXT_KEYS, MAX_CONTEXT_STRING, context_of, envelope, error_info
from ._store import CachedResultStore, MemoryResultStore, Reference, ResultStore

if TYPE_CHECKING:
    from ._postgres import PostgresResultStore
    from ._proto import envelope_from_proto, envelope_to_proto

__all__ = [
    "MAX_CONTEXT_KEYS",
    "MAX_CONTEXT_STRING",
    "CachedResultStore",
    "MemoryResultStore",
    "PostgresResultStore",
    "Reference",
    "ResultStore",
    "context_of",
    "decode_json",
    "encode_json",
    "envelope",
    "envelope_from_proto",
    "envelope_to_proto",
    "error_info",
    "json_default",
    "to_jsonable",
]

_LAZY = {
    "PostgresResultStore": "._postgres",
    "envelope_to_proto": "._proto",
    "envelope_from_proto": "._proto",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
