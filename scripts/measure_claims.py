"""What a claim through the api costs beside the claim statement alone (issue 14: should a
worker claim straight from Postgres?).

    .venv/bin/python scripts/measure_claims.py [--runs 60]

Starts a local stack (bench.stack), runs ``--runs`` 3-step executions one at a time, then
reads the api's server-side duration of ClaimCommand(s) (grpc_server_handling_seconds) and
times the same claim statement (``noetl_db.commands.claim``) against the stack's database
for as many synthetic commands. Prints both means per claim, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from bench import playbooks
from bench.progress import Progress
from bench.stack import BenchStack
from noetl_common.db import autocommit, make_pool
from noetl_db import commands
from noetl_flow import NewCommand


def server_claims(stack: BenchStack) -> tuple[float, float]:
    """(count, seconds) of claim RPCs the api served."""
    api = stack.st.processes("api")[0]
    text = stack.scrape(api)
    claims = ("ClaimCommand", "ClaimCommands")
    count = sum(v for labels, v in stack.samples(text, "grpc_server_handling_seconds_count")
                if labels.get("grpc_method") in claims)
    total = sum(v for labels, v in stack.samples(text, "grpc_server_handling_seconds_sum")
                if labels.get("grpc_method") in claims)
    return count, total


async def statement_only(dsn: str, n: int) -> float:
    """Mean seconds of the claim statement alone, one claim per call (its own transaction)."""
    pool = make_pool(dsn, min_size=1, max_size=1, name="measure-claims")
    await pool.open(wait=True, timeout=30)
    try:
        async with autocommit(pool) as conn:
            cur = await conn.execute("SELECT catalog_id FROM noetl.catalog ORDER BY catalog_id LIMIT 1")
            catalog_id = int((await cur.fetchone() or {})["catalog_id"])
            eid = int(time.time() * 1000) << 22
            ids = [f"{eid}:s{i}:1" for i in range(n)]
            await commands.insert_commands(conn, 0, [
                commands.QueuedCommand(eid, catalog_id, NewCommand(c, f"s{i}", "python", 1, {}),
                                       _Placed()) for i, c in enumerate(ids)])
            started = time.perf_counter()
            for c in ids:
                await commands.claim(conn, [(c, 1)], f"measure-{uuid.uuid4().hex[:6]}", 30.0, pools=["default"],
                                     labels={}, tools=[], need_payload=[eid])
            return (time.perf_counter() - started) / n
    finally:
        await pool.close()


class _Placed:
    pool = "default"
    requires = None
    priority = "normal"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60)
    args = parser.parse_args()
    with BenchStack("claims", Progress()) as stack:
        for seed in range(args.runs):
            eid = stack.submit(playbooks.THREE_STEPS, {"seed": seed})
            if stack.watch(eid, time.monotonic() + 60) is None:
                raise SystemExit(f"execution {eid} did not finish")
        count, total = server_claims(stack)
        sql = asyncio.run(statement_only(stack.st.postgres_dsn, max(int(count), 30)))
    print(json.dumps({"claims_served": int(count), "api_claim_ms_mean": round(1000 * total / max(count, 1), 3),
                      "claim_statement_ms_mean": round(1000 * sql, 3)}))


if __name__ == "__main__":
    main()
