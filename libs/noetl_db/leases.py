"""Members, leadership and shard leases: ``noetl.runtime``, ``noetl.leader_lease``,
``noetl.shard_lease``. Every statement on them is here, including the one fence every
shard-scoped write transaction starts with (:func:`fence`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from noetl_common.errors import LeaseLost
from noetl_common.vocab import MemberStatus

from ._conn import GUARD, Column, Conn, Write, gated, one, rows

# ---------------------------------------------------------------- the fence

# The lease must be ours (owner and epoch) and not run out on the database's clock; the row
# stays locked to COMMIT, so a takeover (which bumps the epoch under the same row lock)
# waits for the batch, and every later write of the old owner finds zero rows. Written once
# with named parameters (for the statements of other modules that fence or check a lease
# inside themselves: ``fence_when``) and turned into positional ones for this module's.
OURS_NAMED = ("role = %(role)s AND shard_id = %(shard)s AND owner_runtime_id = %(owner)s AND epoch = %(epoch)s"
              " AND leased_until > clock_timestamp()")
_OURS = OURS_NAMED % {"role": "%s", "shard": "%s", "owner": "%s", "epoch": "%s"}
_FENCE = (
    "UPDATE noetl.shard_lease SET {sets}updated_at = now()"
    f" WHERE {_OURS}"
    " RETURNING event_seq, stream_seq, sweep_from, barrier_epoch, barrier_seq"
)
_FENCE_PLAIN = _FENCE.format(sets="")
_FENCE_ADVANCE = _FENCE.format(sets="stream_seq = GREATEST(stream_seq, %s), ")
_FENCE_RESET = _FENCE.format(sets="stream_seq = %s, ")


async def send_fence(conn: Conn, role: str, shard: int, owner: int, epoch: int, *,
                     stream_seq: int | None = None, reset: bool = False) -> Any:
    """Send the fence and return its cursor unread (in pipeline mode it travels with the
    statements queued after it); :func:`fenced` reads it. ``stream_seq`` (the engine's)
    records the NATS stream position, only forward unless ``reset`` (the stream lost
    messages it had acknowledged, or was recreated: its sequence went back)."""
    key = (role, shard, owner, epoch)
    if stream_seq is None:
        return await conn.execute(_FENCE_PLAIN, key)
    return await conn.execute(_FENCE_RESET if reset else _FENCE_ADVANCE, (stream_seq, *key))


async def fenced(cursor: Any, role: str, shard: int, epoch: int) -> dict[str, Any]:
    """The fenced lease row (its engine positions), or LeaseLost."""
    row = await cursor.fetchone()
    if row is None:
        raise LeaseLost(f"{role} lease for shard {shard} epoch {epoch} is no longer held")
    return dict(row)


async def fence(conn: Conn, role: str, shard: int, owner: int, epoch: int, *,
                stream_seq: int | None = None, reset: bool = False) -> dict[str, Any]:
    """Lock our lease row (serialising against a takeover) or raise LeaseLost."""
    cursor = await send_fence(conn, role, shard, owner, epoch, stream_seq=stream_seq, reset=reset)
    return await fenced(cursor, role, shard, epoch)


async def assert_lease(conn: Conn, role: str, shard: int, owner: int, epoch: int) -> None:
    """A batch's last statement before COMMIT: aborts the transaction (LeaseLost) when the
    lease ran out meanwhile (this process froze mid-batch), so nothing commits late."""
    await conn.execute("SELECT noetl.assert_lease(%s, %s, %s, %s)", (role, shard, owner, epoch))


class EnginePositions(NamedTuple):
    """What an engine batch leaves in its lease row (``finish_engine_batch``'s columns)."""

    event_seq: int
    sweep_from: int
    barrier_epoch: int
    barrier_seq: int


async def fenced_batch(conn: Conn, role: str, shard: int, owner: int, epoch: int, *, event_seq: int,
                       stream_seq: int, positions: EnginePositions, writes: Sequence[Write],
                       checks: Sequence[Write] = ()) -> bool:
    """An engine batch as ONE statement, committed on its own (``conn`` in autocommit): the
    fence (our lease, not run out, and its ``event_seq`` still the one this engine last
    committed, so the ``shard_seq`` it numbered its events from is right) records the stream
    position and the batch's ``positions``, and every write is a CTE whose rows pass only
    when the fence matched (``gated``). True when it did (everything written); False when
    it matched nothing (nothing written: the lease is lost, or the engine's idea of it is
    stale). ``checks`` are read-only gates the fence waits for (e.g. that the executions the
    batch starts have no state yet): a check that fails leaves the lease row as it was. The writes must not depend on each other (a CTE does not
    see another's rows): the engine composes only batches whose statements touch different
    rows (docs/ARCHITECTURE.md "The life of an execution", 2)."""
    fence = Write(
        "UPDATE noetl.shard_lease SET stream_seq = GREATEST(stream_seq, %s), event_seq = %s,"
        " sweep_from = GREATEST(sweep_from, %s), barrier_epoch = %s, barrier_seq = %s, updated_at = now()"
        f" WHERE {_OURS} AND event_seq = %s AND {GUARD} RETURNING 1",
        (stream_seq, *positions, role, shard, owner, epoch, event_seq))
    # the checks first: the fence updates the lease row, which must not move when a check fails
    return await gated(conn, [*checks, fence], writes)


def fence_when(condition: str) -> str:
    """The fence as the body of a data-modifying CTE of another module's statement (named
    parameters: ``OURS_NAMED``): our lease row locked to the statement's end, only when
    ``condition`` (SQL) holds; it returns a row when it did."""
    return f"UPDATE noetl.shard_lease SET updated_at = now() WHERE {OURS_NAMED} AND ({condition}) RETURNING 1"


def fence_write(role: str, shard: int, owner: int, epoch: int) -> Write:
    """The fence as a gate of a ``gated`` statement: the lease is ours and has not run out
    (the row stays locked to the statement's end, as ``fence``'s to COMMIT)."""
    return Write(f"UPDATE noetl.shard_lease SET updated_at = now() WHERE {_OURS} AND {GUARD} RETURNING 1",
                 (role, shard, owner, epoch))


async def finish_engine_batch(conn: Conn, role: str, shard: int, event_seq: int, sweep_from: int,
                              barrier_epoch: int, barrier_seq: int) -> None:
    """The engine's positions after a batch (the row is already locked by its fence)."""
    await conn.execute(
        "UPDATE noetl.shard_lease SET event_seq = %s, sweep_from = GREATEST(sweep_from, %s),"
        " barrier_epoch = %s, barrier_seq = %s WHERE role = %s AND shard_id = %s",
        (event_seq, sweep_from, barrier_epoch, barrier_seq, role, shard),
    )


# ---------------------------------------------------------------- a member's leases

async def renew(conn: Conn, role: str, runtime_id: int, lease_sec: float,
                terms: dict[int, int]) -> dict[int, int]:
    """Renew exactly the terms ``{shard: epoch}`` this member holds; the renewed ones back."""
    if not terms:
        return {}
    shards = list(terms)
    found = await rows(conn,
        "UPDATE noetl.shard_lease SET leased_until = now() + make_interval(secs => %s), updated_at = now()"
        " WHERE role = %s AND owner_runtime_id = %s"
        " AND (shard_id, epoch) IN (SELECT * FROM unnest(%t::int[], %t::bigint[]))"
        " RETURNING shard_id, epoch",
        (lease_sec, role, runtime_id, Column(shards), Column(terms[s] for s in shards)))
    return {r["shard_id"]: r["epoch"] for r in found}


async def assignments(conn: Conn, role: str, runtime_id: int) -> list[dict[str, Any]]:
    return await rows(conn,
        "SELECT shard_id, epoch, leased_until FROM noetl.shard_lease"
        " WHERE role = %s AND owner_runtime_id = %s ORDER BY shard_id", (role, runtime_id))


async def ensure_shards(conn: Conn, roles: Sequence[str], shard_count: int) -> None:
    # Only missing rows: ON CONFLICT alone would wait on a row a member's fence has locked.
    await conn.execute(
        "INSERT INTO noetl.shard_lease (role, shard_id) SELECT r, s FROM unnest(%s::text[]) r,"
        " generate_series(0, %s - 1) s WHERE NOT EXISTS (SELECT 1 FROM noetl.shard_lease l"
        " WHERE l.role = r AND l.shard_id = s) ON CONFLICT DO NOTHING",
        (list(roles), shard_count))


async def owners(conn: Conn, roles: Sequence[str], shard_count: int) -> list[dict[str, Any]]:
    return await rows(conn,
        "SELECT role, shard_id, owner_runtime_id FROM noetl.shard_lease WHERE role = ANY(%s)"
        " AND shard_id < %s", (list(roles), shard_count))


async def move(conn: Conn, role: str, shard: int, owner: int, lease_sec: float) -> None:
    """Give a shard to ``owner`` with a new epoch (the row lock waits for an in-flight
    fenced transaction of the old owner, whose every later write then fails its fence)."""
    await conn.execute(
        "UPDATE noetl.shard_lease SET owner_runtime_id = %s, epoch = epoch + 1,"
        " leased_until = now() + make_interval(secs => %s), updated_at = now()"
        " WHERE role = %s AND shard_id = %s",
        (owner, lease_sec, role, shard))


async def free_leases(conn: Conn, runtime_id: int) -> None:
    await conn.execute(
        "UPDATE noetl.shard_lease SET owner_runtime_id = NULL, leased_until = NULL, updated_at = now()"
        " WHERE owner_runtime_id = %s", (runtime_id,))


async def end_lease_holder(conn: Conn, role: str, shard: int) -> list[int]:
    """End the session(s) whose transaction holds the shard's lease row locked (the one
    whose id is the row's ``xmax``); the pids ended."""
    found = await rows(conn,
        "SELECT l.pid, pg_terminate_backend(l.pid) AS ended FROM noetl.shard_lease s"
        " JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted AND l.mode = 'ExclusiveLock'"
        " AND l.transactionid = s.xmax WHERE s.role = %s AND s.shard_id = %s AND s.xmax <> '0'::xid",
        (role, shard))
    return [r["pid"] for r in found if r["ended"]]


async def shards_of(conn: Conn, role: str) -> list[dict[str, Any]]:
    """Every shard lease of ``role`` ('' = every role) with its owner's instance."""
    return await rows(conn,
        "SELECT l.*, r.instance AS owner_instance FROM noetl.shard_lease l"
        " LEFT JOIN noetl.runtime r ON r.runtime_id = l.owner_runtime_id"
        " WHERE (l.role = %s OR %s = '') ORDER BY l.role, l.shard_id", (role, role))


# ---------------------------------------------------------------- members

JOIN_LOCK = 0x6E6F65746C + 7


async def join(conn: Conn, role: str, instance: str, address: str, metrics: str, pid: int, secret_sha256: str,
               pools: list[str] | None, labels: dict[str, str] | None, tools: list[str] | None) -> dict[str, Any]:
    """A new member row with the lowest free node id (serialised by JOIN_LOCK)."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s)", (JOIN_LOCK,))
    row = await one(conn,
        "INSERT INTO noetl.runtime (role, instance, address, metrics_address, pid, node_id,"
        " member_secret_sha256, pools, labels, tools)"
        " SELECT %s, %s, %s, %s, %s, min(n), %s, %s, %s::jsonb, %s FROM generate_series(0, 1022) n"
        f" WHERE n NOT IN (SELECT node_id FROM noetl.runtime WHERE status = '{MemberStatus.ALIVE}' AND node_id IS NOT NULL)"
        " RETURNING runtime_id, node_id",
        (role, instance, address, metrics, pid, secret_sha256, pools,
         json.dumps(labels) if labels is not None else None, tools))
    assert row is not None
    return row


async def heartbeat(conn: Conn, runtime_id: int, secret_sha256: str | None = None) -> bool:
    """Record a live member's heartbeat; with ``secret_sha256``, only the member holding
    that secret's. False when unknown or declared dead."""
    return await one(conn,
        f"UPDATE noetl.runtime SET heartbeat_at = now() WHERE runtime_id = %s AND status = '{MemberStatus.ALIVE}'"
        " AND (%s::text IS NULL OR member_secret_sha256 = %s) RETURNING runtime_id",
        (runtime_id, secret_sha256, secret_sha256)) is not None


async def leave(conn: Conn, runtime_id: int, secret_sha256: str | None = None) -> bool:
    return await one(conn,
        f"UPDATE noetl.runtime SET status = '{MemberStatus.LEFT}' WHERE runtime_id = %s"
        " AND (%s::text IS NULL OR member_secret_sha256 = %s) RETURNING runtime_id",
        (runtime_id, secret_sha256, secret_sha256)) is not None


async def declare_dead(conn: Conn, lease_sec: float) -> list[dict[str, Any]]:
    """Members silent for a lease are dead, never within a lease of the database's own
    start (a Postgres restart is everyone's missed heartbeat)."""
    return await rows(conn,
        f"UPDATE noetl.runtime SET status = '{MemberStatus.DEAD}' WHERE status = '{MemberStatus.ALIVE}'"
        " AND heartbeat_at < now() - make_interval(secs => %s)"
        " AND pg_postmaster_start_time() < now() - make_interval(secs => %s)"
        " RETURNING runtime_id, role, instance", (lease_sec, lease_sec))


async def live_members(conn: Conn, roles: Sequence[str]) -> list[dict[str, Any]]:
    return await rows(conn, f"SELECT runtime_id, role FROM noetl.runtime WHERE status = '{MemberStatus.ALIVE}' AND role = ANY(%s)",
                      (list(roles),))


async def members(conn: Conn, role: str) -> list[dict[str, Any]]:
    """Members of ``role`` ('' = every role), alive or seen in the last ten minutes."""
    return await rows(conn,
        f"SELECT *, status = '{MemberStatus.ALIVE}' AS alive FROM noetl.runtime WHERE (role = %s OR %s = '')"
        f" AND (status = '{MemberStatus.ALIVE}' OR heartbeat_at > now() - interval '10 minutes') ORDER BY role, runtime_id",
        (role, role))


# ---------------------------------------------------------------- leadership

async def try_lead(conn: Conn, name: str, runtime_id: int, instance: str, lease_sec: float) -> int | None:
    """Take or renew the leader lease ``name``; its epoch, or None if another holds it."""
    await conn.execute("INSERT INTO noetl.leader_lease (name) VALUES (%s) ON CONFLICT DO NOTHING", (name,))
    row = await one(conn,
        "UPDATE noetl.leader_lease SET"
        " epoch = CASE WHEN holder_runtime_id = %s THEN epoch ELSE epoch + 1 END,"
        " holder_runtime_id = %s, holder_instance = %s,"
        " leased_until = now() + make_interval(secs => %s)"
        " WHERE name = %s AND (holder_runtime_id = %s OR holder_runtime_id IS NULL OR leased_until < now())"
        " RETURNING epoch",
        (runtime_id, runtime_id, instance, lease_sec, name, runtime_id))
    return None if row is None else int(row["epoch"])


async def resign(conn: Conn, name: str, runtime_id: int) -> None:
    await conn.execute("UPDATE noetl.leader_lease SET leased_until = now() WHERE name = %s AND holder_runtime_id = %s",
                       (name, runtime_id))


async def leader(conn: Conn, name: str) -> dict[str, Any] | None:
    return await one(conn, "SELECT * FROM noetl.leader_lease WHERE name = %s", (name,))


async def held_positions(conn: Conn, role: str, shard: int, owner: int, epoch: int) -> dict[str, Any] | None:
    """The stream and event positions of a lease held by ``owner`` at ``epoch`` (None: not ours)."""
    return await one(conn,
        "SELECT stream_seq, event_seq FROM noetl.shard_lease WHERE role = %s AND shard_id = %s"
        " AND owner_runtime_id = %s AND epoch = %s", (role, shard, owner, epoch))


async def sweep_from(conn: Conn, role: str, shard: int) -> int:
    """Where the engine's sweep of unstarted submissions starts (execution ids below it are done)."""
    row = await one(conn, "SELECT sweep_from FROM noetl.shard_lease WHERE role = %s AND shard_id = %s", (role, shard))
    return int(row["sweep_from"]) if row else 0


async def assign(conn: Conn, role: str, shard: int, owner: int, epoch: int) -> None:
    """Hand a shard to ``owner`` at ``epoch`` outright, without a lease deadline (benchmarks
    driving one role's code without a shard-manager)."""
    await conn.execute(
        # a century ahead, not 'infinity': Python's datetime cannot hold that (a reader of
        # every lease, such as the shard-manager's Describe, would fail on the row)
        "INSERT INTO noetl.shard_lease (role, shard_id, owner_runtime_id, epoch, leased_until)"
        " VALUES (%s, %s, %s, %s, now() + interval '100 years') ON CONFLICT (role, shard_id) DO UPDATE SET"
        " owner_runtime_id = EXCLUDED.owner_runtime_id, epoch = EXCLUDED.epoch, leased_until = EXCLUDED.leased_until",
        (role, shard, owner, epoch))
