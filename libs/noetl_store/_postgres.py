"""The Postgres-indexed tiers: every reference is a ``noetl.result_ref`` row (tier, uri,
size, sha256, ``parent_ref_id``: the linked list); the payload lives where the tier says.

    tier  uri                                   payload
    db    pg://result_payload/{ref_id}          noetl.result_payload (same transaction)
    s3    s3://{bucket}/{prefix}{exec}/{ref}    the object store (``S3ResultStore``)
    loop  loop://{execution_id}/{instance}      noetl.loop_result: each iteration's own
                                                reference, resolved in index order

``PostgresResultStore`` writes tier ``db`` and reads every tier (an s3 reference needs
the object store, passed as ``objects``); ``S3ResultStore`` writes tier ``s3``. A ``db``
put is one statement (the ref row and its payload together); an ``s3`` put checks the
parent, draws the ref id, PUTs the object, then inserts the ref row: a reference never
exists without its payload (a failure in between leaves at most an unreferenced object).

Every public call is bounded by ``timeout_sec`` (``Unavailable`` past it). psycopg
errors are translated by ``noetl_common.db``, S3 errors by ``_s3``. A value whose encoded
JSON exceeds ``max_bytes`` (> 0) is refused with ``ResultTooLarge`` before anything is
written (``noetl_result_store_writes_total{outcome="too_large"}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from psycopg.rows import dict_row

from noetl_common.coalesce import Coalescer
from noetl_common.codec import decode_json
from noetl_common.db import Column, Conn, Pool, autocommit
from noetl_common.errors import NoetlError, NotFound, Unavailable

from ._metrics import WRITES, resolving
from ._s3 import S3Client
from ._store import Reference, ResultStore, ResultTooLarge, digest

logger = logging.getLogger(__name__)

TIER = "db"
S3_TIER = "s3"
LOOP_TIER = "loop"
URI_PREFIX = "pg://result_payload/"
DEFAULT_TIMEOUT_SEC = 30.0
# Concurrent object GETs of one read (a loop's iterations).
OBJECT_READ_CONCURRENCY = 16

_PUT = """
WITH new_id AS (
  SELECT nextval(pg_get_serial_sequence('noetl.result_ref', 'ref_id')) AS ref_id
), ref AS (
  INSERT INTO noetl.result_ref (ref_id, execution_id, step, command_id, task, tier, uri,
                                size_bytes, sha256, parent_ref_id)
  SELECT ref_id, %(execution_id)s, %(step)s, %(command_id)s, %(task)s, %(tier)s,
         %(prefix)s || ref_id, %(size)s, %(sha256)s, %(parent)s
  FROM new_id
  RETURNING ref_id, uri
)
INSERT INTO noetl.result_payload (ref_id, data)
SELECT ref_id, %(data)s FROM ref
RETURNING ref_id, (SELECT uri FROM ref) AS uri
"""

# An s3 put: the parent must exist (checked before the object is written), then a ref id.
_NEW_ID = """
SELECT nextval(pg_get_serial_sequence('noetl.result_ref', 'ref_id')) AS ref_id,
       (%(parent)s::bigint IS NULL OR EXISTS (SELECT 1 FROM noetl.result_ref WHERE ref_id = %(parent)s))
         AS parent_ok
"""

_INSERT_REF = """
INSERT INTO noetl.result_ref (ref_id, execution_id, step, command_id, task, tier, uri, size_bytes, sha256,
                              parent_ref_id)
VALUES (%(ref_id)s, %(execution_id)s, %(step)s, %(command_id)s, %(task)s, %(tier)s, %(uri)s, %(size)s,
        %(sha256)s, %(parent)s)
"""

_GET = """
SELECT r.ref_id, r.tier, r.uri, r.sha256, p.data
FROM noetl.result_ref r LEFT JOIN noetl.result_payload p ON p.ref_id = r.ref_id
WHERE r.ref_id = ANY(%(ids)s)
"""

# A finished loop: the references of its iteration results in index order.
_LOOP = """
SELECT lr.idx, lr.ref_id FROM noetl.loop_result lr
WHERE lr.execution_id = %(execution_id)s AND lr.loop_instance = %(instance)s
ORDER BY lr.idx
"""

_CHAIN = """
WITH RECURSIVE chain AS (
  SELECT ref_id, tier, uri, parent_ref_id, 1 AS depth FROM noetl.result_ref WHERE ref_id = %(ref_id)s
  UNION ALL
  SELECT r.ref_id, r.tier, r.uri, r.parent_ref_id, c.depth + 1
  FROM chain c
  CROSS JOIN LATERAL (SELECT ref_id, tier, uri, parent_ref_id FROM noetl.result_ref rr
                      WHERE rr.ref_id = c.parent_ref_id LIMIT 1) r
  WHERE c.depth < %(limit)s
)
SELECT ref_id, tier, uri FROM chain ORDER BY depth
"""


# Many results in one statement (group commit of concurrent puts): ids are drawn once
# per row in a CTE referenced twice (materialised), so ref and payload rows agree.
_PUT_MANY = """
WITH input AS (
  SELECT * FROM unnest(%(execution_ids)t::bigint[], %(steps)t::text[], %(command_ids)t::text[],
                       %(tasks)t::text[], %(sizes)t::bigint[], %(shas)t::text[], %(parents)t::bigint[],
                       %(datas)b::bytea[]) WITH ORDINALITY
       AS i(execution_id, step, command_id, task, size, sha256, parent, data, ord)
), ids AS MATERIALIZED (
  SELECT i.*, nextval(pg_get_serial_sequence('noetl.result_ref', 'ref_id')) AS ref_id FROM input i
), ref AS (
  INSERT INTO noetl.result_ref (ref_id, execution_id, step, command_id, task, tier, uri, size_bytes,
                                sha256, parent_ref_id)
  SELECT ref_id, execution_id, step, command_id, task, %(tier)s, %(prefix)s || ref_id, size, sha256, parent
  FROM ids RETURNING ref_id
), pay AS (
  INSERT INTO noetl.result_payload (ref_id, data) SELECT ref_id, data FROM ids
)
SELECT ids.ord, ids.ref_id FROM ids ORDER BY ids.ord
"""


@dataclass(frozen=True)
class _PutItem:
    data: bytes
    execution_id: int
    step: str
    command_id: str
    task: str
    parent_ref_id: int | None


class PostgresResultStore(ResultStore):
    """Writes tier ``db``; reads every tier. The pool is the caller's; ``objects`` is closed
    with the store when ``owns_objects``."""

    TIER = TIER

    def __init__(self, pool: Pool, *, objects: S3Client | None = None,
                 timeout_sec: float = DEFAULT_TIMEOUT_SEC, owns_objects: bool = False, max_bytes: int = 0) -> None:
        self.pool = pool
        self.objects = objects
        self.timeout_sec = timeout_sec
        self.owns_objects = owns_objects
        self.max_bytes = max_bytes
        self._writes: Coalescer[_PutItem, Reference] = Coalescer(self._put_many, max_batch=128)

    async def close(self) -> None:
        if self.objects is not None and self.owns_objects:
            await self.objects.close()

    @asynccontextmanager
    async def _deadline(self, what: str) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.timeout_sec):
                yield
        except TimeoutError as exc:
            raise Unavailable(f"result store: {what} did not finish within {self.timeout_sec:g}s") from exc

    # ------------------------------------------------------------ writes

    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        try:
            data = self.encode(value, task=task)
        except ResultTooLarge:
            WRITES.labels(self.TIER, "too_large").inc()
            raise
        start = time.perf_counter()
        try:
            async with self._deadline("storing a result"):
                ref = await self._put(data, execution_id=execution_id, step=step, command_id=command_id,
                                      task=task, parent_ref_id=parent_ref_id)
        except BaseException:
            WRITES.labels(self.TIER, "error").inc()
            raise
        WRITES.labels(self.TIER, "ok").inc()
        logger.debug("stored result ref_id=%s tier=%s bytes=%d in %.1f ms", ref.ref_id, ref.type, len(data),
                     (time.perf_counter() - start) * 1000, extra={"execution_id": execution_id})
        return ref

    async def _put(self, data: bytes, *, execution_id: int, step: str, command_id: str, task: str,
                   parent_ref_id: int | None) -> Reference:
        # Concurrent puts (a worker's slots) are written together: one statement, one commit.
        return await self._writes.submit(_PutItem(data, execution_id, step, command_id, task, parent_ref_id))

    async def _put_many(self, items: Sequence[_PutItem]) -> list[Reference | BaseException]:
        if len(items) == 1:
            return [await self._put_one(items[0])]
        params = {
            "execution_ids": Column(i.execution_id for i in items), "steps": Column(i.step for i in items),
            "command_ids": Column(i.command_id for i in items), "tasks": Column(i.task for i in items),
            "sizes": Column(len(i.data) for i in items), "shas": Column(digest(i.data) for i in items),
            "parents": Column(i.parent_ref_id for i in items), "datas": [i.data for i in items],  # bytea: binary
            "tier": TIER, "prefix": URI_PREFIX,
        }
        try:
            async with autocommit(self.pool) as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute(_PUT_MANY, params)
                rows = await cur.fetchall()
        except NotFound:  # a parent reference's foreign key: find which one, item by item
            return list(await asyncio.gather(*(self._put_one(i) for i in items), return_exceptions=True))
        refs = {int(r["ord"]): int(r["ref_id"]) for r in rows}
        return [Reference(refs[n], TIER, f"{URI_PREFIX}{refs[n]}", len(items[n - 1].data))
                for n in range(1, len(items) + 1)]

    async def _put_one(self, item: _PutItem) -> Reference:
        params = {
            "execution_id": item.execution_id, "step": item.step, "command_id": item.command_id,
            "task": item.task, "tier": TIER, "prefix": URI_PREFIX, "size": len(item.data),
            "sha256": digest(item.data), "parent": item.parent_ref_id, "data": item.data,
        }
        try:
            async with autocommit(self.pool) as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute(_PUT, params)
                row = await cur.fetchone()
        except NotFound as exc:  # the parent reference's foreign key
            raise NotFound(f"parent result reference {item.parent_ref_id} not found") from exc
        if row is None:  # pragma: no cover - INSERT ... RETURNING always returns a row
            raise NoetlError("result store: insert returned no row")
        return Reference(int(row["ref_id"]), TIER, str(row["uri"]), len(item.data))

    # ------------------------------------------------------------ reads

    async def get(self, ref_id: int) -> Any:
        async with self._deadline(f"reading result {ref_id}"):
            rows = await self._fetch([ref_id])
            if not rows:
                raise NotFound(f"result reference {ref_id} not found")
            values = await self._resolve(rows, strict=True)
        return values[ref_id][0]

    async def get_many(self, ref_ids: Iterable[int]) -> dict[int, Any]:
        """One query for many references; missing ones (and references whose payload is
        missing from their tier) are left out. A tier that cannot be reached raises."""
        return {i: value for i, (value, _) in (await self.get_many_sized(ref_ids)).items()}

    async def get_many_sized(self, ref_ids: Iterable[int]) -> dict[int, tuple[Any, int]]:
        """``get_many`` with each value's encoded size (a loop's: its stats' and its
        iterations' results'), as read."""
        ids = list(dict.fromkeys(int(i) for i in ref_ids))
        if not ids:
            return {}
        async with self._deadline(f"reading {len(ids)} result(s)"):
            found = await self._resolve(await self._fetch(ids), strict=False)
        return {i: found[i] for i in ids if i in found}

    async def _fetch(self, ids: list[int]) -> list[dict[str, Any]]:
        async with autocommit(self.pool) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_GET, {"ids": ids})
            return await cur.fetchall()

    async def _resolve(self, rows: list[dict[str, Any]], *, strict: bool) -> dict[int, tuple[Any, int]]:
        """Values of ``rows`` (``_GET`` rows) with their encoded sizes, by ref id.
        ``strict``: a missing payload raises NotFound; otherwise it is left out."""
        by_tier: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            by_tier.setdefault(str(row["tier"]), []).append(row)
        out: dict[int, tuple[Any, int]] = {}
        for tier, group in by_tier.items():
            values: dict[int, tuple[Any, int]]
            with resolving(tier):
                if tier == TIER:
                    values = self._db_values(group)
                elif tier == S3_TIER:
                    values = await self._object_values(group)
                elif tier == LOOP_TIER:
                    values = {int(r["ref_id"]): await self._loop_value(r) for r in group if r["data"] is not None}
                else:
                    values = {}
            missing = [int(r["ref_id"]) for r in group if int(r["ref_id"]) not in values]
            if missing and strict:
                raise NotFound(f"result reference {missing[0]} has no payload in tier {tier!r}")
            out.update(values)
        return out

    @staticmethod
    def _db_values(rows: list[dict[str, Any]]) -> dict[int, tuple[Any, int]]:
        return {int(r["ref_id"]): (decode_json(r["data"]), len(r["data"])) for r in rows if r["data"] is not None}

    async def _object_values(self, rows: list[dict[str, Any]]) -> dict[int, tuple[Any, int]]:
        if self.objects is None:
            raise Unavailable(f"result reference {rows[0]['ref_id']} is in the s3 tier, but no S3 endpoint is "
                              "configured (NOETL_RESULT_S3_ENDPOINT)")
        objects = self.objects
        gate = asyncio.Semaphore(OBJECT_READ_CONCURRENCY)

        async def one(row: dict[str, Any]) -> tuple[int, tuple[Any, int]] | None:
            ref_id = int(row["ref_id"])
            async with gate:
                try:
                    data = await objects.get_object(objects.key_of(str(row["uri"])))
                except NotFound:
                    return None
                except ValueError as exc:  # an object of another bucket
                    raise NoetlError(f"result reference {ref_id}: {exc}") from exc
            if row["sha256"] and digest(data) != row["sha256"]:
                raise NoetlError(f"result reference {ref_id}: the object at {row['uri']} does not match its "
                                 "recorded sha256 (changed or corrupted)")
            return ref_id, (decode_json(data), len(data))

        found = await asyncio.gather(*(one(r) for r in rows))
        return dict(item for item in found if item is not None)

    async def _loop_value(self, row: dict[str, Any]) -> tuple[Any, int]:
        """``{"results": [...in index order...], "stats": {...}}`` of a finished loop, and
        the encoded size of its stats and results."""
        stats = (decode_json(row["data"]) or {}).get("stats", {})
        execution_id, _, instance = str(row["uri"]).removeprefix("loop://").partition("/")
        async with autocommit(self.pool) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_LOOP, {"execution_id": int(execution_id), "instance": instance})
            items = await cur.fetchall()
        ids = [int(r["ref_id"]) for r in items if r["ref_id"] is not None]
        values = await self._resolve(await self._fetch(ids), strict=False) if ids else {}
        results = [values[int(r["ref_id"])][0] if r["ref_id"] is not None and int(r["ref_id"]) in values else None
                   for r in items]
        size = len(row["data"]) + sum(n for _, n in values.values())
        return {"results": results, "stats": stats}, size

    async def chain(self, ref_id: int, *, limit: int = 10_000) -> list[Reference]:
        """The reference and its ancestors (``parent_ref_id`` links), newest first."""
        async with self._deadline(f"reading the chain of {ref_id}"), autocommit(self.pool) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_CHAIN, {"ref_id": ref_id, "limit": limit})
            rows = await cur.fetchall()
        if not rows:
            raise NotFound(f"result reference {ref_id} not found")
        return [Reference(int(r["ref_id"]), str(r["tier"]), str(r["uri"])) for r in rows]


class S3ResultStore(PostgresResultStore):
    """Writes tier ``s3``: payloads as objects ``{prefix}{execution_id}/{ref_id}.json``,
    references in ``noetl.result_ref`` (no ``result_payload`` row). Reads every tier."""

    TIER = S3_TIER

    def __init__(self, pool: Pool, objects: S3Client, *, prefix: str = "noetl/results/",
                 timeout_sec: float = DEFAULT_TIMEOUT_SEC, owns_objects: bool = False, max_bytes: int = 0) -> None:
        super().__init__(pool, objects=objects, timeout_sec=timeout_sec, owns_objects=owns_objects,
                         max_bytes=max_bytes)
        self.s3 = objects
        self.prefix = prefix

    async def _put(self, data: bytes, *, execution_id: int, step: str, command_id: str, task: str,
                   parent_ref_id: int | None) -> Reference:
        async with autocommit(self.pool) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_NEW_ID, {"parent": parent_ref_id})
            row = await cur.fetchone()
        assert row is not None
        if not row["parent_ok"]:
            raise NotFound(f"parent result reference {parent_ref_id} not found")
        ref_id = int(row["ref_id"])
        key = f"{self.prefix}{execution_id}/{ref_id}.json"
        await self.s3.put_object(key, data)
        uri = self.s3.uri(key)
        params = {"ref_id": ref_id, "execution_id": execution_id, "step": step, "command_id": command_id,
                  "task": task, "tier": S3_TIER, "uri": uri, "size": len(data), "sha256": digest(data),
                  "parent": parent_ref_id}
        try:
            async with autocommit(self.pool) as conn:
                await conn.execute(_INSERT_REF, params)
        except NotFound as exc:
            raise NotFound(f"parent result reference {parent_ref_id} not found") from exc
        return Reference(ref_id, S3_TIER, uri, len(data))


async def loop_reference(conn: Conn, execution_id: int, step: str, uri: str,
                         stats: dict[str, Any]) -> int:
    """A result_ref row (tier ``loop``) for a finished loop: its payload is the stats; the
    result store reads the ordered iteration results from ``noetl.loop_result``."""
    data = json.dumps({"stats": stats}).encode()
    cur = await conn.execute(
        "INSERT INTO noetl.result_ref (execution_id, step, tier, uri, size_bytes) VALUES (%s, %s, %s, %s, %s)"
        " RETURNING ref_id", (execution_id, step, LOOP_TIER, uri, len(data)))
    row = await cur.fetchone()
    assert row is not None
    await conn.execute("INSERT INTO noetl.result_payload (ref_id, data) VALUES (%s, %s)", (row["ref_id"], data))
    return int(row["ref_id"])
