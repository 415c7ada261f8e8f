"""Cursor drain: a work table of N pending rows in the stack's Postgres, drained by a
cursor loop (``max_in_flight`` 16 slots claiming with FOR UPDATE SKIP LOCKED); each row
runs a postgres task inserting the row into a sink table whose ``hits`` column counts
repeated runs. Verified before the rate is reported: COMPLETED, every row claimed, the
sink holds exactly N rows each hit once, the values add up, the loop's stats say N rows
and none failed."""

from __future__ import annotations

import time
from typing import Any

from noetl_client import values
from noetl_proto.v1 import catalog_pb2

from ..playbooks import cursor_drain
from ..stack import BenchError
from .common import Ctx, Meter, deadline_for, follow

WORK = "public.bench_cursor_work"
SINK = "public.bench_cursor_sink"
CREDENTIAL = "bench_pg"


def run(ctx: Ctx) -> dict[str, Any]:
    stack, n, width = ctx.stack, ctx.plan.cursor_rows, ctx.plan.cursor_width
    stack.client.credentials.PutCredential(catalog_pb2.PutCredentialRequest(
        name=CREDENTIAL, kind="postgres", data=values.to_struct({"dsn": stack.st.postgres_dsn})), timeout=10)
    playbook = cursor_drain(WORK, SINK, CREDENTIAL, width)
    _tables(ctx, 50)
    ctx.progress.start("cursor drain: warm-up (50 rows)", 50, "rows")
    _drain(ctx, playbook, 50)
    _tables(ctx, n)
    ctx.progress.start(f"cursor drain: {n:,} rows, max_in_flight {width}", n, "rows")
    with Meter(ctx) as meter:
        eid, wall = _drain(ctx, playbook, n)
    ctx.progress.finish()
    return {"rows": n, "max_in_flight": width, "execution_id": eid, "wall_s": round(wall, 3),
            "rows_per_s": round(n / wall, 1),
            "check": f"COMPLETED; {n:,} rows claimed; sink has {n:,} rows, each run exactly once (hits = 1); "
                     "sum of values matches; loop stats total = rows, failed = 0",
            "meter": meter.summary(n, "row")}


def _tables(ctx: Ctx, n: int) -> None:
    stack = ctx.stack
    stack.execute(f"DROP TABLE IF EXISTS {WORK}")
    stack.execute(f"DROP TABLE IF EXISTS {SINK}")
    stack.execute(f"CREATE TABLE {WORK} (id int PRIMARY KEY, status text NOT NULL DEFAULT 'pending', v int NOT NULL)")
    stack.execute(f"CREATE INDEX ON {WORK} (status, id)")
    stack.execute(f"INSERT INTO {WORK} (id, v) SELECT g, (g * 7) % 1000 FROM generate_series(1, {n}) g")
    stack.execute(f"CREATE TABLE {SINK} (id int PRIMARY KEY, v int NOT NULL, hits int NOT NULL DEFAULT 1)")
    stack.execute(f"VACUUM ANALYZE {WORK}")


def _drain(ctx: Ctx, playbook: str, n: int) -> tuple[int, float]:
    stack = ctx.stack
    t0 = time.monotonic()
    eid = stack.submit(playbook)
    term = follow(ctx, eid, t0, n, t0 + deadline_for(n),
                  f"SELECT count(*) FROM {SINK} WHERE %s::bigint IS NOT NULL")
    wall = term.at - t0
    if term.status != "COMPLETED":
        raise BenchError(f"execution {eid} ended {term.status}: {term.error}")
    claimed = stack.scalar(f"SELECT count(*) FROM {WORK} WHERE status = 'claimed'")
    rows, once, total = stack.sql(f"SELECT count(*), count(*) FILTER (WHERE hits = 1), coalesce(sum(v), 0)"
                                  f" FROM {SINK}")[0]
    expected = stack.scalar(f"SELECT sum(v) FROM {WORK}")
    if (claimed, rows, once) != (n, n, n) or int(total) != int(expected):
        raise BenchError(f"cursor drain of {n} rows: {claimed} claimed, sink {rows} rows ({once} hit once), "
                         f"sum {total} vs {expected}")
    meta = stack.scalar("SELECT meta FROM noetl.event WHERE execution_id = %s AND event_type = 'loop.done'", (eid,))
    if not meta or int(meta.get("total", -1)) != n or int(meta.get("failed", -1)) != 0:
        raise BenchError(f"execution {eid}: loop.done stats {meta}, expected total {n}, failed 0")
    return eid, wall
