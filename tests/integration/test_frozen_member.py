"""A member frozen inside a fenced transaction (SIGSTOP, a VM pause, a long GC) holds its
lease row lock. The shard-manager leader must not stall behind it: it moves the member's
other shards at once, and the locked shard as soon as Postgres ends the frozen
transaction (members' sessions carry ``idle_in_transaction_session_timeout`` = the lease),
which also rolls back whatever the frozen member wrote."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from noetl_common.db import Pool, make_pool
from noetl_common.shards import fence_sql
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


async def test_leader_is_not_stalled_by_a_member_frozen_in_a_fenced_transaction(
        pg_dsn: str, pool: Pool, role: str) -> None:
    m = Membership(pool, shard_count=4, lease_sec=LEASE_SEC, roles=(role,))
    a = int((await m.join(role, f"{role}-a", "127.0.0.1:1", "127.0.0.1:2", 1))["runtime_id"])
    b = int((await m.join(role, f"{role}-b", "127.0.0.1:3", "127.0.0.1:4", 2))["runtime_id"])
    await m.rebalance()
    before = await leases(pool, role)
    mine = sorted(s for s, r in before.items() if r["owner_runtime_id"] == a)
    assert len(mine) == 2
    locked, free = mine

    # member a's own pool, made the way every role makes it, freezes mid-batch: fenced, not committed
    member = make_pool(pg_dsn, min_size=1, max_size=1, name="frozen-member", idle_tx_timeout_sec=LEASE_SEC)
    await member.open(wait=True, timeout=30)
    frozen = await member.getconn()
    try:
        cur = await frozen.execute(fence_sql(), (role, locked, a, before[locked]["epoch"]))
        assert await cur.fetchone() is not None
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
        # it did not sit behind the frozen lock until Postgres ended the transaction
        assert now[locked]["owner_runtime_id"] == a and took < 0.75 * LEASE_SEC, took

        # the locked shard moves once Postgres ends the frozen transaction (after ~ one lease)
        while True:
            async with pool.connection() as conn:
                await conn.execute("UPDATE noetl.runtime SET heartbeat_at = now() WHERE runtime_id = %s", (b,))
                await conn.commit()
            await asyncio.wait_for(m.rebalance(), timeout=3 * LEASE_SEC)
            now = await leases(pool, role)
            if now[locked]["owner_runtime_id"] == b:
                break
            assert time.monotonic() - started < 10 * LEASE_SEC, "the frozen transaction kept its lock"
            await asyncio.sleep(0.1)
        assert now[locked]["epoch"] > before[locked]["epoch"]
        # the frozen member wakes up: its transaction is gone, nothing it wrote survives
        with pytest.raises(psycopg.Error, match="idle-in-transaction timeout"):
            await frozen.execute("SELECT 1")
    finally:
        await member.putconn(frozen)
        await member.close()
