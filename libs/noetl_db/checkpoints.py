"""Seals and manifests: ``noetl.checkpoint`` (the checkpointer seals a shard's log up to
a barrier the projector has passed) and ``noetl.manifest`` / ``noetl.manifest_part``
(the compactor's summary of an execution whose events it deletes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from noetl_store import TRACE_COLUMNS
from noetl_store._lineage import (
    MAX_CHAIN_DEPTH,  # the trace's own bound: a manifest's chain equals GetTrace's
)

from . import leases
from ._conn import Column, Conn, rows

# A shard's engine positions (events, last barrier) beside its projection and latest seal;
# ``{where}``: which lease rows of the engine (``seal_states``, ``_SEAL_ROUND``).
_SEAL_STATE = (
    "SELECT e.shard_id, e.event_seq, e.barrier_epoch, e.barrier_seq, now() AS now,"
    " COALESCE(p.last_shard_seq, 0) AS projected_seq,"
    " COALESCE(c.epoch, 0) AS sealed_epoch, COALESCE(c.last_shard_seq, 0) AS sealed_seq, c.sealed_at"
    " FROM noetl.shard_lease e"
    " LEFT JOIN noetl.projection_checkpoint p ON p.shard_id = e.shard_id"
    " LEFT JOIN LATERAL (SELECT epoch, last_shard_seq, sealed_at FROM noetl.checkpoint"
    "   WHERE shard_id = e.shard_id ORDER BY epoch DESC LIMIT 1) c ON true"
    " WHERE {where}")


async def seal_states(conn: Conn, engine_role: str, shards: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The seal state of each of ``shards`` that has an engine lease row, by shard (its
    engine positions beside its projection and latest seal): one read for every shard a
    checkpointer holds (its idle shards then skip their round)."""
    if not shards:
        return {}
    found = await rows(conn, _SEAL_STATE.format(where="e.role = %s AND e.shard_id = ANY(%t::int[])"),
                       (engine_role, Column(shards)))
    return {int(r.pop("shard_id")): r for r in found}


# One checkpointer round of a shard as ONE statement (autocommit): the shard's seal state;
# when the projection has passed an unsealed barrier, the fence (our lease row, locked to
# the statement's end) and the seal, which happen only together; whether the lease is
# ours; and the oldest event the seals (the new one included) do not cover. All CTEs read
# one snapshot: a barrier the projection had passed in it is passed for good (both only
# advance).
_SEAL_ROUND = """
WITH s AS (
  {state}
), sealable AS (
  SELECT * FROM s WHERE barrier_epoch > sealed_epoch AND projected_seq >= barrier_seq
), f AS (
  {fence}
), ins AS (
  INSERT INTO noetl.checkpoint (shard_id, epoch, last_shard_seq)
  SELECT shard_id, barrier_epoch, barrier_seq FROM sealable WHERE EXISTS (SELECT 1 FROM f)
  ON CONFLICT DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM f) AS sealed_now, EXISTS (SELECT 1 FROM sealable) AS sealable,
       EXISTS (SELECT 1 FROM noetl.shard_lease WHERE {ours}) AS ours,
       s.*,
       (SELECT created_at FROM noetl.event WHERE shard_id = %(shard)s
          AND shard_seq > CASE WHEN EXISTS (SELECT 1 FROM f) THEN s.barrier_seq ELSE s.sealed_seq END
        ORDER BY shard_seq LIMIT 1) AS oldest_at
FROM (SELECT 1) AS one LEFT JOIN s ON true
""".format(state=_SEAL_STATE.format(where="e.role = %(engine)s AND e.shard_id = %(shard)s"),
           fence=leases.fence_when("EXISTS (SELECT 1 FROM sealable)"), ours=leases.OURS_NAMED)


async def seal_round(conn: Conn, engine_role: str, role: str, shard: int, owner: int,
                     epoch: int) -> dict[str, Any]:
    """One round of a shard's checkpointer in one statement (``_SEAL_ROUND``): the shard's
    seal state (``seal_states``' columns; None when the engine never held the shard),
    ``sealable`` (an unsealed barrier the projection passed), ``sealed_now`` (fenced and
    sealed by this statement), ``ours`` (the lease is this member's at ``epoch``; a
    sealable round that is not fenced is a lease lost) and ``oldest_at`` (``created_at`` of
    the oldest event past the seals, this one's included)."""
    found = await rows(conn, _SEAL_ROUND, {"engine": engine_role, "role": role, "shard": shard,
                                           "owner": owner, "epoch": epoch})
    return found[0]


MANIFEST = """
INSERT INTO noetl.manifest (execution_id, shard_id, status, playbook_path, playbook_version, step_count,
                            ref_count, event_count, event_types, first_event_id, last_event_id, last_shard_seq,
                            started_at, ended_at, compactor_epoch)
SELECT x.execution_id, x.shard_id, x.status, x.playbook_path, x.playbook_version,
       (SELECT count(*) FROM noetl.execution_step s WHERE s.execution_id = x.execution_id),
       (SELECT count(*) FROM noetl.result_ref r WHERE r.execution_id = x.execution_id),
       st.event_count, st.event_types, st.first_event_id, st.last_event_id, st.last_shard_seq,
       x.started_at, x.ended_at, %(epoch)s
FROM jsonb_to_recordset(%(stats)s::jsonb) AS st(execution_id bigint, event_count bigint, event_types jsonb,
                                                 first_event_id bigint, last_event_id bigint, last_shard_seq bigint)
JOIN noetl.execution x ON x.execution_id = st.execution_id
ON CONFLICT (execution_id) DO UPDATE SET
  event_count = noetl.manifest.event_count + EXCLUDED.event_count,
  event_types = (SELECT jsonb_object_agg(k, COALESCE((noetl.manifest.event_types ->> k)::bigint, 0)
                                            + COALESCE((EXCLUDED.event_types ->> k)::bigint, 0))
                 FROM jsonb_object_keys(noetl.manifest.event_types || EXCLUDED.event_types) AS k),
  last_event_id = GREATEST(noetl.manifest.last_event_id, EXCLUDED.last_event_id),
  last_shard_seq = GREATEST(noetl.manifest.last_shard_seq, EXCLUDED.last_shard_seq)
RETURNING execution_id, (xmax = 0) AS created
"""


_ENTRY = ", ".join(f"'{c}', rr.{c}" for c in TRACE_COLUMNS)


# The chain walks result_ref by primary key (LATERAL ... LIMIT 1 keeps the planner from
# hashing the whole table), and the batch's events are read once (``ev``).
PARTS = f"""
WITH RECURSIVE chain AS (
  SELECT s.execution_id AS x_id, s.step AS x_step, r.parent_ref_id, r.entry, 1 AS depth
  FROM noetl.execution_step s
  CROSS JOIN LATERAL (SELECT rr.parent_ref_id, jsonb_build_object({_ENTRY}) AS entry
                      FROM noetl.result_ref rr WHERE rr.ref_id = s.result_ref_id LIMIT 1) r
  WHERE s.execution_id = ANY(%(ids)s)
  UNION ALL
  SELECT c.x_id, c.x_step, r.parent_ref_id, r.entry, c.depth + 1
  FROM chain c
  CROSS JOIN LATERAL (SELECT rr.parent_ref_id, jsonb_build_object({_ENTRY}) AS entry
                      FROM noetl.result_ref rr WHERE rr.ref_id = c.parent_ref_id LIMIT 1) r
  WHERE c.depth < {MAX_CHAIN_DEPTH}
), chains AS (
  SELECT x_id, x_step, count(*) AS depth, jsonb_agg(entry ORDER BY depth) AS chain FROM chain GROUP BY x_id, x_step
), ev AS MATERIALIZED (
  SELECT execution_id, step, event_type, event_id, result, (meta ? 'index') AS iteration
  FROM noetl.event WHERE execution_id = ANY(%(ids)s) AND step IS NOT NULL
), finals AS (
  SELECT DISTINCT ON (execution_id, step) execution_id, step, event_type, result
  FROM ev WHERE event_type = ANY(%(result_events)s) AND NOT iteration
  ORDER BY execution_id, step, event_id DESC
), counts AS (
  SELECT execution_id, step, count(*) AS n FROM ev GROUP BY execution_id, step
)
INSERT INTO noetl.manifest_part (execution_id, step, status, visits, event_type, envelope, terminal_ref_id,
                                 chain_depth, chain, event_count)
SELECT s.execution_id, s.step, s.status, s.visits, f.event_type, f.result, s.result_ref_id,
       COALESCE(c.depth, 0), COALESCE(c.chain, '[]'::jsonb), COALESCE(n.n, 0)
FROM noetl.execution_step s
LEFT JOIN chains c ON c.x_id = s.execution_id AND c.x_step = s.step
LEFT JOIN finals f ON f.execution_id = s.execution_id AND f.step = s.step
LEFT JOIN counts n ON n.execution_id = s.execution_id AND n.step = s.step
WHERE s.execution_id = ANY(%(ids)s)
RETURNING execution_id, terminal_ref_id, chain_depth
"""


# The execution's terminal reference: the newest step result (ref ids only grow).
TERMINAL_REF = """
UPDATE noetl.manifest m SET terminal_ref_id = t.ref_id, chain_depth = t.depth
FROM unnest(%(ids)s::bigint[], %(refs)s::bigint[], %(depths)s::int[]) AS t(execution_id, ref_id, depth)
WHERE m.execution_id = t.execution_id
"""
