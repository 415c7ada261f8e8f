"""A member frozen inside a fenced transaction (SIGSTOP, a VM pause, a long GC) holds its
lease row lock. The shard-manager leader must not stall behind it: once the member is
declared dead, the leader ends the session holding the row (whatever state it is in:
idle in a transaction, or waiting on the client inside a pipeline, where no idle timeout
applies) and moves the shard at once, which also rolls back whatever the frozen member
wrote. A live member's lock is never broken: the leader waits for it next tick."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from waiting import until

from noetl_common.db import Pool, make_pool
from noetl_db import leases as lease_db
from noetl_shard_manager.membership import Membership

pytestmark = pytest.mark.integration

LEASE_SEC = 2.0  # the leader waits a quarter of it for a row lock


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[Pool]:
    p = make_pool(pg_dsn, min_size=1, max_size=4, name="test-frozen-leader")
    await p.open(wait=True, timeout=30)
    yield p
    await p.close()


@pytest.fixture
async def role(pool: Pool) -> AsyncIterator[str]:
    name = f"t-frozen-{uuid.uuid4().hex[:10]}"
    yield name
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM noetl.shard_lease WHERE role = %s", (name,))
        await conn.execute("DELETE FROM noetl.runtime WHERE role = %s", (name,))
        await conn.commit()


async def leases(pool: Pool, role: str) -> dict[int, dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT shard_id, owner_runtime_id, epoch FROM noetl.shard_lease WHERE role = %s",
                                 (role,))
        rows = await cur.fetchall()
        await conn.commit()
    return {r["shard_id"]: r for r in rows}


async def settled(pool: Pool) -> None:
    """Nobody is declared dead within a lease of the database's start (a restart is
    everyone's missed heartbeat): wait until the test server is older than that."""
    async def age() -> float | None:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT extract(epoch FROM now() - pg_postmaster_start_time()) AS age")
            row = await cur.fetchone()
            await conn.commit()
        return None if row is None else float(row["age"])

    async def old_enough() -> bool:
        seen = await age()
        assert seen is not None and seen > LEASE_SEC, f"postgres is {seen} s old"
        return True

    await until(old_enough, timeout=60, what=f"postgres older than {LEASE_SEC} s", interval=0.1,
                ignoring=AssertionError)


async def test_leader_is_not_stalled_by_a_member_frozen_in_a_fenced_transaction(
        pg_dsn: str, pool: Pool, role: str) -> None:
    await settled(pool)
    m = Membership(pool, shard_count=4, lease_sec=LEASE_SEC, roles=(role,))
    a = int((await m.join(role, f"{role}-a", "127.0.0.1:1", "127.0.0.1:2", 1))["runtime_id"])
    b = int((await m.join(role, f"{role}-b", "127.0.0.1:3", "127.0.0.1:4", 2))["runtime_id"])
    await m.rebalance()
    before = await leases(pool, role)
    mine = sorted(s for s, r in before.items() if r["owner_runtime_id"] == a)
    assert len(mine) == 2
    locked, free = mine

    # member a's own pool, made the way every role makes it, freezes mid-batch: fenced, not
    # committed. Its idle timeout is far away: only the leader can free the row in time.
    member = make_pool(pg_dsn, min_size=1, max_size=1, name="frozen-member", idle_tx_timeout_sec=60)
    await member.open(wait=True, timeout=30)
    frozen = await member.getconn()
    try:
        await lease_db.fence(frozen, role, locked, a, before[locked]["epoch"])
        async with pool.connection() as conn:  # a stops heartbeating; b is alive
            await conn.execute("UPDATE noetl.runtime SET heartbeat_at = now() - interval '1 hour'"
                               " WHERE runtime_id = %s", (a,))
            await conn.execute("UPDATE noetl.runtime SET heartbeat_at = now() WHERE runtime_id = %s", (b,))
            await conn.commit()

        started = time.monotonic()
        await asyncio.wait_for(m.rebalance(), timeout=3 * LEASE_SEC)
        took = time.monotonic() - started
        now = await leases(pool, role)
        assert now[free]["owner_runtime_id"] == b and now[free]["epoch"] > before[free]["epoch"], (
            "the leader did not move the frozen member's unlocked shard")
        # the locked one moved in the same round: the frozen session was ended, not waited for
        assert now[locked]["owner_runtime_id"] == b and now[locked]["epoch"] > before[locked]["epoch"], now
        assert took < 3 * LEASE_SEC, took
        # the frozen member wakes up: its transaction is gone, nothing it wrote survives
        with pytest.raises(psycopg.Error, match=r"terminating connection|server closed the connection|consuming input failed"):
            await frozen.execute("SELECT 1")
    finally:
        await member.putconn(frozen)
        await member.close()


async def test_a_live_members_lock_is_waited_for_not_broken(pg_dsn: str, pool: Pool, role: str) -> None:
    """A member that holds its lease row while alive (a slow batch) keeps its session: the
    leader moves its shard only after the batch ends."""
    m = Membership(pool, shard_count=2, lease_sec=LEASE_SEC, roles=(role,))
    a = int((await m.join(role, f"{role}-a", "127.0.0.1:1", "127.0.0.1:2", 1))["runtime_id"])
    await m.rebalance()
    before = await leases(pool, role)
    b = int((await m.join(role, f"{role}-b", "127.0.0.1:3", "127.0.0.1:4", 2))["runtime_id"])
    member = make_pool(pg_dsn, min_size=1, max_size=1, name="busy-member", idle_tx_timeout_sec=60)
    await member.open(wait=True, timeout=30)
    busy = await member.getconn()
    try:
        for shard in (0, 1):  # whichever the leader wants to move is locked by a's batch
            await lease_db.fence(busy, role, shard, a, before[shard]["epoch"])
        await asyncio.wait_for(m.rebalance(), timeout=3 * LEASE_SEC)
        await busy.execute("SELECT 1")  # a is alive: its session was not ended
        await busy.commit()
        assert all(r["owner_runtime_id"] == a for r in (await leases(pool, role)).values()), "moved under a lock"
        await asyncio.wait_for(m.rebalance(), timeout=3 * LEASE_SEC)  # the batch ended: now it moves
        owners = [r["owner_runtime_id"] for r in (await leases(pool, role)).values()]
        assert sorted(owners) == sorted([a, b]), owners
    finally:
        await member.putconn(busy)
        await member.close()
