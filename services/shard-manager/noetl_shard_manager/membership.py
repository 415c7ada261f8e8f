"""Membership and assignment in Postgres (any replica serves Join/Heartbeat/Leave/
Describe; only the leader rebalances). See ``libs/noetl_common/shards.py`` for the
member side of the leases."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import psycopg
from prometheus_client import Counter

from noetl_common.auth import token_sha256
from noetl_common.db import Pool, transaction
from noetl_common.errors import NoetlError

from .balance import assign

logger = logging.getLogger(__name__)

ENDED_SESSIONS = Counter("noetl_shard_manager_ended_sessions_total",
                         "Postgres sessions of dead members ended because they held a lease row (frozen mid-batch)")

SHARDED_ROLES = ("api", "projector", "checkpointer", "compactor", "reaper")
LEADER_KEY = "shard-manager"
JOIN_LOCK = 0x6E6F65746C + 7


class Membership:
    def __init__(self, pool: Pool, *, shard_count: int, lease_sec: float,
                 roles: Sequence[str] = SHARDED_ROLES) -> None:
        self._pool = pool
        self.shard_count = shard_count
        self.lease_sec = lease_sec
        self.roles = tuple(roles)  # the sharded roles this leader assigns

    async def join(self, role: str, instance: str, address: str, metrics: str, pid: int,
                   placement: tuple[list[str], dict[str, str], list[str] | None] | None = None) -> dict[str, Any]:
        """A new membership; the row carries ``member_secret`` (returned once, its hash kept):
        Heartbeat and Leave of the runtime id must present it. ``placement``: a worker's
        pools, labels and tool kinds (None: every kind)."""
        pools, labels, tools = placement or (None, None, None)
        secret = secrets.token_urlsafe(24)
        async with transaction(self._pool) as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (JOIN_LOCK,))
            cur = await conn.execute(
                "INSERT INTO noetl.runtime (role, instance, address, metrics_address, pid, node_id,"
                " member_secret_sha256, pools, labels, tools)"
                " SELECT %s, %s, %s, %s, %s, min(n), %s, %s, %s::jsonb, %s FROM generate_series(0, 1022) n"
                " WHERE n NOT IN (SELECT node_id FROM noetl.runtime WHERE status = 'alive' AND node_id IS NOT NULL)"
                " RETURNING runtime_id, node_id",
                (role, instance, address, metrics, pid, token_sha256(secret), pools,
                 json.dumps(labels) if labels is not None else None, tools),
            )
            row = await cur.fetchone()
        assert row is not None
        logger.info("joined %s %s runtime_id=%s node_id=%s", role, instance, row["runtime_id"], row["node_id"])
        return {**row, "member_secret": secret}

    async def heartbeat(self, runtime_id: int, member_secret: str | None = None) -> bool:
        """Record liveness; False when the member is unknown, was declared dead, or (with
        ``member_secret``) the secret is not that membership's."""
        async with transaction(self._pool) as conn:
            cur = await conn.execute(
                "UPDATE noetl.runtime SET heartbeat_at = now() WHERE runtime_id = %s AND status = 'alive'"
                " AND (%s::text IS NULL OR member_secret_sha256 = %s) RETURNING runtime_id",
                (runtime_id, member_secret, token_sha256(member_secret or "")))
            return await cur.fetchone() is not None

    async def assignments(self, role: str, runtime_id: int) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT shard_id, epoch, leased_until FROM noetl.shard_lease"
                " WHERE role = %s AND owner_runtime_id = %s ORDER BY shard_id", (role, runtime_id))
            return list(await cur.fetchall())

    async def leave(self, runtime_id: int, member_secret: str | None = None) -> bool:
        """End a membership (its shards are freed); with ``member_secret``, only when it is
        that membership's. Returns whether it left."""
        async with transaction(self._pool) as conn:
            cur = await conn.execute(
                "UPDATE noetl.runtime SET status = 'left' WHERE runtime_id = %s"
                " AND (%s::text IS NULL OR member_secret_sha256 = %s) RETURNING runtime_id",
                (runtime_id, member_secret, token_sha256(member_secret or "")))
            if await cur.fetchone() is None:
                return False
            await conn.execute(
                "UPDATE noetl.shard_lease SET owner_runtime_id = NULL, leased_until = NULL, updated_at = now()"
                " WHERE owner_runtime_id = %s", (runtime_id,))
        return True

    async def describe(self, role: str) -> dict[str, Any]:
        async with self._pool.connection() as conn:
            cur = await conn.execute("SELECT * FROM noetl.leader_lease WHERE name = %s", (LEADER_KEY,))
            leader = await cur.fetchone()
            cur = await conn.execute(
                "SELECT *, status = 'alive' AS alive FROM noetl.runtime WHERE (role = %s OR %s = '')"
                " AND (status = 'alive' OR heartbeat_at > now() - interval '10 minutes') ORDER BY role, runtime_id",
                (role, role))
            members = list(await cur.fetchall())
            cur = await conn.execute(
                "SELECT l.*, r.instance AS owner_instance FROM noetl.shard_lease l"
                " LEFT JOIN noetl.runtime r ON r.runtime_id = l.owner_runtime_id"
                " WHERE (l.role = %s OR %s = '') ORDER BY l.role, l.shard_id", (role, role))
            shards = list(await cur.fetchall())
        return {"leader": leader, "members": members, "shards": shards}

    # ------------------------------------------------------------ leader work

    async def try_lead(self, runtime_id: int, instance: str) -> int | None:
        """Take or renew the leader lease; returns the leader epoch, or None if another leads."""
        async with transaction(self._pool) as conn:
            await conn.execute("INSERT INTO noetl.leader_lease (name) VALUES (%s) ON CONFLICT DO NOTHING",
                               (LEADER_KEY,))
            cur = await conn.execute(
                "UPDATE noetl.leader_lease SET"
                " epoch = CASE WHEN holder_runtime_id = %s THEN epoch ELSE epoch + 1 END,"
                " holder_runtime_id = %s, holder_instance = %s,"
                " leased_until = now() + make_interval(secs => %s)"
                " WHERE name = %s AND (holder_runtime_id = %s OR holder_runtime_id IS NULL OR leased_until < now())"
                " RETURNING epoch",
                (runtime_id, runtime_id, instance, self.lease_sec, LEADER_KEY, runtime_id))
            row = await cur.fetchone()
        return None if row is None else int(row["epoch"])

    async def resign(self, runtime_id: int) -> None:
        async with transaction(self._pool) as conn:
            await conn.execute(
                "UPDATE noetl.leader_lease SET leased_until = now() WHERE name = %s AND holder_runtime_id = %s",
                (LEADER_KEY, runtime_id))

    async def rebalance(self, *, declare_dead: bool = True) -> int:
        """Declare stale members dead (unless ``declare_dead`` is False: the leader just
        came back from an outage during which nobody could heartbeat) and move shards to
        live members; returns moves made. A member is never declared dead within a lease
        of the database's own start (a Postgres restart is everyone's missed heartbeat)."""
        moves = 0
        async with transaction(self._pool) as conn:
            await self._bounded_lock_wait(conn)
            if declare_dead:
                cur = await conn.execute(
                    "UPDATE noetl.runtime SET status = 'dead' WHERE status = 'alive'"
                    " AND heartbeat_at < now() - make_interval(secs => %s)"
                    " AND pg_postmaster_start_time() < now() - make_interval(secs => %s)"
                    " RETURNING runtime_id, role, instance",
                    (self.lease_sec, self.lease_sec))
                for r in await cur.fetchall():
                    logger.warning("member %s (%s, runtime %s) missed its lease: declared dead",
                                   r["instance"], r["role"], r["runtime_id"])
            # Only missing rows: ON CONFLICT alone would wait on a row a member's fence has locked.
            await conn.execute(
                "INSERT INTO noetl.shard_lease (role, shard_id) SELECT r, s FROM unnest(%s::text[]) r,"
                " generate_series(0, %s - 1) s WHERE NOT EXISTS (SELECT 1 FROM noetl.shard_lease l"
                " WHERE l.role = r AND l.shard_id = s) ON CONFLICT DO NOTHING",
                (list(self.roles), self.shard_count))
            cur = await conn.execute(
                "SELECT runtime_id, role FROM noetl.runtime WHERE status = 'alive' AND role = ANY(%s)",
                (list(self.roles),))
            live: dict[str, list[int]] = {r: [] for r in self.roles}
            for r in await cur.fetchall():
                live[r["role"]].append(r["runtime_id"])
            cur = await conn.execute(
                "SELECT role, shard_id, owner_runtime_id FROM noetl.shard_lease WHERE role = ANY(%s)"
                " AND shard_id < %s", (list(self.roles), self.shard_count))
            current: dict[str, dict[int, int | None]] = {r: {} for r in self.roles}
            for r in await cur.fetchall():
                current[r["role"]][r["shard_id"]] = r["owner_runtime_id"]
        for role in self.roles:
            if not live[role]:
                continue
            target = assign(self.shard_count, live[role], current[role])
            changed = [(s, o) for s, o in target.items() if current[role].get(s) != o]
            moved = 0
            for shard, owner in changed:
                # A transaction that holds the lease row longer than the bounded wait: if its
                # member was declared dead (it froze mid-batch), its session is ended and the
                # move retried at once; a live owner's is waited for next tick (the other
                # shards move now).
                old_owner = current[role].get(shard)
                try:
                    await self._move(role, shard, owner)
                except NoetlError as exc:
                    if not isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
                        raise
                    if old_owner is None or old_owner in live[role] or not await self._end_stalled_holder(role, shard):
                        logger.warning("%s shard %s is locked by a transaction of its owner; retrying next tick",
                                       role, shard)
                        continue
                    try:
                        await self._move(role, shard, owner)
                    except NoetlError as again:
                        if not isinstance(again.__cause__, psycopg.errors.LockNotAvailable):
                            raise
                        logger.warning("%s shard %s still locked after ending its stalled holder; retrying next"
                                       " tick", role, shard)
                        continue
                moved += 1
            moves += moved
            if moved:
                logger.info("rebalanced %s: %s shard(s) moved over %s member(s)", role, moved, len(live[role]))
        return moves

    async def _move(self, role: str, shard: int, owner: int) -> None:
        # Row lock: waits for an in-flight fenced transaction of the old owner, then bumps
        # the epoch so every later write of the old owner fails its fence.
        async with transaction(self._pool) as conn:
            await self._bounded_lock_wait(conn)
            await conn.execute(
                "UPDATE noetl.shard_lease SET owner_runtime_id = %s, epoch = epoch + 1,"
                " leased_until = now() + make_interval(secs => %s), updated_at = now()"
                " WHERE role = %s AND shard_id = %s",
                (owner, self.lease_sec, role, shard))

    async def _end_stalled_holder(self, role: str, shard: int) -> bool:
        """The lease row of a shard whose owner was declared dead is locked by a
        transaction of that owner (it froze inside its fenced batch: SIGSTOP, a VM pause;
        a session waiting on the client inside a pipeline is not "idle in transaction",
        so no timeout ends it). End that session: the transaction holding the row lock is
        the one whose id is the row's ``xmax``. Returns True when one was ended."""
        async with transaction(self._pool) as conn:
            cur = await conn.execute(
                "SELECT l.pid, pg_terminate_backend(l.pid) AS ended FROM noetl.shard_lease s"
                " JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted AND l.mode = 'ExclusiveLock'"
                " AND l.transactionid = s.xmax WHERE s.role = %s AND s.shard_id = %s AND s.xmax <> '0'::xid",
                (role, shard))
            rows = list(await cur.fetchall())
        ended = [r["pid"] for r in rows if r["ended"]]
        if ended:
            ENDED_SESSIONS.inc(len(ended))
            logger.warning("%s shard %s: ended the stalled session(s) %s of its dead owner holding the lease row",
                           role, shard, ended)
            # the backend exits asynchronously: give it a moment to release the lock
            await asyncio.sleep(0.05)
        return bool(ended)

    async def _bounded_lock_wait(self, conn: Any) -> None:
        """Wait at most a quarter lease (1 s at most) for a row lock in this transaction."""
        wait_ms = int(max(0.05, min(1.0, self.lease_sec / 4)) * 1000)
        await conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{wait_ms}ms",))
