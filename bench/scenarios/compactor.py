"""Compactor throughput: events compacted per second on one shard (seed target: at least
10,000 events/s per shard).

``noetl_compactor.bench.measure`` (the code behind ``scripts/bench_compactor.py``) writes
N synthetic finished executions of M events each on one shard in an old day's partition
(the way the runtime writes them: events, read models, references, db-tier payloads),
takes that shard's compactor lease, and runs ``Compaction`` batches (the compactor's
own code: fenced transaction, manifest + parts, DELETE of the events) until nothing is
due; the rate is events deleted over the time spent in those batches.

It runs in a scratch database created on the stack's Postgres server (same server, same
settings), so the stack's own compactor leases and tables are not touched; the database
is dropped afterwards. Checked before reporting: events deleted == events written,
manifests == executions written (each with its events counted), no event left.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psycopg
from psycopg import conninfo

from noetl_common.db import migrate
from noetl_compactor.bench import measure

from ..stack import BenchError
from .common import Ctx

SCRATCH_DB = "noetl_bench_compactor"


def run(ctx: Ctx) -> dict[str, Any]:
    stack, plan = ctx.stack, ctx.plan
    executions, events = plan.compactor_executions, plan.compactor_events
    ctx.progress.start(f"compactor: scratch database, {executions:,} executions x {events} events")
    dsn = stack.st.postgres_dsn
    scratch = conninfo.make_conninfo(dsn, dbname=SCRATCH_DB)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {SCRATCH_DB}")
    try:
        migrate(scratch)
        ctx.progress.start(f"compactor: compacting {executions:,} executions x {events} events on one shard")
        got = asyncio.run(measure(scratch, executions=executions, events=events, shard=0, check=True))
    finally:
        with contextlib.suppress(Exception), psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)")
    generated, written = got["events_generated"], got["written"]
    problems = []
    if got["events"] != generated:
        problems.append(f"{got['events']:,} events deleted, {generated:,} written")
    if got["executions"] != written or got["manifests"] != written:
        problems.append(f"{got['executions']:,} executions compacted and {got['manifests']:,} manifests, "
                        f"{written:,} executions written")
    if got["manifest_events"] != generated:
        problems.append(f"manifests count {got['manifest_events']:,} events, {generated:,} written")
    if got["events_left"]:
        problems.append(f"{got['events_left']:,} events of those executions are left")
    if problems:
        raise BenchError("compactor: " + "; ".join(problems))
    ctx.progress.finish()
    return {**got, "check": f"{generated:,} events deleted == events written; {written:,} manifests == executions "
                            "written, their event counts add up to the events written; no event left"}
