"""Result store conformance: ONE suite over every tier behind the ``ResultStore``
interface (River's ``riverdrivertest`` style), against real servers started by the tests:
Postgres, NATS JetStream (KV) and an S3-protocol server (SeaweedFS, SigV4 enforced).

    memory      MemoryResultStore (process-local)
    db          PostgresResultStore: payloads in noetl.result_payload
    s3          S3ResultStore: payloads as objects, references in noetl.result_ref
    db+kv       NATS KV read-through cache over db
    s3+kv       NATS KV read-through cache over s3
    db+lru      in-process LRU over db

Then what is specific to the Postgres-indexed tiers (the result_ref rows, the chain,
loop references over any tier), to the object store (no result_payload row, integrity)
and to the KV cache (hits, purge and bucket deletion change nothing, large values skip).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError as NatsNotFound
from psycopg.rows import dict_row
from waiting import until

from noetl_common.config import ResultStoreSettings
from noetl_common.db import Pool, make_pool
from noetl_common.errors import NoetlError, NotFound, Unavailable
from noetl_store import (
    CachedResultStore,
    KvCachedResultStore,
    MemoryResultStore,
    PostgresResultStore,
    ResultStore,
    ResultTooLarge,
    S3Client,
    S3Config,
    S3ResultStore,
    encode_json,
    make_result_store,
    trace,
)
from noetl_store._metrics import CACHE, RESOLVE_SECONDS, WRITES

pytestmark = pytest.mark.integration

EXECUTION_ID = 7_000_000_001
S3_BUCKET = "noetl-test"  # created by the s3_server fixture (tests/conftest.py)
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens


def s3_config(server: Any, *, endpoint: str = "", timeout: float = 10.0) -> S3Config:
    return S3Config(endpoint or server.endpoint, S3_BUCKET, server.access_key, server.secret_key,
                    timeout_sec=timeout, connect_timeout_sec=1.0, attempts=2)


@dataclass
class Tier:
    name: str
    store: ResultStore
    # a store of the same kind whose backend cannot be reached (None: no backend)
    broken: Callable[[], Awaitable[ResultStore]] | None
    indexed: bool  # references in noetl.result_ref


@pytest.fixture(params=["memory", "db", "s3", "db+kv", "s3+kv", "db+lru"])
async def tier(request: pytest.FixtureRequest, pool: Pool, nc: NATS, s3_server: Any,
               pg_dsn: str) -> AsyncIterator[Tier]:
    name = request.param
    closers: list[Any] = []

    def objects(endpoint: str = "") -> S3Client:
        client = S3Client(s3_config(s3_server, endpoint=endpoint, timeout=2.0 if endpoint else 10.0))
        closers.append(client)
        return client

    def base(kind: str, *, broken: bool = False) -> ResultStore:
        if kind == "db":
            return PostgresResultStore(pool, objects=objects(), timeout_sec=1.0 if broken else 30.0)
        return S3ResultStore(pool, objects(DEAD_ENDPOINT if broken else ""), timeout_sec=30.0)

    async def dead_pool() -> Pool:
        dead = make_pool("host=127.0.0.1 port=9 user=noetl dbname=noetl connect_timeout=1", min_size=0, max_size=1,
                         name="test-dead")
        await dead.open(wait=False)
        closers.append(dead)
        return dead

    bucket = f"noetl_results_test_{uuid.uuid4().hex[:8]}"

    def kv(inner: ResultStore) -> KvCachedResultStore:
        return KvCachedResultStore(inner, nc.jetstream(), bucket=bucket, max_value_bytes=64 * 1024, timeout_sec=2.0)

    store: ResultStore
    broken: Callable[[], Awaitable[ResultStore]] | None
    if name == "memory":
        store, broken = MemoryResultStore(), None
    elif name in ("db", "db+kv", "db+lru"):
        async def broken_db() -> ResultStore:
            inner = PostgresResultStore(await dead_pool(), timeout_sec=1.0)
            return kv(inner) if name == "db+kv" else CachedResultStore(inner) if name == "db+lru" else inner
        store, broken = base("db"), broken_db
        if name == "db+kv":
            store = kv(store)
        elif name == "db+lru":
            store = CachedResultStore(store, max_items=4)
    else:
        async def broken_s3() -> ResultStore:
            inner = base("s3", broken=True)
            return kv(inner) if name == "s3+kv" else inner
        store, broken = base("s3"), broken_s3
        if name == "s3+kv":
            store = kv(store)
    yield Tier(name, store, broken, indexed=name != "memory")
    for c in closers:
        await c.close()
    if name.endswith("+kv"):
        with contextlib.suppress(Exception):  # best-effort cleanup of the test bucket
            await nc.jetstream().delete_key_value(bucket)


async def one(pool: Pool, sql: str, params: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The first row of ``sql`` as a dict (committed)."""
    async with pool.connection() as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(sql, params)
        row = await cur.fetchone()
        await conn.commit()
    assert row is not None
    return row


async def put(store: ResultStore, value: Any, parent: int | None = None, task: str = "t") -> int:
    ref = await store.put(value, execution_id=EXECUTION_ID, step="step_a", command_id="cmd-1", task=task,
                          parent_ref_id=parent)
    return ref.ref_id


# ---------------------------------------------------------------- conformance (every tier)


@pytest.mark.parametrize("value", [
    {"status": "ok", "rows": [{"a": 1}, {"b": None}]}, [1, "two", 3.5, True], "text é ✓", 42, None, {},
])
async def test_put_get_round_trip(tier: Tier, value: Any) -> None:
    ref_id = await put(tier.store, value)
    assert await tier.store.get(ref_id) == value
    assert await tier.store.get(ref_id) == value  # a second read (a cache hit where there is a cache)


async def test_large_value(tier: Tier) -> None:
    """Above the KV value limit (64 KiB here): not cached, still read back whole."""
    value = {"blob": "x" * 2_000_000, "n": list(range(1000))}
    ref_id = await put(tier.store, value)
    assert await tier.store.get(ref_id) == value
    assert await tier.store.get(ref_id) == value


async def test_get_many(tier: Tier) -> None:
    ids = [await put(tier.store, {"i": i}) for i in range(3)]
    assert await tier.store.get_many(reversed(ids)) == {i: {"i": n} for n, i in enumerate(ids)}
    assert await tier.store.get_many(ids) == {i: {"i": n} for n, i in enumerate(ids)}
    assert await tier.store.get_many([]) == {}


async def test_get_many_sized_reports_each_values_encoded_size(tier: Tier) -> None:
    """What a cache in front bounds itself by: the encoded bytes of each value, read with it."""
    values = [{"i": 1}, "x" * 5_000, [1.5, None, "é"]]
    ids = [await put(tier.store, v) for v in values]
    sized = await tier.store.get_many_sized([*ids, 987_654_321])  # a missing id is left out
    assert sized == {i: (v, len(encode_json(v))) for i, v in zip(ids, values, strict=True)}


async def test_missing_reference_is_not_found(tier: Tier) -> None:
    with pytest.raises(NotFound, match="not found"):
        await tier.store.get(9_999_999_999)
    existing = await put(tier.store, 1)
    assert await tier.store.get_many([existing, 9_999_999_998]) == {existing: 1}  # missing ones left out


async def test_unknown_parent_is_not_found(tier: Tier) -> None:
    with pytest.raises(NotFound, match="parent"):
        await put(tier.store, {"x": 1}, parent=9_999_999_997)


async def test_chain_of_parents(tier: Tier, pool: Pool) -> None:
    first = await put(tier.store, {"a": 1}, task="t1")
    second = await put(tier.store, [1, 2], parent=first, task="t2")
    third = await put(tier.store, "three", parent=second, task="t3")
    assert await tier.store.get_many([third, first, second]) == {third: "three", first: {"a": 1}, second: [1, 2]}
    if isinstance(tier.store, MemoryResultStore):
        assert tier.store.parent_of(third) == second and tier.store.parent_of(first) is None
        return
    async with pool.connection() as conn:
        chain = await trace(conn, third)
    assert [(e["ref_id"], e["parent_ref_id"], e["task"]) for e in chain] == [
        (third, second, "t3"), (second, first, "t2"), (first, None, "t1")]


async def test_concurrent_puts_get_distinct_ids(tier: Tier) -> None:
    ids = await asyncio.gather(*(put(tier.store, {"n": n}) for n in range(20)))
    assert len(set(ids)) == 20
    assert await tier.store.get_many(ids) == {i: {"n": n} for n, i in enumerate(ids)}


async def test_unavailable_backend_is_a_clear_error(tier: Tier) -> None:
    if tier.broken is None:
        pytest.skip(f"{tier.name} has no backend that can be down")
    broken = await tier.broken()
    with pytest.raises(Unavailable) as put_error:
        await asyncio.wait_for(put(broken, {"x": 1}), timeout=15)
    message = str(put_error.value)
    assert "S3 server" in message if "s3" in tier.name else "did not finish within 1s" in message
    if "s3" in tier.name:
        return  # reads of s3 references need the index (Postgres, up) and then the objects
    with pytest.raises(Unavailable, match="did not finish within 1s"):
        await asyncio.wait_for(broken.get(1), timeout=15)


# ---------------------------------------------------------------- the Postgres-indexed tiers


@pytest.mark.parametrize("kind", ["db", "s3"])
async def test_reference_rows(kind: str, pool: Pool, s3_server: Any) -> None:
    """Every tier keeps tier, uri, size, sha256 and parent_ref_id in noetl.result_ref; an
    s3 reference has no result_payload row."""
    objects = S3Client(s3_config(s3_server))
    store = PostgresResultStore(pool) if kind == "db" else S3ResultStore(pool, objects, prefix="it/")
    first = await store.put({"a": 1}, execution_id=EXECUTION_ID, step="s", command_id="c-9", task="t1",
                            parent_ref_id=None)
    second = await store.put([1, 2], execution_id=EXECUTION_ID, step="s", command_id="c-9", task="t2",
                             parent_ref_id=first.ref_id)
    expected_uri = (f"pg://result_payload/{second.ref_id}" if kind == "db"
                    else f"s3://{S3_BUCKET}/it/{EXECUTION_ID}/{second.ref_id}.json")
    assert (second.type, second.uri) == (kind, expected_uri)
    row = await one(pool, "SELECT * FROM noetl.result_ref WHERE ref_id = %s", (second.ref_id,))
    data = encode_json([1, 2])
    assert (row["tier"], row["uri"], row["size_bytes"], row["sha256"], row["parent_ref_id"]) == (
        kind, second.uri, len(data), hashlib.sha256(data).hexdigest(), first.ref_id)
    assert (row["execution_id"], row["step"], row["command_id"], row["task"]) == (EXECUTION_ID, "s", "c-9", "t2")
    payloads = await one(pool, "SELECT count(*) AS n FROM noetl.result_payload WHERE ref_id = %s",
                         (second.ref_id,))
    assert payloads["n"] == (1 if kind == "db" else 0)
    if kind == "s3":
        assert await objects.get_object(f"it/{EXECUTION_ID}/{second.ref_id}.json") == data
    chain = await store.chain(second.ref_id)
    assert [r.ref_id for r in chain] == [second.ref_id, first.ref_id]
    with pytest.raises(NotFound):
        await store.chain(9_999_999_996)
    await objects.close()


async def test_failed_put_leaves_no_reference(pool: Pool, s3_server: Any) -> None:
    before = (await one(pool, "SELECT count(*) AS n FROM noetl.result_ref"))["n"]
    with pytest.raises(NotFound):
        await PostgresResultStore(pool).put({"x": 1}, execution_id=EXECUTION_ID, step="s", command_id="c",
                                            task="t", parent_ref_id=9_999_999_995)
    dead = S3Client(s3_config(s3_server, endpoint=DEAD_ENDPOINT, timeout=1.0))
    with pytest.raises(Unavailable):
        await S3ResultStore(pool, dead).put({"x": 1}, execution_id=EXECUTION_ID, step="s", command_id="c",
                                            task="t", parent_ref_id=None)
    await dead.close()
    assert (await one(pool, "SELECT count(*) AS n FROM noetl.result_ref"))["n"] == before


async def test_reference_without_payload_is_not_found(pool: Pool) -> None:
    row = await one(pool, "INSERT INTO noetl.result_ref (execution_id, tier, uri, size_bytes) "
                          "VALUES (%s, 'object_store', 's3://bucket/key', 1) RETURNING ref_id", (EXECUTION_ID,))
    ref_id = row["ref_id"]
    with pytest.raises(NotFound, match="object_store"):
        await PostgresResultStore(pool).get(ref_id)
    assert await PostgresResultStore(pool).get_many([ref_id]) == {}


async def test_s3_reference_needs_an_s3_endpoint_to_be_read(pool: Pool, s3_server: Any) -> None:
    objects = S3Client(s3_config(s3_server))
    ref = await S3ResultStore(pool, objects).put({"x": 1}, execution_id=EXECUTION_ID, step="s", command_id="c",
                                                 task="t", parent_ref_id=None)
    assert await PostgresResultStore(pool, objects=objects).get(ref.ref_id) == {"x": 1}  # any tier reads it
    with pytest.raises(Unavailable, match="no S3 endpoint is configured"):
        await PostgresResultStore(pool).get(ref.ref_id)
    await objects.close()


async def test_s3_object_changed_behind_the_reference_is_detected(pool: Pool, s3_server: Any) -> None:
    objects = S3Client(s3_config(s3_server))
    store = S3ResultStore(pool, objects, prefix="tamper/")
    ref = await store.put({"x": 1}, execution_id=EXECUTION_ID, step="s", command_id="c", task="t",
                          parent_ref_id=None)
    await objects.put_object(objects.key_of(ref.uri), b'{"x": 2}')
    with pytest.raises(NoetlError, match="sha256"):
        await store.get(ref.ref_id)
    await objects.close()


@pytest.mark.parametrize("kind", ["db", "s3"])
async def test_loop_reference_resolves_iterations_of_any_tier(kind: str, pool: Pool, s3_server: Any) -> None:
    """A loop reference (tier loop, written by the engine) reads its iteration results in
    index order, each from its own tier."""
    objects = S3Client(s3_config(s3_server))
    store = PostgresResultStore(pool, objects=objects) if kind == "db" else S3ResultStore(pool, objects)
    execution_id = EXECUTION_ID + (1 if kind == "db" else 2)
    instance = f"fan:{uuid.uuid4().hex[:6]}"
    refs = [await store.put({"i": i}, execution_id=execution_id, step="fan", command_id=f"c{i}", task="fan",
                            parent_ref_id=None) for i in range(3)]
    async with pool.connection() as conn:
        for idx, ref in zip([2, 0, 1], refs, strict=True):
            await conn.execute("INSERT INTO noetl.loop_result (execution_id, loop_instance, idx, status, ref_id)"
                               " VALUES (%s, %s, %s, 'ok', %s)", (execution_id, instance, idx, ref.ref_id))
        await conn.execute("INSERT INTO noetl.loop_result (execution_id, loop_instance, idx, status, ref_id)"
                           " VALUES (%s, %s, 3, 'error', NULL)", (execution_id, instance))
        stats = json.dumps({"stats": {"total": 4, "success": 3, "failed": 1}}).encode()
        cur = await conn.execute("INSERT INTO noetl.result_ref (execution_id, step, tier, uri, size_bytes)"
                                 " VALUES (%s, 'fan', 'loop', %s, %s) RETURNING ref_id",
                                 (execution_id, f"loop://{execution_id}/{instance}", len(stats)))
        loop_ref = (await cur.fetchone())["ref_id"]  # type: ignore[index]
        await conn.execute("INSERT INTO noetl.result_payload (ref_id, data) VALUES (%s, %s)", (loop_ref, stats))
        await conn.commit()
    assert await store.get(loop_ref) == {"results": [{"i": 1}, {"i": 2}, {"i": 0}, None],
                                         "stats": {"total": 4, "success": 3, "failed": 1}}
    # its size: the stats' and the iterations' results' encoded bytes
    (_, size), = (await store.get_many_sized([loop_ref])).values()
    assert size == len(stats) + sum(len(encode_json({"i": i})) for i in range(3))
    await objects.close()


# ---------------------------------------------------------------- the KV cache


def _count(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


async def test_kv_cache_serves_hits_and_a_purge_changes_nothing_but_latency(pool: Pool, nc: NATS) -> None:
    js = nc.jetstream()
    bucket = f"noetl_results_purge_{uuid.uuid4().hex[:6]}"
    store = KvCachedResultStore(PostgresResultStore(pool), js, bucket=bucket, max_value_bytes=1024)
    assert await store.create()
    ids = [await put(store, {"n": n}) for n in range(5)]
    big = await put(store, {"blob": "y" * 5000})
    expected = {i: {"n": n} for n, i in enumerate(ids)}
    assert await store.get_many(ids) == expected  # misses, now cached
    hits = _count(CACHE, "kv", "hit")
    resolved_kv = RESOLVE_SECONDS.labels("kv")._sum.get()
    assert await store.get_many(ids) == expected
    assert _count(CACHE, "kv", "hit") == hits + 5
    assert RESOLVE_SECONDS.labels("kv")._sum.get() > resolved_kv
    too_large = _count(CACHE, "kv", "too_large")
    assert await store.get(big) == {"blob": "y" * 5000}
    assert _count(CACHE, "kv", "too_large") == too_large + 1

    await js.purge_stream(f"KV_{bucket}")  # emptied: misses again, same values
    assert await store.get_many(ids) == expected
    assert await store.get(ids[0]) == {"n": 0}

    await js.delete_key_value(bucket)  # gone altogether: reads through, then re-creates the bucket
    assert await store.get_many(ids) == expected

    async def cached_again() -> bool:  # the store re-opens a failed bucket at most every 2 s
        assert await store.get_many(ids) == expected
        kv = await js.key_value(bucket)
        return bool((await kv.get(str(ids[1]))).value == encode_json({"n": 1}))

    await until(cached_again, timeout=10, what=f"bucket {bucket} re-created and caching again",
                ignoring=NatsNotFound)
    await js.delete_key_value(bucket)


async def test_kv_cache_over_a_dead_nats_reads_through(pool: Pool, nats_url: str) -> None:
    dead = NATS()
    await dead.connect(nats_url, allow_reconnect=False)
    js = dead.jetstream()
    await dead.close()
    store = KvCachedResultStore(PostgresResultStore(pool), js, bucket="noetl_results_dead", timeout_sec=0.5)
    ref_id = await put(store, {"k": 1})
    assert await store.get(ref_id) == {"k": 1}
    assert await store.get_many([ref_id]) == {ref_id: {"k": 1}}


# ---------------------------------------------------------------- the factory


async def test_factory_builds_the_configured_chain(pool: Pool, nc: NATS, s3_server: Any) -> None:
    s3 = {"s3_endpoint": s3_server.endpoint, "s3_bucket": S3_BUCKET, "s3_access_key": s3_server.access_key,
          "s3_secret_key": s3_server.secret_key}
    db = await make_result_store(ResultStoreSettings(), pool, None)
    assert isinstance(db, PostgresResultStore) and db.objects is None
    store = await make_result_store(ResultStoreSettings(tier="s3", cache="kv", kv_bucket="noetl_results_factory",
                                                        **s3), pool, nc.jetstream(), lru_items=8)
    assert isinstance(store, CachedResultStore)
    assert isinstance(store.inner, KvCachedResultStore) and isinstance(store.inner.inner, S3ResultStore)
    ref = await store.put({"f": 1}, execution_id=EXECUTION_ID, step="s", command_id="c", task="t",
                          parent_ref_id=None)
    assert ref.type == "s3" and await store.get(ref.ref_id) == {"f": 1}
    await store.close()
    await nc.jetstream().delete_key_value("noetl_results_factory")


async def test_factory_refuses_a_missing_bucket_or_wrong_keys(pool: Pool, s3_server: Any) -> None:
    from noetl_common.errors import ConfigError

    base = {"tier": "s3", "s3_endpoint": s3_server.endpoint, "s3_access_key": s3_server.access_key}
    with pytest.raises(ConfigError, match="NOETL_RESULT_S3_BUCKET: bucket 'no-such-bucket' does not exist"):
        await make_result_store(ResultStoreSettings(**base, s3_bucket="no-such-bucket",
                                                    s3_secret_key=s3_server.secret_key), pool)
    with pytest.raises(ConfigError, match="refused them"):
        await make_result_store(ResultStoreSettings(**base, s3_bucket=S3_BUCKET, s3_secret_key="wrong"), pool)
    # a server that is merely down is not a configuration error (results fail until it is back)
    store = await make_result_store(ResultStoreSettings(**{**base, "s3_endpoint": DEAD_ENDPOINT},
                                                        s3_bucket=S3_BUCKET, s3_secret_key="x",
                                                        s3_connect_timeout_sec=0.5), pool)
    await store.close()
    with pytest.raises(ConfigError, match="NOETL_RESULT_CACHE=kv needs NATS"):
        await make_result_store(ResultStoreSettings(cache="kv"), pool, None)


async def test_concurrent_db_puts_are_group_committed_and_isolate_a_bad_parent(pool: Pool) -> None:
    """Concurrent puts on the db tier go out as one multi-row statement; a bad parent in
    the batch fails only its own put."""
    store = PostgresResultStore(pool)
    parent = await put(store, {"root": True})
    good = [put(store, {"n": n}, parent=parent) for n in range(40)]
    bad = put(store, {"n": -1}, parent=9_999_999_996)
    results = await asyncio.gather(*good, bad, return_exceptions=True)
    ids, failure = results[:-1], results[-1]
    assert isinstance(failure, NotFound) and "9999999996" in str(failure)
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == 40
    assert await store.get_many(ids) == {i: {"n": n} for n, i in enumerate(ids)}  # type: ignore[misc]
    async with pool.connection() as conn:
        rows = await (await conn.execute(
            "SELECT count(*) AS n FROM noetl.result_ref r JOIN noetl.result_payload p USING (ref_id)"
            " WHERE r.ref_id = ANY(%s) AND r.parent_ref_id = %s", (list(ids), parent))).fetchone()
    assert rows is not None and rows["n"] == 40


# ---------------------------------------------------------------- the result size limit


@pytest.mark.parametrize("kind", ["db", "s3", "s3+kv+lru"])
async def test_a_value_past_the_size_limit_is_refused_and_nothing_is_written(
        kind: str, pool: Pool, nc: NATS, s3_server: Any) -> None:
    """``max_result_bytes`` (the worker's NOETL_LIMIT_RESULT_BYTES) bounds the encoded value
    exactly, in every tier and through the caches; a refused value is refused before the
    tier is touched (no reference, no payload row, no object) and counts as
    writes_total{outcome="too_large"}."""
    s3 = {"s3_endpoint": s3_server.endpoint, "s3_bucket": S3_BUCKET, "s3_access_key": s3_server.access_key,
          "s3_secret_key": s3_server.secret_key, "s3_prefix": f"limit-{uuid.uuid4().hex[:8]}/"}
    bucket = f"noetl_results_limit_{uuid.uuid4().hex[:8]}"
    settings = (ResultStoreSettings() if kind == "db" else
                ResultStoreSettings(tier="s3", cache="kv" if "kv" in kind else "none", kv_bucket=bucket, **s3))
    store = await make_result_store(settings, pool, nc.jetstream(), lru_items=8 if "lru" in kind else 0,
                                    max_result_bytes=4096)
    tier = "db" if kind == "db" else "s3"
    refs_before = (await one(pool, "SELECT count(*) AS n FROM noetl.result_ref"))["n"]
    payloads_before = (await one(pool, "SELECT count(*) AS n FROM noetl.result_payload"))["n"]
    refused_before = _count(WRITES, tier, "too_large")
    at_limit = {"blob": "é" * 2040}  # {"blob":""} is 11 bytes, each é 2: 4091
    assert len(encode_json(at_limit)) <= 4096 < len(encode_json({"blob": "é" * 2043}))
    ref = await store.put(at_limit, execution_id=EXECUTION_ID, step="s", command_id="c-limit", task="fits",
                          parent_ref_id=None)
    assert await store.get(ref.ref_id) == at_limit
    with pytest.raises(ResultTooLarge) as caught:
        await store.put({"blob": "é" * 2043}, execution_id=EXECUTION_ID, step="s", command_id="c-limit",
                        task="big", parent_ref_id=ref.ref_id)
    assert str(caught.value) == "result of task 'big' is 4097 bytes; limit NOETL_LIMIT_RESULT_BYTES=4096"
    assert (caught.value.size, caught.value.limit, caught.value.exact) == (4097, 4096, True)
    assert (await one(pool, "SELECT count(*) AS n FROM noetl.result_ref"))["n"] == refs_before + 1
    assert (await one(pool, "SELECT count(*) AS n FROM noetl.result_payload"))["n"] == (
        payloads_before + (1 if tier == "db" else 0))
    assert _count(WRITES, tier, "too_large") == refused_before + 1
    await store.close()
    if "kv" in kind:
        await nc.jetstream().delete_key_value(bucket)
