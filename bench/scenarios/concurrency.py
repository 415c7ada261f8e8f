"""Concurrency: N executions of the 3-step playbook submitted at once (N gRPC calls in
flight together), waited for through the read model. Reports completion throughput
(executions/s and steps/s from the first submit to the last completion), the
per-execution latency (read model: created_at -> ended_at), the projection lag p95
(``noetl.projection_checkpoint.lag_ms`` each time a projector batch advanced a shard:
the age of the newest event a batch projected) and the checkpoint age p99, in ms (the
checkpointer's ``noetl_checkpoint_age_seconds`` gauge, every shard, sampled every 0.3 s while
the executions ran: the age of the shard's oldest event not yet covered by a sealed
checkpoint, 0 when all are sealed; the log-derived "seal delay" beside it is, for each
checkpoint sealed during the run, the age of the oldest event it sealed when it was
sealed, i.e. the gauge's value at the moment of each seal, its peaks).
Admission refusals (RESOURCE_EXHAUSTED) are retried after the hint
and counted. Every execution's final value is checked."""

from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Any

import grpc
import psycopg

from noetl_client import values
from noetl_proto.v1 import execution_pb2

from ..playbooks import THREE_STEPS, three_steps_expected
from ..stack import BenchError
from ..stats import percentile, summary_ms
from .common import Ctx, Meter

# For each checkpoint sealed in the window: how old the oldest event it sealed was when it
# was sealed (the age of unsealed work, from the log), split at the barrier's append: oldest
# event -> barrier appended (waiting for the checkpointer's next tick + the engine's turn),
# barrier appended -> sealed (the projection passing it + the checkpointer's reaction).
SEAL_DELAY = """
WITH c AS (
  SELECT shard_id, epoch, last_shard_seq, sealed_at,
         lag(last_shard_seq, 1, 0::bigint) OVER (PARTITION BY shard_id ORDER BY epoch) AS prev_seq
  FROM noetl.checkpoint)
SELECT extract(epoch FROM c.sealed_at - min(e.created_at)) * 1000,
       extract(epoch FROM max(e.created_at) FILTER (WHERE e.shard_seq = c.last_shard_seq) - min(e.created_at)) * 1000,
       extract(epoch FROM c.sealed_at - max(e.created_at) FILTER (WHERE e.shard_seq = c.last_shard_seq)) * 1000
FROM c JOIN noetl.event e ON e.shard_id = c.shard_id AND e.shard_seq > c.prev_seq AND e.shard_seq <= c.last_shard_seq
WHERE c.sealed_at BETWEEN %s AND %s
GROUP BY c.shard_id, c.epoch, c.sealed_at
"""


class _Sampler(threading.Thread):
    """Projection lag per projector batch (from Postgres) and checkpoint age (from the
    checkpointers' /metrics) until stopped."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(name="lag-sampler", daemon=True)
        self.ctx = ctx
        self.stop_event = threading.Event()
        self.lag_ms: list[float] = []
        self.age_ms: list[float] = []
        self.errors = 0

    def run(self) -> None:
        stack = self.ctx.stack
        seen: dict[int, Any] = {}
        checkpointers = stack.st.processes("checkpointer")
        with psycopg.connect(stack.st.postgres_dsn, autocommit=True) as conn:
            for shard, at, _ in conn.execute(
                    "SELECT shard_id, last_projected_at, lag_ms FROM noetl.projection_checkpoint").fetchall():
                seen[shard] = at
            tick = 0
            while not self.stop_event.wait(0.1):
                tick += 1
                try:
                    for shard, at, lag in conn.execute(
                            "SELECT shard_id, last_projected_at, lag_ms FROM noetl.projection_checkpoint").fetchall():
                        if at is not None and at != seen.get(shard):
                            seen[shard] = at
                            if lag is not None:
                                self.lag_ms.append(float(lag))
                    if tick % 3 == 0:
                        for proc in checkpointers:
                            text = stack.scrape(proc, timeout=2)
                            self.age_ms.extend(v * 1000 for _, v in
                                               stack.samples(text, "noetl_checkpoint_age_seconds"))
                except Exception:
                    self.errors += 1


def run(ctx: Ctx) -> dict[str, Any]:
    stack, n = ctx.stack, ctx.plan.concurrency
    ctx.progress.start(f"concurrency: {n} executions of the 3-step playbook submitted at once", n, "executions")
    rng = random.Random(11)
    seeds = [rng.randrange(1_000_000) for _ in range(n)]
    refused = 0
    db_t0 = stack.scalar("SELECT clock_timestamp()")
    sampler = _Sampler(ctx)
    sampler.start()
    try:
        with Meter(ctx) as meter:
            t0 = time.monotonic()
            # one key per submission, the same on its resubmissions: never two executions of one
            requests = [execution_pb2.SubmitExecutionRequest(playbook_yaml=THREE_STEPS, payload=values.to_struct(
                {"seed": s}), idempotency_key=f"bench-{uuid.uuid4()}") for s in seeds]
            futures = [stack.client.executions.SubmitExecution.future(r, timeout=120) for r in requests]
            ids: list[int] = []
            for i, fut in enumerate(futures):
                while True:
                    try:
                        ids.append(int(fut.result().execution_id))
                        break
                    except grpc.RpcError as exc:
                        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                            raise BenchError(f"submission {i} failed: {exc.code()} {exc.details()}") from exc  # type: ignore[attr-defined]
                        refused += 1
                        time.sleep(0.5)
                        fut = stack.client.executions.SubmitExecution.future(requests[i], timeout=120)
            t_submitted = time.monotonic()
            deadline = t0 + 300
            finished = 0
            while finished < n:
                finished = int(stack.scalar(
                    "SELECT count(*) FROM noetl.execution WHERE execution_id = ANY(%s)"
                    " AND status IN ('COMPLETED', 'FAILED', 'CANCELLED')", (ids,)) or 0)
                ctx.progress.update(finished)
                if finished >= n:
                    break
                if time.monotonic() > deadline:
                    raise BenchError(f"only {finished}/{n} executions finished within 300 s")
                time.sleep(0.05)
            wall = time.monotonic() - t0
    finally:
        sampler.stop_event.set()
        sampler.join(timeout=10)
    # verify
    statuses = dict(stack.sql("SELECT status, count(*) FROM noetl.execution WHERE execution_id = ANY(%s) GROUP BY 1",
                              (ids,)))
    if statuses.get("COMPLETED") != n:
        raise BenchError(f"{n} executions: {statuses}")
    for eid, seed in zip(ids, seeds, strict=True):
        got = (stack.results(eid).get("c") or {}).get("v")
        if got != three_steps_expected(seed):
            raise BenchError(f"execution {eid}: c = {got}, expected {three_steps_expected(seed)}")
    db_t1 = stack.scalar("SELECT clock_timestamp()")
    seal_rows = stack.sql(SEAL_DELAY, (db_t0, db_t1))
    seal = [float(r[0]) for r in seal_rows]
    to_barrier = [float(r[1]) for r in seal_rows if r[1] is not None]
    to_seal = [float(r[2]) for r in seal_rows if r[2] is not None]
    lat = [float(x) for (x,) in stack.sql(
        "SELECT extract(epoch FROM ended_at - created_at) FROM noetl.execution WHERE execution_id = ANY(%s)", (ids,))]
    # commands handed to a worker (claimed in the engine's own transaction) vs claimed by a call
    handed, commands = stack.sql(
        "SELECT count(*) FILTER (WHERE claimed_at = created_at), count(*) FROM noetl.command"
        " WHERE execution_id = ANY(%s)", (ids,))[0]
    ctx.progress.finish()
    return {
        "executions": n, "wall_s": round(wall, 3), "submit_all_s": round(t_submitted - t0, 3),
        "commands": int(commands), "handed_off": int(handed),
        "executions_per_s": round(n / wall, 1), "steps_per_s": round(3 * n / wall, 1),
        "latency": summary_ms(lat), "admission_refusals": refused,
        "projection_lag_ms": {"samples": len(sampler.lag_ms), "p50": _p(sampler.lag_ms, 50),
                              "p95": _p(sampler.lag_ms, 95), "max": max(sampler.lag_ms, default=None)},
        "checkpoint_age_ms": {"samples": len(sampler.age_ms), "p50": _p(sampler.age_ms, 50),
                              "p99": _p(sampler.age_ms, 99), "max": max(sampler.age_ms, default=None)},
        "seal_delay_ms": {"checkpoints": len(seal), "p50": _p(seal, 50), "p99": _p(seal, 99),
                          "max": round(max(seal), 1) if seal else None,
                          "to_barrier_p50": _p(to_barrier, 50), "to_barrier_p99": _p(to_barrier, 99),
                          "barrier_to_seal_p50": _p(to_seal, 50), "barrier_to_seal_p99": _p(to_seal, 99)},
        "sampler_errors": sampler.errors,
        "check": f"all {n} COMPLETED (read model); every execution's c == 2 * (seed + 1)",
        "meter": meter.summary(n, "execution"),
    }


def _p(values: list[float], p: float) -> float | None:
    return round(percentile(values, p), 1) if values else None
