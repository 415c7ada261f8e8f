"""The shard-manager against real Postgres: membership and node ids (through the real
gRPC servicer, in process), the leader lease, balanced rebalancing with epochs, and the
member side of the leases (``ShardOwnership``) with its fence.

Every test works on roles of its own (``Membership(roles=...)``) and deletes the runtime
and lease rows it made, so tests sharing the session database do not see each other."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from waiting import until

from noetl_common.config import ShardSettings
from noetl_common.db import Pool
from noetl_common.errors import LeaseLost
from noetl_common.grpcutil import ErrorInterceptor
from noetl_common.shards import ShardOwnership
from noetl_db import leases as lease_db
from noetl_proto.v1 import shard_manager_pb2 as pb
from noetl_proto.v1 import shard_manager_pb2_grpc
from noetl_shard_manager.balance import assign
from noetl_shard_manager.membership import Membership
from noetl_shard_manager.servicer import ShardManagerServicer

pytestmark = pytest.mark.integration


def new_role(tag: str) -> str:
    return f"t-{tag}-{uuid.uuid4().hex[:10]}"


class Rows:
    """What a test created: runtime ids and roles, removed at teardown."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.runtime_ids: list[int] = []
        self.roles: list[str] = []

    def role(self, tag: str) -> str:
        self.roles.append(new_role(tag))
        return self.roles[-1]

    async def join(self, m: Membership, role: str, n: int = 1) -> list[int]:
        ids = []
        for i in range(n):
            row = await m.join(role, f"{role}-{len(self.runtime_ids)}-{i}", "127.0.0.1:1", "127.0.0.1:2", 4242)
            ids.append(int(row["runtime_id"]))
        self.runtime_ids.extend(ids)
        return ids

    async def cleanup(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("DELETE FROM noetl.shard_lease WHERE role = ANY(%s)", (self.roles,))
            await conn.execute("DELETE FROM noetl.runtime WHERE runtime_id = ANY(%s) OR role = ANY(%s)",
                               (self.runtime_ids, self.roles))
            await conn.commit()


@pytest.fixture
async def rows(pool: Pool) -> AsyncIterator[Rows]:
    r = Rows(pool)
    yield r
    await r.cleanup()


async def fetch(pool: Pool, sql: str, params: Any = ()) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        out = await cur.fetchall()
        await conn.commit()
    return out


async def leases(pool: Pool, role: str) -> dict[int, tuple[int | None, int]]:
    """shard -> (owner runtime id, epoch)."""
    found = await fetch(pool, "SELECT shard_id, owner_runtime_id, epoch FROM noetl.shard_lease WHERE role = %s",
                        (role,))
    return {r["shard_id"]: (r["owner_runtime_id"], r["epoch"]) for r in found}


def loads(state: dict[int, tuple[int | None, int]]) -> dict[int | None, int]:
    out: dict[int | None, int] = {}
    for owner, _ in state.values():
        out[owner] = out.get(owner, 0) + 1
    return out


# ---------------------------------------------------------------- the gRPC servicer


class Server:
    def __init__(self, stub: shard_manager_pb2_grpc.ShardManagerServiceStub, membership: Membership,
                 role: str, changed: asyncio.Event) -> None:
        self.stub, self.membership, self.role, self.changed = stub, membership, role, changed


@pytest.fixture
async def server(pool: Pool, rows: Rows) -> AsyncIterator[Server]:
    role = rows.role("grpc")
    cfg = ShardSettings(count=8, heartbeat_sec=1.0, lease_sec=30.0)
    membership = Membership(pool, shard_count=cfg.count, lease_sec=cfg.lease_sec, roles=(role,))
    changed = asyncio.Event()
    srv = grpc.aio.server(interceptors=[ErrorInterceptor()])
    shard_manager_pb2_grpc.add_ShardManagerServiceServicer_to_server(
        ShardManagerServicer(membership, cfg, on_change=changed.set), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Server(shard_manager_pb2_grpc.ShardManagerServiceStub(channel), membership, role, changed)
    finally:
        await channel.close()
        await srv.stop(0)


async def grpc_join(server: Server, rows: Rows, instance: str) -> pb.JoinResponse:
    resp: pb.JoinResponse = await server.stub.Join(
        pb.JoinRequest(role=server.role, instance=instance, address="127.0.0.1:1", pid=1), timeout=10)
    rows.runtime_ids.append(resp.runtime_id)
    return resp


async def test_join_allocates_distinct_node_ids(server: Server, rows: Rows, pool: Pool) -> None:
    joined = await asyncio.gather(*(grpc_join(server, rows, f"member-{i}") for i in range(12)))
    assert server.changed.is_set()
    assert len({j.runtime_id for j in joined}) == 12
    nodes = [j.node_id for j in joined]
    assert len(set(nodes)) == 12 and all(0 <= n <= 1023 for n in nodes)
    assert {(j.shard_count, j.heartbeat_seconds, j.lease_seconds) for j in joined} == {(8, 1.0, 30.0)}
    alive = await fetch(pool, "SELECT node_id FROM noetl.runtime WHERE status = 'alive'")
    assert len(alive) == len({r["node_id"] for r in alive})  # unique among every live member

    # a member that left frees its node id; a new member never shares a live one
    # a Leave must carry the membership's secret: without it nobody is evicted
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.stub.Leave(pb.LeaveRequest(runtime_id=joined[0].runtime_id, member_secret="guess"), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    await server.stub.Leave(pb.LeaveRequest(runtime_id=joined[0].runtime_id, member_secret=joined[0].member_secret),
                            timeout=10)
    again = await grpc_join(server, rows, "member-again")
    assert again.node_id not in nodes[1:]


async def test_join_without_role_is_invalid(server: Server) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await server.stub.Join(pb.JoinRequest(instance="x"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_heartbeat_describe_leave(server: Server, rows: Rows) -> None:
    a = await grpc_join(server, rows, "a")
    b = await grpc_join(server, rows, "b")
    assert not a.assignments  # nothing assigned before the leader rebalances
    assert await server.membership.rebalance() == 8

    beats = [await server.stub.Heartbeat(pb.HeartbeatRequest(runtime_id=m.runtime_id, role=server.role,
                                                             member_secret=m.member_secret), timeout=10)
             for m in (a, b)]
    # another membership's heartbeat without its secret does not keep it alive
    assert (await server.stub.Heartbeat(pb.HeartbeatRequest(runtime_id=a.runtime_id, role=server.role),
                                        timeout=10)).rejoin
    held = [{x.shard_id: x.epoch for x in h.assignments} for h in beats]
    assert sorted([*held[0], *held[1]]) == list(range(8)) and len(held[0]) == len(held[1]) == 4
    assert all(x.epoch == 1 and x.HasField("leased_until") for h in beats for x in h.assignments)

    described = await server.stub.Describe(pb.DescribeRequest(role=server.role), timeout=10)
    assert {(m.runtime_id, m.alive) for m in described.members} == {(a.runtime_id, True), (b.runtime_id, True)}
    assert {s.shard_id: s.owner_runtime_id for s in described.shards} == {
        **dict.fromkeys(held[0], a.runtime_id), **dict.fromkeys(held[1], b.runtime_id)}
    assert {s.owner_instance for s in described.shards} == {"a", "b"}

    server.changed.clear()
    await server.stub.Leave(pb.LeaveRequest(runtime_id=a.runtime_id, member_secret=a.member_secret), timeout=10)
    assert server.changed.is_set()
    gone = await server.stub.Heartbeat(pb.HeartbeatRequest(runtime_id=a.runtime_id, role=server.role,
                                                           member_secret=a.member_secret), timeout=10)
    assert gone.rejoin
    described = await server.stub.Describe(pb.DescribeRequest(role=server.role), timeout=10)
    assert {m.runtime_id: m.alive for m in described.members} == {a.runtime_id: False, b.runtime_id: True}
    assert {s.shard_id for s in described.shards if s.owner_runtime_id == 0} == set(held[0])

    assert await server.membership.rebalance() == 4
    after = await server.stub.Heartbeat(pb.HeartbeatRequest(runtime_id=b.runtime_id, role=server.role,
                                                            member_secret=b.member_secret), timeout=10)
    assert {x.shard_id: x.epoch for x in after.assignments} == {**dict.fromkeys(held[0], 2),
                                                               **dict.fromkeys(held[1], 1)}


# ---------------------------------------------------------------- the leader lease


async def test_one_leader_and_takeover_after_the_lease(pool: Pool, rows: Rows) -> None:
    role = rows.role("sm")
    first = Membership(pool, shard_count=4, lease_sec=1.0, roles=())
    second = Membership(pool, shard_count=4, lease_sec=1.0, roles=())
    a, b = await rows.join(first, role, 2)
    loop = asyncio.get_running_loop()
    try:
        # a leader left over by an earlier test may hold the lease for up to its term
        epoch_a = await until(lambda: first.try_lead(a, "a"), timeout=40, what="member a leading")
        renewed_at = loop.time()
        assert await second.try_lead(b, "b") is None
        assert await first.try_lead(a, "a") == epoch_a  # renewing keeps the term
        renewed_at = loop.time()
        assert await second.try_lead(b, "b") is None

        # the leader stops renewing: the standby takes over once the lease ran out, not before
        epoch_b = await until(lambda: second.try_lead(b, "b"), timeout=10, what="member b taking the lead over")
        assert epoch_b == epoch_a + 1
        assert loop.time() - renewed_at >= 0.9
        assert await first.try_lead(a, "a") is None
        holder = await fetch(pool, "SELECT holder_runtime_id, epoch FROM noetl.leader_lease WHERE name = 'shard-manager'")
        assert holder == [{"holder_runtime_id": b, "epoch": epoch_b}]

        # resigning hands over at once
        await second.resign(b)
        assert await first.try_lead(a, "a") == epoch_b + 1
    finally:
        await first.resign(a)
        await second.resign(b)


# ---------------------------------------------------------------- rebalancing


async def wait_postmaster_older_than(pool: Pool, seconds: float) -> None:
    rows = await fetch(pool, "SELECT extract(epoch FROM now() - pg_postmaster_start_time()) AS age")
    age = float(rows[0]["age"])
    if age < seconds:  # a sleep, not a wait: the server's age is the condition, this is what is left of it
        await asyncio.sleep(seconds - age)


async def test_rebalance_assigns_every_shard_evenly_and_moves_the_minimum(pool: Pool, rows: Rows) -> None:
    role, other = rows.role("rb"), rows.role("rb2")
    m = Membership(pool, shard_count=12, lease_sec=30.0, roles=(role, other))
    members = await rows.join(m, role, 3)
    others = await rows.join(m, other, 2)

    assert await m.rebalance() == 24
    first = await leases(pool, role)
    assert sorted(first) == list(range(12))
    assert loads(first) == dict.fromkeys(members, 4)
    assert {e for _, e in first.values()} == {1}
    second_role = await leases(pool, other)
    assert loads(second_role) == dict.fromkeys(others, 6)  # each role only to its own members

    # nothing changed: nothing moves, no epoch bumps
    assert await m.rebalance() == 0
    assert await leases(pool, role) == first

    # a member joins: 4/4/4 -> 3/3/3/3, one shard from each, only those change epoch
    (newcomer,) = await rows.join(m, role, 1)
    assert await m.rebalance() == 3
    joined = await leases(pool, role)
    moved = {s for s in joined if joined[s][0] != first[s][0]}
    assert loads(joined) == dict.fromkeys([*members, newcomer], 3)
    assert {joined[s][0] for s in moved} == {newcomer} and len(moved) == 3
    assert all(joined[s][1] == (2 if s in moved else 1) for s in joined)

    # a member leaves: exactly its shards move
    leaving = members[0]
    theirs = {s for s, (o, _) in joined.items() if o == leaving}
    await m.leave(leaving)
    assert await m.rebalance() == len(theirs) == 3
    left = await leases(pool, role)
    assert {s for s in left if left[s][0] != joined[s][0]} == theirs
    assert loads(left) == dict.fromkeys([members[1], members[2], newcomer], 4)
    assert all(left[s][1] == joined[s][1] + (1 if s in theirs else 0) for s in left)

    # a member stops heartbeating: declared dead, its shards move, it is told to rejoin
    stale = members[1]
    async with pool.connection() as conn:
        await conn.execute("UPDATE noetl.runtime SET heartbeat_at = now() - interval '1 hour' WHERE runtime_id = %s",
                           (stale,))
        await conn.commit()
    theirs = {s for s, (o, _) in left.items() if o == stale}
    # nobody is declared dead within a lease of Postgres's own start (a restart is everyone's
    # missed heartbeat); this server is younger than 30 s, so a leader with a 2 s lease judges
    await wait_postmaster_older_than(pool, 2.0)
    m = Membership(pool, shard_count=12, lease_sec=2.0, roles=(role, other))
    for alive in (members[2], newcomer, *others):
        assert await m.heartbeat(alive)
    assert await m.rebalance() == len(theirs) == 4
    dead = await leases(pool, role)
    assert {s for s in dead if dead[s][0] != left[s][0]} == theirs
    assert loads(dead) == dict.fromkeys([members[2], newcomer], 6)
    assert (await fetch(pool, "SELECT status FROM noetl.runtime WHERE runtime_id = %s", (stale,)))[0]["status"] == "dead"
    assert await m.heartbeat(stale) is False
    assert await m.heartbeat(newcomer) is True
    assert await leases(pool, other) == second_role  # the other role was never touched


async def fenced(conn: Any, role: str, shard: int, owner: int, epoch: int) -> bool:
    """Whether the one fence (noetl_db.leases.fence) lets (owner, epoch) write the shard; a
    refused fence aborts the transaction, so it is tried under a savepoint."""
    try:
        async with conn.transaction():
            await lease_db.fence(conn, role, shard, owner, epoch)
        return True
    except LeaseLost:
        return False


async def test_epoch_bump_waits_for_an_in_flight_fenced_write(pool: Pool, rows: Rows) -> None:
    role = rows.role("fence")
    m = Membership(pool, shard_count=4, lease_sec=30.0, roles=(role,))
    (a,) = await rows.join(m, role, 1)
    await m.rebalance()
    before = await leases(pool, role)
    (b,) = await rows.join(m, role, 1)
    target = assign(4, [a, b], {s: o for s, (o, _) in before.items()})
    shard = min(s for s, o in target.items() if o == b)

    async with pool.connection() as conn:
        async with conn.transaction():
            assert await fenced(conn, role, shard, a, 1)  # a holds the row lock
            moving = asyncio.ensure_future(m.rebalance())
            # the leader's statement queues behind our row lock (signal, not a sleep)
            await until(lambda: fetch(
                pool, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE %s", ("%noetl.shard_lease%",)), timeout=10,
                what="the rebalance waiting on the shard_lease row lock")
            assert not moving.done()
        assert await moving == 2
        async with conn.transaction():  # the old owner's next write is fenced off
            assert not await fenced(conn, role, shard, a, 1)
    assert (await leases(pool, role))[shard] == (b, 2)


# ---------------------------------------------------------------- the member side


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def leased_until(pool: Pool, role: str) -> dict[int, Any]:
    found = await fetch(pool, "SELECT shard_id, leased_until FROM noetl.shard_lease WHERE role = %s", (role,))
    return {r["shard_id"]: r["leased_until"] for r in found}


async def test_member_renews_only_the_exact_epoch_it_holds(pool: Pool, rows: Rows) -> None:
    role = rows.role("own")
    m = Membership(pool, shard_count=6, lease_sec=30.0, roles=(role,))
    (a,) = await rows.join(m, role, 1)
    await m.rebalance()
    assigned = {r["shard_id"]: r["epoch"] for r in await m.assignments(role, a)}
    assert assigned == dict.fromkeys(range(6), 1)

    clock = Clock()
    # a longer term than the leader's grant, so a renewal visibly moves leased_until
    own_a = ShardOwnership(pool, role, lease_sec=60.0, margin_sec=2.0, clock=clock)
    own_a.runtime_id = a
    before = await leased_until(pool, role)
    assert await own_a.renew(assigned) == (assigned, set())
    assert own_a.held() == assigned
    renewed = await leased_until(pool, role)
    assert all(renewed[s] > before[s] for s in range(6))
    assert await own_a.renew() == ({}, set())  # renewing what is held changes nothing

    # the leader moves half the shards to b (epoch bumped): a's next renewal reports them lost
    (b,) = await rows.join(m, role, 1)
    assert await m.rebalance() == 3
    moved = {r["shard_id"]: r["epoch"] for r in await m.assignments(role, b)}
    assert set(moved.values()) == {2}
    before = await leased_until(pool, role)
    gained, lost = await own_a.renew()
    assert gained == {} and lost == set(moved)
    assert own_a.held() == {s: 1 for s in range(6) if s not in moved}
    assert all(own_a.epoch(s) is None for s in moved)
    after = await leased_until(pool, role)
    assert all(after[s] == before[s] for s in moved)  # b's leases untouched

    # a stale holder asking for its old term renews nothing of b's
    gained, lost = await own_a.renew({**own_a.held(), **dict.fromkeys(moved, 1)})
    assert gained == {} and lost == set()
    after = await leased_until(pool, role)
    assert all(after[s] == before[s] for s in moved)

    own_b = ShardOwnership(pool, role, lease_sec=60.0, margin_sec=2.0, clock=clock)
    own_b.runtime_id = b
    assert await own_b.renew(moved) == (moved, set())

    # the fence: only the current owner at the current epoch passes
    shard = min(moved)
    async with pool.connection() as conn, conn.transaction(force_rollback=True):
        assert not await fenced(conn, role, shard, a, 1)
        assert not await fenced(conn, role, shard, b, 1)
        row = await lease_db.fence(conn, role, shard, b, 2, stream_seq=1)
        assert row["stream_seq"] == 1


async def test_member_trusts_a_lease_only_until_ttl_minus_margin(pool: Pool, rows: Rows) -> None:
    role = rows.role("ttl")
    m = Membership(pool, shard_count=2, lease_sec=30.0, roles=(role,))
    (a,) = await rows.join(m, role, 1)
    await m.rebalance()
    clock = Clock(500.0)
    own = ShardOwnership(pool, role, lease_sec=10.0, margin_sec=2.0, clock=clock)
    own.runtime_id = a
    await own.renew({0: 1, 1: 1})

    clock.now = 507.9
    assert own.epoch(0) == 1 and own.expire() == set()
    clock.now = 508.0
    assert own.epoch(0) is None and own.held() == {}
    assert own.expire() == {0, 1}
    assert await own.renew() == ({}, set())  # nothing left to renew
