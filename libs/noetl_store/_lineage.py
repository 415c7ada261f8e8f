"""Lineage: a reference and its ancestors through ``noetl.result_ref.parent_ref_id``.

One recursive CTE (seed 004 section 5), newest first, with the columns ``GetTrace``
returns. The compactor copies the same entries into ``noetl.manifest_part.chain``
(``entry_json``), so a trace read from a manifest equals the one read live.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

MAX_CHAIN_DEPTH = 10_000

TRACE_COLUMNS = ("ref_id", "parent_ref_id", "tier", "uri", "size_bytes", "task", "command_id", "step", "sha256",
                 "created_at")

# Each step is a primary-key lookup (LATERAL ... LIMIT 1: never a scan of the table).
TRACE_SQL = f"""
WITH RECURSIVE chain AS (
  SELECT r.*, 1 AS depth FROM noetl.result_ref r WHERE r.ref_id = %(ref_id)s
  UNION ALL
  SELECT r.*, c.depth + 1 FROM chain c
  CROSS JOIN LATERAL (SELECT * FROM noetl.result_ref rr WHERE rr.ref_id = c.parent_ref_id LIMIT 1) r
  WHERE c.depth < {MAX_CHAIN_DEPTH}
)
SELECT {", ".join(TRACE_COLUMNS)}, depth FROM chain ORDER BY depth
"""


def entry_json(row: dict[str, Any]) -> dict[str, Any]:
    """A chain entry as stored in a manifest (timestamps as ISO 8601 text)."""
    out = {k: row.get(k) for k in TRACE_COLUMNS}
    if isinstance(out["created_at"], datetime):
        out["created_at"] = out["created_at"].isoformat()
    return out


def entry_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``entry_json`` (``created_at`` back to a datetime)."""
    out = {k: data.get(k) for k in TRACE_COLUMNS}
    if isinstance(out["created_at"], str):
        out["created_at"] = datetime.fromisoformat(out["created_at"])
    return out


async def trace(conn: Any, ref_id: int) -> list[dict[str, Any]]:
    """The chain of ``ref_id`` (``TRACE_COLUMNS`` + ``depth``), newest first; [] when the
    reference does not exist. ``conn`` is an open psycopg async connection with dict rows."""
    cur = await conn.execute(TRACE_SQL, {"ref_id": ref_id})
    return [dict(r) for r in await cur.fetchall()]
