"""Membership and assignment in Postgres (any replica serves Join/Heartbeat/Leave/
Describe; only the leader rebalances). See ``libs/noetl_common/shards.py`` for the
member side of the leases."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import psycopg
from prometheus_client import Counter

from noetl_common.auth import token_sha256
from noetl_common.db import Pool, transaction
from noetl_common.errors import NoetlError
from noetl_db import leases

from .balance import assign

logger = logging.getLogger(__name__)

ENDED_SESSIONS = Counter("noetl_shard_manager_ended_sessions_total",
                         "Postgres sessions of dead members ended because they held a lease row (frozen mid-batch)")

SHARDED_ROLES = ("api", "projector", "checkpointer", "compactor", "reaper")
LEADER_KEY = "shard-manager"


def _sha256(secret: str | None) -> str | None:
    return None if secret is None else token_sha256(secret)


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
            row = await leases.join(conn, role, instance, address, metrics, pid, token_sha256(secret), pools, labels,
                                    tools)
        logger.info("joined %s %s runtime_id=%s node_id=%s", role, instance, row["runtime_id"], row["node_id"])
        return {**row, "member_secret": secret}

    async def heartbeat(self, runtime_id: int, member_secret: str | None = None) -> bool:
        """Record liveness; False when the member is unknown, was declared dead, or (with
        ``member_secret``) the secret is not that membership's."""
        async with transaction(self._pool) as conn:
            return await leases.heartbeat(conn, runtime_id, _sha256(member_secret))

    async def assignments(self, role: str, runtime_id: int) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn:
            return await leases.assignments(conn, role, runtime_id)

    async def leave(self, runtime_id: int, member_secret: str | None = None) -> bool:
        """End a membership (its shards are freed); with ``member_secret``, only when it is
        that membership's. Returns whether it left."""
        async with transaction(self._pool) as conn:
            if not await leases.leave(conn, runtime_id, _sha256(member_secret)):
                return False
            await leases.free_leases(conn, runtime_id)
        return True

    async def describe(self, role: str) -> dict[str, Any]:
        async with self._pool.connection() as conn:
            return {"leader": await leases.leader(conn, LEADER_KEY), "members": await leases.members(conn, role),
                    "shards": await leases.shards_of(conn, role)}

    # ------------------------------------------------------------ leader work

    async def try_lead(self, runtime_id: int, instance: str) -> int | None:
        """Take or renew the leader lease; returns the leader epoch, or None if another leads."""
        async with transaction(self._pool) as conn:
            return await leases.try_lead(conn, LEADER_KEY, runtime_id, instance, self.lease_sec)

    async def resign(self, runtime_id: int) -> None:
        async with transaction(self._pool) as conn:
            await leases.resign(conn, LEADER_KEY, runtime_id)

    async def rebalance(self, *, declare_dead: bool = True) -> int:
        """Declare stale members dead (unless ``declare_dead`` is False: the leader just
        came back from an outage during which nobody could heartbeat) and move shards to
        live members; returns moves made. A member is never declared dead within a lease
        of the database's own start (a Postgres restart is everyone's missed heartbeat)."""
        moves = 0
        async with transaction(self._pool) as conn:
            await self._bounded_lock_wait(conn)
            if declare_dead:
                for r in await leases.declare_dead(conn, self.lease_sec):
                    logger.warning("member %s (%s, runtime %s) missed its lease: declared dead",
                                   r["instance"], r["role"], r["runtime_id"])
            await leases.ensure_shards(conn, self.roles, self.shard_count)
            live: dict[str, list[int]] = {r: [] for r in self.roles}
            for r in await leases.live_members(conn, self.roles):
                live[r["role"]].append(r["runtime_id"])
            current: dict[str, dict[int, int | None]] = {r: {} for r in self.roles}
            for r in await leases.owners(conn, self.roles, self.shard_count):
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
            await leases.move(conn, role, shard, owner, self.lease_sec)

    async def _end_stalled_holder(self, role: str, shard: int) -> bool:
        """The lease row of a shard whose owner was declared dead is locked by a
        transaction of that owner (it froze inside its fenced batch: SIGSTOP, a VM pause;
        a session waiting on the client inside a pipeline is not "idle in transaction",
        so no timeout ends it). End that session: the transaction holding the row lock is
        the one whose id is the row's ``xmax``. Returns True when one was ended."""
        async with transaction(self._pool) as conn:
            ended = await leases.end_lease_holder(conn, role, shard)
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
