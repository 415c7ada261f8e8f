"""Raw limits of the parts, measured in the same run against the stack's own NATS and
Postgres, from Python (nats-py, psycopg), the way the runtime talks to them:

* JetStream acked publishes/s (a FILE stream like the runtime's, Nats-Msg-Id set):
  sequential (await each ack) and pipelined (``publish_async``, acks awaited at the end);
* Postgres single-row commits/s (an INSERT per autocommit transaction), on one
  connection and on 8 at once;
* ``FOR UPDATE SKIP LOCKED`` claims/s (the cursor loop's claim statement), on one
  connection and on 16 at once (the cursor scenario's ``max_in_flight``).

Each checks its own count (stream messages == acks; rows == commits; claimed ids
distinct and == rows marked claimed) before it reports a rate.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg

from ..stack import BenchError
from .common import Ctx

PAYLOAD = os.urandom(256)  # about a call.done / command notice
STREAM = "BENCH_LIMITS"
CLAIM = ("UPDATE bench_limits_work SET status = 'claimed' WHERE id = (SELECT id FROM bench_limits_work"
         " WHERE status = 'pending' ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id")
CLAIM_ROWS = 200_000


async def _nats(url: str, ca_file: str, seconds: float) -> dict[str, Any]:
    import nats
    from nats.js.api import StorageType, StreamConfig

    from noetl_common import natsio

    # the stack's NATS speaks TLS only (as in production); the admin user may create a stream
    nc = await nats.connect(url, name="noetl-bench-limits", allow_reconnect=False, connect_timeout=5,
                            tls=natsio.tls_context(ca_file))
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=STREAM, subjects=["bench.limits.>"], storage=StorageType.FILE,
                                         duplicate_window=120.0))
        try:
            n_seq = 0
            t0 = time.perf_counter()
            end = t0 + seconds
            while time.perf_counter() < end:
                ack = await js.publish("bench.limits.seq", PAYLOAD, headers={"Nats-Msg-Id": f"s{n_seq}"})
                if ack.duplicate:
                    raise BenchError("a sequential publish was acked as a duplicate")
                n_seq += 1
            seq_s = time.perf_counter() - t0

            futures: list[Any] = []
            t0 = time.perf_counter()
            end = t0 + seconds
            while time.perf_counter() < end:
                futures.append(await js.publish_async("bench.limits.pipe", PAYLOAD, wait_stall=30,
                                                      headers={"Nats-Msg-Id": f"p{len(futures)}"}))
            acks = await asyncio.wait_for(asyncio.gather(*futures), timeout=60)
            pipe_s = time.perf_counter() - t0
            if any(a.duplicate for a in acks):
                raise BenchError("a pipelined publish was acked as a duplicate")
            info = await js.stream_info(STREAM)
            stored = int(info.state.messages)
            if stored != n_seq + len(acks):
                raise BenchError(f"JetStream stored {stored} messages, {n_seq + len(acks)} were acked")
        finally:
            await js.delete_stream(STREAM)
        return {"js_publish_seq_per_s": round(n_seq / seq_s), "js_publish_seq_ms": round(1000 * seq_s / n_seq, 3),
                "js_publish_pipelined_per_s": round(len(acks) / pipe_s),
                "js_checked": f"{stored:,} messages stored == acks ({n_seq:,} sequential + {len(acks):,} pipelined)"}
    finally:
        await nc.close()


async def _commits(dsn: str, seconds: float, conns: int) -> tuple[float, int]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
        await admin.execute("DROP TABLE IF EXISTS bench_limits_commit")
        await admin.execute("CREATE TABLE bench_limits_commit (id bigserial PRIMARY KEY, conn int NOT NULL,"
                            " v int NOT NULL, at timestamptz NOT NULL DEFAULT now())")
        start = asyncio.Event()

        async def one(k: int, end_box: list[float]) -> int:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await start.wait()
                i = 0
                while time.perf_counter() < end_box[0]:
                    await conn.execute("INSERT INTO bench_limits_commit (conn, v) VALUES (%s, %s)", (k, i))
                    i += 1
                return i

        box = [0.0]
        tasks = [asyncio.create_task(one(k, box)) for k in range(conns)]
        await asyncio.sleep(0.2)  # connections open
        t0 = time.perf_counter()
        box[0] = t0 + seconds
        start.set()
        counts = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        cur = await admin.execute("SELECT count(*) FROM bench_limits_commit")
        rows = int((await cur.fetchone())[0])  # type: ignore[index]
        await admin.execute("DROP TABLE bench_limits_commit")
        if rows != sum(counts):
            raise BenchError(f"{rows} rows committed, {sum(counts)} commits counted")
        return sum(counts) / wall, rows


async def _claims(dsn: str, seconds: float, conns: int) -> tuple[float, int]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
        await admin.execute("DROP TABLE IF EXISTS bench_limits_work")
        await admin.execute("CREATE TABLE bench_limits_work (id int PRIMARY KEY, status text NOT NULL"
                            " DEFAULT 'pending', v int)")
        await admin.execute("CREATE INDEX ON bench_limits_work (status, id)")  # as the cursor scenario's table
        await admin.execute(f"INSERT INTO bench_limits_work (id, v) SELECT g, g FROM generate_series(1, {CLAIM_ROWS}) g")
        await admin.execute("VACUUM ANALYZE bench_limits_work")
        start = asyncio.Event()
        claimed: list[int] = []

        async def one(end_box: list[float]) -> None:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await start.wait()
                while time.perf_counter() < end_box[0]:
                    row = await (await conn.execute(CLAIM)).fetchone()
                    if row is None:
                        return
                    claimed.append(int(row[0]))

        box = [0.0]
        tasks = [asyncio.create_task(one(box)) for _ in range(conns)]
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        box[0] = t0 + seconds
        start.set()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        cur = await admin.execute("SELECT count(*) FROM bench_limits_work WHERE status = 'claimed'")
        marked = int((await cur.fetchone())[0])  # type: ignore[index]
        await admin.execute("DROP TABLE bench_limits_work")
        if len(set(claimed)) != len(claimed) or marked != len(claimed):
            raise BenchError(f"claims: {len(claimed)} claimed, {len(set(claimed))} distinct, {marked} marked")
        return len(claimed) / wall, len(claimed)


def run(ctx: Ctx) -> dict[str, Any]:
    stack, secs = ctx.stack, ctx.plan.limits_seconds
    ctx.progress.start("raw limits: NATS JetStream publishes")
    out: dict[str, Any] = asyncio.run(_nats(stack.st.nats_user_url(), stack.st.ca_file, secs))
    dsn = stack.st.postgres_dsn
    for conns in (1, 8):
        ctx.progress.start(f"raw limits: Postgres single-row commits, {conns} connection(s)")
        rate, n = asyncio.run(_commits(dsn, secs, conns))
        out[f"pg_commits_{conns}conn_per_s"] = round(rate)
        out[f"pg_commits_{conns}conn_checked"] = n
    for conns in (1, 16):
        ctx.progress.start(f"raw limits: FOR UPDATE SKIP LOCKED claims, {conns} connection(s)")
        rate, n = asyncio.run(_claims(dsn, secs, conns))
        out[f"pg_claims_{conns}conn_per_s"] = round(rate)
        out[f"pg_claims_{conns}conn_checked"] = n
    out["pg_commit_seq_ms"] = round(1000 / out["pg_commits_1conn_per_s"], 3)
    out["check"] = (out["js_checked"] + "; Postgres: rows == commits; claims: ids distinct, == rows marked claimed")
    ctx.progress.finish()
    return out
