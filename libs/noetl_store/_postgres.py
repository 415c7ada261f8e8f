"""The Postgres tier ("db"): ``noetl.result_ref`` rows (the linked list of references)
with payloads in ``noetl.result_payload``.

A ``put`` is one statement in one transaction: it draws the ref id from the identity
sequence, inserts the reference (``uri = pg://result_payload/{ref_id}``) and the
payload together, so a reference never exists without its payload. psycopg errors are
translated by ``noetl_common.db``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from psycopg.rows import dict_row

from noetl_common.db import Pool, transaction
from noetl_common.errors import NoetlError, NotFound

from ._codec import decode_json, encode_json
from ._store import Reference, ResultStore, digest

logger = logging.getLogger(__name__)

TIER = "db"
URI_PREFIX = "pg://result_payload/"

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

_GET = """
SELECT r.ref_id, r.tier, r.uri, p.data
FROM noetl.result_ref r LEFT JOIN noetl.result_payload p ON p.ref_id = r.ref_id
WHERE r.ref_id = ANY(%(ids)s)
"""

# A finished loop (tier "loop", uri loop://{execution_id}/{instance}): its iteration
# results in index order, each resolved from its own reference.
_LOOP = """
SELECT lr.idx, lr.status, p.data
FROM noetl.loop_result lr LEFT JOIN noetl.result_payload p ON p.ref_id = lr.ref_id
WHERE lr.execution_id = %(execution_id)s AND lr.loop_instance = %(instance)s
ORDER BY lr.idx
"""

_CHAIN = """
WITH RECURSIVE chain AS (
  SELECT ref_id, tier, uri, parent_ref_id, 1 AS depth FROM noetl.result_ref WHERE ref_id = %(ref_id)s
  UNION ALL
  SELECT r.ref_id, r.tier, r.uri, r.parent_ref_id, c.depth + 1
  FROM noetl.result_ref r JOIN chain c ON r.ref_id = c.parent_ref_id
  WHERE c.depth < %(limit)s
)
SELECT ref_id, tier, uri FROM chain ORDER BY depth
"""


class PostgresResultStore(ResultStore):
    """Result store on the runtime database. The pool is the caller's (not closed here)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        data = encode_json(value)
        params = {
            "execution_id": execution_id, "step": step, "command_id": command_id, "task": task,
            "tier": TIER, "prefix": URI_PREFIX, "size": len(data), "sha256": digest(data),
            "parent": parent_ref_id, "data": data,
        }
        start = time.perf_counter()
        try:
            async with transaction(self.pool) as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute(_PUT, params)
                row = await cur.fetchone()
        except NotFound as exc:  # the parent reference's foreign key
            raise NotFound(f"parent result reference {parent_ref_id} not found") from exc
        if row is None:  # pragma: no cover - INSERT ... RETURNING always returns a row
            raise NoetlError("result store: insert returned no row")
        logger.debug("stored result ref_id=%s bytes=%d in %.1f ms", row["ref_id"], len(data),
                     (time.perf_counter() - start) * 1000, extra={"execution_id": execution_id})
        return Reference(int(row["ref_id"]), TIER, str(row["uri"]))

    async def get(self, ref_id: int) -> Any:
        rows = await self._fetch([ref_id])
        if not rows:
            raise NotFound(f"result reference {ref_id} not found")
        row = rows[0]
        if row["data"] is None:
            raise NotFound(f"result reference {ref_id} has no payload in tier {row['tier']!r}")
        return await self._value(row)

    async def get_many(self, ref_ids: Iterable[int]) -> dict[int, Any]:
        """One query for many references; missing ones (and references whose payload is
        in another tier) are left out."""
        ids = list(dict.fromkeys(int(i) for i in ref_ids))
        if not ids:
            return {}
        found = {int(r["ref_id"]): await self._value(r) for r in await self._fetch(ids) if r["data"] is not None}
        return {i: found[i] for i in ids if i in found}

    async def _value(self, row: dict[str, Any]) -> Any:
        value = decode_json(row["data"])
        if row["tier"] != "loop":
            return value
        execution_id, _, instance = str(row["uri"]).removeprefix("loop://").partition("/")
        async with transaction(self.pool) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_LOOP, {"execution_id": int(execution_id), "instance": instance})
            items = await cur.fetchall()
        results = [decode_json(r["data"]) if r["data"] is not None else None for r in items]
        return {"results": results, "stats": (value or {}).get("stats", {})}

    async def _fetch(self, ids: list[int]) -> list[dict[str, Any]]:
        async with transaction(self.pool) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_GET, {"ids": ids})
            return await cur.fetchall()

    async def chain(self, ref_id: int, *, limit: int = 10_000) -> list[Reference]:
        """The reference and its ancestors (``parent_ref_id`` links), newest first."""
        async with transaction(self.pool) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(_CHAIN, {"ref_id": ref_id, "limit": limit})
            rows = await cur.fetchall()
        if not rows:
            raise NotFound(f"result reference {ref_id} not found")
        return [Reference(int(r["ref_id"]), str(r["tier"]), str(r["uri"])) for r in rows]
