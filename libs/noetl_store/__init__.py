"""The result store: payloads behind references (envelope v3), persist-before-emit.

    ResultStore                  put(value, ...) -> Reference, get(ref_id), get_many(ids)
    ├── PostgresResultStore      writes tier "db" (noetl.result_payload); reads every tier
    │   └── S3ResultStore        writes tier "s3" (an S3-compatible object store)
    ├── KvCachedResultStore      NATS KV read-through cache over another store
    ├── CachedResultStore        in-process read-through LRU over another store
    └── MemoryResultStore        process-local, for tests and tooling

Every reference is a ``noetl.result_ref`` row (tier, uri, size, sha256, parent_ref_id)
whatever the tier. ``make_result_store(settings, pool, js)`` builds what a service uses
from ``noetl_common.config.ResultStoreSettings``; ``S3Client`` is the object-store client
(obstore: the Rust object_store crate's S3 client and AWS credential chain).

A tier built with a result size limit (``make_result_store(..., max_result_bytes=N)``,
the worker passes ``NOETL_LIMIT_RESULT_BYTES``) refuses a larger value with
``ResultTooLarge`` (an ``InvalidInput``: the task's failure, not the store's);
``check_result_size`` is the same check for tools that measure a result before it exists.

Helpers: ``encode_json`` (the one JSON encoder for results), ``envelope`` /
``context_of`` (the v3 envelope; credential-shaped keys never reach ``context``),
``envelope_to_proto`` / ``envelope_from_proto``.

Everything that needs psycopg, httpx, obstore, NATS, Prometheus or protobuf is imported lazily so
that light importers (the python sandbox child) do not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from noetl_common.codec import decode_json, encode_json, json_default, to_jsonable

from ._envelope import MAX_CONTEXT_KEYS, MAX_CONTEXT_STRING, context_of, envelope, error_info, is_secret_key
from ._store import (
    RESULT_BYTES_SETTING,
    CachedResultStore,
    MemoryResultStore,
    Reference,
    ResultStore,
    ResultTooLarge,
    check_result_size,
)

if TYPE_CHECKING:
    from ._factory import make_result_store
    from ._kv import KvCachedResultStore
    from ._lineage import TRACE_COLUMNS, entry_from_json, entry_json, trace
    from ._postgres import PostgresResultStore, S3ResultStore, loop_reference
    from ._proto import envelope_from_proto, envelope_to_proto
    from ._s3 import S3Client, S3Config

__all__ = [
    "MAX_CONTEXT_KEYS",
    "MAX_CONTEXT_STRING",
    "RESULT_BYTES_SETTING",
    "TRACE_COLUMNS",
    "CachedResultStore",
    "KvCachedResultStore",
    "MemoryResultStore",
    "PostgresResultStore",
    "Reference",
    "ResultStore",
    "ResultTooLarge",
    "S3Client",
    "S3Config",
    "S3ResultStore",
    "check_result_size",
    "context_of",
    "decode_json",
    "encode_json",
    "entry_from_json",
    "entry_json",
    "envelope",
    "envelope_from_proto",
    "envelope_to_proto",
    "error_info",
    "is_secret_key",
    "json_default",
    "loop_reference",
    "make_result_store",
    "to_jsonable",
    "trace",
]

_LAZY = {
    "PostgresResultStore": "._postgres",
    "S3ResultStore": "._postgres",
    "loop_reference": "._postgres",
    "KvCachedResultStore": "._kv",
    "TRACE_COLUMNS": "._lineage",
    "entry_json": "._lineage",
    "entry_from_json": "._lineage",
    "trace": "._lineage",
    "S3Client": "._s3",
    "S3Config": "._s3",
    "make_result_store": "._factory",
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
