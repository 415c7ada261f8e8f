"""Result values as the worker reports them: the JSON codec, envelope v3 and its
context extraction, the protobuf form, and the in-memory / cached stores."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from uuid import UUID

import pytest

import noetl_store
from noetl_client import values
from noetl_common.errors import NotFound
from noetl_store import (
    CachedResultStore,
    MemoryResultStore,
    Reference,
    context_of,
    encode_json,
    envelope,
    envelope_from_proto,
    envelope_to_proto,
    to_jsonable,
)

# ---------------------------------------------------------------- codec


def test_encode_json_conversions() -> None:
    @dataclass
    class P:
        x: int

    value = {"dt": datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC), "d": date(2024, 1, 2), "i": Decimal("10"),
             "f": Decimal("1.25"), "u": UUID(int=5), "b": b"bytes", "raw": b"\xff\x00", "s": {3, 1},
             "t": (1, "a"), "p": P(1), "nan": float("nan"), "text": "é"}
    assert json.loads(encode_json(value)) == {
        "dt": "2024-01-02T03:04:05+00:00", "d": "2024-01-02", "i": 10, "f": 1.25,
        "u": "00000000-0000-0000-0000-000000000005", "b": "bytes", "raw": "/wA=", "s": [1, 3],
        "t": [1, "a"], "p": {"x": 1}, "nan": None, "text": "é"}
    assert isinstance(json.loads(encode_json(Decimal("10"))), int)


def test_encode_json_rejects_unknown_objects() -> None:
    with pytest.raises(TypeError, match="not JSON serialisable"):
        encode_json({"x": object()})


def test_to_jsonable_is_what_a_reader_gets_back() -> None:
    assert to_jsonable({"d": Decimal("2"), "t": (1,)}) == {"d": 2, "t": [1]}


# ---------------------------------------------------------------- envelope / context


def test_context_of_dict_keeps_small_top_level_scalars_only() -> None:
    value = {"status": "ok", "n": 3, "f": 1.5, "b": True, "none": None, "long": "x" * 257,
             "edge": "y" * 256, "nested": {"a": 1}, "list": [1], "inf": float("inf")}
    assert context_of(value) == {"status": "ok", "n": 3, "f": 1.5, "b": True, "none": None, "edge": "y" * 256}


def test_context_of_caps_key_count() -> None:
    assert len(context_of({f"k{i}": i for i in range(100)})) == noetl_store.MAX_CONTEXT_KEYS


def test_context_of_scalars_and_others() -> None:
    assert context_of(42) == {"value": 42}
    assert context_of("done") == {"value": "done"}
    assert context_of(False) == {"value": False}
    assert context_of(None) == {}
    assert context_of([1, 2]) == {}
    assert context_of("z" * 300) == {}


def test_envelope_ok_has_no_error_key() -> None:
    ref, parent = Reference(7, "db", "pg://result_payload/7"), Reference(6, "db", "pg://result_payload/6")
    env = envelope("ok", ref, parent, {"status": "initialized", "rows": [1]})
    assert env == {"status": "ok", "reference": {"ref_id": 7, "type": "db", "uri": "pg://result_payload/7"},
                   "parent_ref": {"ref_id": 6}, "context": {"status": "initialized"}}


def test_envelope_error() -> None:
    env = envelope("error", None, 3, None, {"code": "TIMEOUT", "message": "m" * 5000, "kind": "TimeoutError",
                                            "retryable": True, "details": {"tb": "..."}})
    assert env["reference"] is None and env["parent_ref"] == {"ref_id": 3}
    assert set(env["error"]) == {"code", "message", "kind", "type", "retryable"}
    assert env["error"]["code"] == "TIMEOUT" and len(env["error"]["message"]) == 4000
    assert set(env) == {"status", "reference", "parent_ref", "context", "error"}


def test_envelope_proto_round_trip() -> None:
    env = envelope("error", Reference(9, "db", "pg://result_payload/9"), Reference(8, "db", "u"),
                   {"a": 1}, {"code": "TOOL_ERROR", "message": "x", "kind": "ValueError", "retryable": False})
    pb = envelope_to_proto(env, error_details={"traceback": "tb"})
    assert values.from_struct(pb.error.details) == {"traceback": "tb"}
    assert pb.parent_ref.ref_id == 8
    assert envelope_from_proto(pb) == env
    ok = envelope("ok", None, None, 5)
    assert envelope_from_proto(envelope_to_proto(ok)) == ok


def test_public_surface() -> None:
    assert sorted(noetl_store.__all__) == sorted([
        "MAX_CONTEXT_KEYS", "MAX_CONTEXT_STRING", "RESULT_BYTES_SETTING", "CachedResultStore", "KvCachedResultStore",
        "MemoryResultStore", "PostgresResultStore", "Reference", "ResultStore", "ResultTooLarge", "S3Client",
        "S3Config", "S3ResultStore", "TRACE_COLUMNS", "check_result_size", "context_of", "decode_json", "encode_json", "entry_from_json", "entry_json", "envelope",
        "envelope_from_proto", "envelope_to_proto", "error_info", "is_secret_key", "json_default",
        "loop_reference", "make_result_store", "to_jsonable", "trace"])
    for name in noetl_store.__all__:
        assert getattr(noetl_store, name) is not None
    with pytest.raises(AttributeError):
        _ = noetl_store.nope  # type: ignore[attr-defined]


def test_reference_json() -> None:
    ref = Reference(1, "db", "pg://result_payload/1")
    assert Reference.from_json(ref.to_json()) == ref
    with pytest.raises(ValueError):
        Reference.from_json({"ref_id": "1"})


# ---------------------------------------------------------------- memory and cached stores


async def test_memory_store_chain_and_missing() -> None:
    store = MemoryResultStore()
    first = await store.put({"a": 1}, execution_id=1, step="s", command_id="c", task="t1", parent_ref_id=None)
    second = await store.put([1, 2], execution_id=1, step="s", command_id="c", task="t2",
                             parent_ref_id=first.ref_id)
    assert store.parent_of(second.ref_id) == first.ref_id
    assert await store.get_many([second.ref_id, first.ref_id]) == {second.ref_id: [1, 2], first.ref_id: {"a": 1}}
    with pytest.raises(NotFound):
        await store.get(999)
    with pytest.raises(NotFound):
        await store.put(1, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=999)


class CountingStore(MemoryResultStore):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    async def get(self, ref_id: int) -> object:
        self.reads += 1
        return await super().get(ref_id)


async def test_cached_store_reads_through_once_and_evicts_lru() -> None:
    inner = CountingStore()
    cache = CachedResultStore(inner, max_items=2, put_cache_bytes=0)  # reads only: nothing kept on put
    refs = [await cache.put(i, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
            for i in range(3)]
    assert inner.reads == 0
    assert await cache.get(refs[0].ref_id) == 0
    assert await cache.get(refs[0].ref_id) == 0
    assert inner.reads == 1
    assert await cache.get_many([refs[1].ref_id, refs[0].ref_id]) == {refs[1].ref_id: 1, refs[0].ref_id: 0}
    assert inner.reads == 2
    await cache.get(refs[0].ref_id)  # refs[0] most recently used, refs[1] least
    await cache.get(refs[2].ref_id)  # evicts refs[1]
    assert len(cache) == 2 and inner.reads == 3
    await cache.get(refs[0].ref_id)
    assert inner.reads == 3
    await cache.get(refs[1].ref_id)
    assert inner.reads == 4
    with pytest.raises(NotFound):
        await cache.get(12345)
    with pytest.raises(ValueError):
        CachedResultStore(inner, max_items=0)


async def test_cached_store_keeps_a_small_value_it_writes_as_a_read_would_return_it() -> None:
    inner = CountingStore()
    cache = CachedResultStore(inner, max_items=8, put_cache_bytes=64)
    value = {"t": (1, 2), "when": datetime(2024, 1, 2, tzinfo=UTC), "n": Decimal("1.5")}
    ref = await cache.put(value, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
    assert ref.size == len(encode_json(value))
    got = await cache.get(ref.ref_id)
    assert inner.reads == 0  # served from what the put kept
    assert got == await inner.get(ref.ref_id)  # the decoded form, not the object written
    assert got == {"t": [1, 2], "when": "2024-01-02T00:00:00+00:00", "n": 1.5}
    # beyond put_cache_bytes: written through, not kept (read back from the store)
    big = await cache.put("x" * 100, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
    assert big.size > 64
    reads = inner.reads
    assert await cache.get(big.ref_id) == "x" * 100
    assert inner.reads == reads + 1


async def test_cached_store_is_bounded_by_encoded_bytes_and_keeps_no_value_past_its_share() -> None:
    """A result may be up to NOETL_LIMIT_RESULT_BYTES: counted by items alone, a cache of
    2,048 could hold gigabytes. It keeps at most max_bytes (encoded) in all, least recently
    used out first, and a value above max_bytes // 16 is served but not kept."""
    inner = CountingStore()
    cache = CachedResultStore(inner, max_items=100, put_cache_bytes=0, max_bytes=1600)  # 100 bytes a value at most
    small = [await cache.put("s" * 38, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
             for _ in range(20)]  # 40 encoded bytes each
    for ref in small:
        assert await cache.get(ref.ref_id) == "s" * 38
    assert cache.bytes == 20 * 40 and len(cache) == 20  # all kept
    big = await cache.put("b" * 200, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
    reads = inner.reads
    assert await cache.get(big.ref_id) == "b" * 200
    assert await cache.get_many([big.ref_id]) == {big.ref_id: "b" * 200}
    assert inner.reads == reads + 2  # served both times, kept neither time
    assert len(cache) == 20  # and nothing was evicted for it
    more = [await cache.put("m" * 88, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
            for _ in range(12)]  # 90 encoded bytes each: 1,080 of them push out the oldest small ones
    for ref in more:
        await cache.get(ref.ref_id)
    assert cache.bytes <= 1600
    assert len(cache) == 12 + (1600 - 12 * 90) // 40
    reads = inner.reads
    await cache.get(small[-1].ref_id)  # the most recent small one is still kept
    assert inner.reads == reads
    await cache.get(small[0].ref_id)  # the oldest is gone
    assert inner.reads == reads + 1
    with pytest.raises(ValueError):
        CachedResultStore(inner, max_bytes=8)


def test_reference_size_is_not_part_of_its_identity() -> None:
    assert Reference(1, "db", "pg://result_payload/1", 10) == Reference(1, "db", "pg://result_payload/1")
    assert Reference(1, "db", "pg://result_payload/1", 10).to_json() == {"ref_id": 1, "type": "db",
                                                                        "uri": "pg://result_payload/1"}


async def test_cached_store_reports_what_it_serves_as_the_process_cache() -> None:
    """Its hits and misses count in noetl_result_cache_requests_total{cache="process"} and
    its hits are resolves of tier "process" (the dashboards' cache and resolve panels)."""
    from prometheus_client import REGISTRY

    def sample(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    hits0 = sample("noetl_result_cache_requests_total", {"cache": "process", "outcome": "hit"})
    misses0 = sample("noetl_result_cache_requests_total", {"cache": "process", "outcome": "miss"})
    resolves0 = sample("noetl_reference_resolve_seconds_count", {"tier": "process"})
    cache = CachedResultStore(MemoryResultStore(), max_items=8, put_cache_bytes=0)
    ref = await cache.put({"a": 1}, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
    await cache.get(ref.ref_id)  # miss: read through
    await cache.get_many([ref.ref_id])  # hit
    assert sample("noetl_result_cache_requests_total", {"cache": "process", "outcome": "miss"}) == misses0 + 1
    assert sample("noetl_result_cache_requests_total", {"cache": "process", "outcome": "hit"}) == hits0 + 1
    assert sample("noetl_reference_resolve_seconds_count", {"tier": "process"}) == resolves0 + 1
