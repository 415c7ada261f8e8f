"""Compactor throughput: events compacted per second on one shard.

``measure`` writes N synthetic finished executions of M events each (``synthetic``) on
one shard in an old day's partition, takes that shard's compactor lease, runs
``Compaction`` batches until nothing is due, and reports events/s over the time spent
inside the fenced compaction transactions (manifest + parts + delete). With ``check``
it also counts, for the executions it wrote, the manifests, the events they account for
and the events left (the caller compares them with what was written). The partition is
dropped afterwards (it is empty by then). ``scripts/bench_compactor.py`` is the CLI;
``python -m bench`` runs it as its ``compactor`` scenario.
"""

from __future__ import annotations

import time
from datetime import date, timedelta
from typing import Any

from noetl_common.db import make_pool, partition_name
from noetl_db import leases

from .compaction import ROLE, Compaction
from .synthetic import write_executions

OWNER, EPOCH = 9_999_001, 1
RETENTION_SEC = 86_400.0


async def measure(dsn: str, *, executions: int = 2000, events: int = 20, chain: int = 3, shard: int = 0,
                  shard_count: int = 16, batch_executions: int = 500, batch_events: int = 50_000,
                  day: date | None = None, check: bool = False) -> dict[str, Any]:
    pool = make_pool(dsn, min_size=1, max_size=2, name="bench-compactor")
    await pool.open(wait=True, timeout=30)
    try:
        day = day or date(2024, 6, 1) + timedelta(days=shard % 200)
        setup = time.perf_counter()
        made = await write_executions(pool, day=day, count=executions, events_per_execution=events, chain=chain,
                                      shard_count=shard_count, shard=shard)
        setup = time.perf_counter() - setup
        async with pool.connection() as conn:
            await leases.assign(conn, ROLE, shard, OWNER, EPOCH)
            await conn.commit()
        compaction = Compaction(pool, shard, OWNER, EPOCH, retention_sec=RETENTION_SEC,
                                batch_executions=batch_executions, batch_events=batch_events)
        total_events = total_executions = batches = 0
        seconds = 0.0
        while True:
            result = await compaction.batch()
            if result.empty:
                break
            batches += 1
            total_events += result.events
            total_executions += result.executions
            seconds += result.seconds
        figures: dict[str, Any] = {}
        if check:
            ids = [m.execution_id for m in made]
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT count(*) AS manifests, COALESCE(sum(event_count), 0) AS events FROM noetl.manifest"
                    " WHERE execution_id = ANY(%s)", (ids,))
                counted = await cur.fetchone() or {}
                cur = await conn.execute("SELECT count(*) AS n FROM noetl.event WHERE execution_id = ANY(%s)", (ids,))
                left = await cur.fetchone() or {}
                await conn.commit()
            figures = {"events_generated": sum(m.events for m in made),
                       "manifests": int(counted.get("manifests", 0)),
                       "manifest_events": int(counted.get("events", 0)), "events_left": int(left.get("n", 0))}
        async with pool.connection() as conn:
            name = partition_name(day)
            cur = await conn.execute(f"SELECT NOT EXISTS (SELECT 1 FROM noetl.{name}) AS empty")
            row = await cur.fetchone()
            if row and row["empty"]:
                await conn.execute(f"DROP TABLE noetl.{name}")
            await conn.commit()
        return {"executions": total_executions, "events": total_events, "batches": batches,
                "seconds": round(seconds, 3), "events_per_second": round(total_events / seconds if seconds else 0.0),
                "setup_seconds": round(setup, 3), "written": len(made), "events_per_execution": events,
                "shard": shard, "batch_executions": batch_executions, **figures}
    finally:
        await pool.close()
