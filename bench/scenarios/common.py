"""What every scenario shares: the plan (sizes per mode), the context handed to each
scenario, the meter (write transactions, JetStream publishes, CPU and memory per role
around a measured window), following a loop execution with a progress count, and the
workers' ``noetl_event_result_bytes`` histogram around a run."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..machine import ProcSampler
from ..progress import Progress
from ..stack import BenchError, BenchStack, Terminal


@dataclass(frozen=True)
class Plan:
    mode: str                                   # "quick" | "full"
    turnaround_runs: int = 50
    fanout_items: int = 1000
    fanout_widths: tuple[int, ...] = (16, 64)
    growth_sizes: tuple[int, ...] = (100, 1000, 10_000, 100_000)
    growth_width: int = 16
    sequential_items: int = 1000
    cursor_rows: int = 20_000
    cursor_width: int = 16
    concurrency: int = 200
    recovery_items: int = 10_000
    recovery_kill_at: float = 0.3               # kill once this share of the iterations is in
    limits_seconds: float = 3.0
    compactor_executions: int = 5000            # synthetic finished executions on one shard
    compactor_events: int = 20                  # events per execution
    # the PFT flow (scenarios/pft.py): facilities x patients per facility (full: upstream's
    # PFT test size, 10 x 1,000), patients per queue batch, parallel claim -> fetch -> save
    # slots, MDS page size
    pft_facilities: int = 10
    pft_patients: int = 1000
    pft_batch: int = 10
    pft_slots: int = 8
    pft_mds_page: int = 4
    cli_runs: int = 20                          # `noetl-rt status ID`, whole process
    durable_rerun: bool = True                  # turnaround + fan-out again with Postgres fsync on
    tuned_rerun: bool = True                    # fan-out again on stack.TUNED_ENV (when it is set)
    peers: bool = True

    @classmethod
    def quick(cls) -> Plan:
        return cls(mode="quick", turnaround_runs=50, growth_sizes=(100, 1000, 10_000), sequential_items=300,
                   cursor_rows=2_000, concurrency=200, recovery_items=2_000, limits_seconds=1.5,
                   compactor_executions=1_000, pft_facilities=5, pft_patients=100, durable_rerun=False,
                   tuned_rerun=False, peers=False)

    @classmethod
    def full(cls) -> Plan:
        return cls(mode="full")


@dataclass
class Ctx:
    stack: BenchStack
    progress: Progress
    plan: Plan
    limits: dict[str, Any] = field(default_factory=dict)
    background_writes_per_s: float = 0.0
    # CPU cores each process tree uses while the stack is idle (heartbeats, polls, ticks)
    background_cores: dict[str, float] = field(default_factory=dict)


def deadline_for(items: int, *, floor: float = 120.0, per_item: float = 0.05) -> float:
    """A generous time limit (seconds) for ``items`` units of work: 20 units/s at worst."""
    return max(floor, items * per_item)


class Meter:
    """Counts around a measured window: write transactions (minus the idle stack's own),
    JetStream messages stored, and per-role CPU and peak memory (``ProcSampler``).
    ``extra``: more process trees to sample beside the stack's (label -> root pids), e.g. a
    fixture server the scenario started."""

    def __init__(self, ctx: Ctx, interval: float = 0.5, extra: Mapping[str, list[int]] | None = None) -> None:
        self.ctx = ctx
        more = dict(extra or {})
        self.sampler = ProcSampler(lambda: {**ctx.stack.roots(), **more}, interval=interval,
                                   flat=frozenset({"bench-client"}))
        self.t0 = self.t1 = 0.0
        self.x0 = self.x1 = 0
        self.s0: dict[str, int] = {}
        self.s1: dict[str, int] = {}

    def __enter__(self) -> Meter:
        self.x0 = self.ctx.stack.xid()
        self.s0 = self.ctx.stack.stream_seqs()
        self.sampler.start()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.t1 = time.monotonic()
        self.sampler.stop()
        try:
            self.x1 = self.ctx.stack.xid()
            self.s1 = self.ctx.stack.stream_seqs()
        except Exception:  # the stack is in trouble; the scenario reports its own error
            self.x1, self.s1 = self.x0, dict(self.s0)

    def summary(self, units: int, unit: str) -> dict[str, Any]:
        wall = self.t1 - self.t0
        writes = max(0.0, (self.x1 - self.x0) - self.ctx.background_writes_per_s * wall)
        published = {k: self.s1.get(k, 0) - v for k, v in self.s0.items()}
        total_pub = sum(published.values())
        usage = self.sampler.summary()
        for label, tree in usage["trees"].items():
            idle = self.ctx.background_cores.get(label, 0.0) * wall
            tree["cpu_s_minus_idle"] = round(max(0.0, tree["cpu_s"] - idle), 2)
        return {
            "unit": unit, "units": units,
            "write_txns": round(writes), "write_txns_per_unit": round(writes / units, 2) if units else None,
            "js_messages": published, "js_messages_per_unit": round(total_pub / units, 2) if units else None,
            "usage": usage,
        }


RESULT_BYTES = "noetl_event_result_bytes"


def result_bytes(ctx: Ctx) -> dict[str, float]:
    """The workers' ``noetl_event_result_bytes`` histogram now, summed over the worker
    processes: {bucket upper bound (the ``le`` label): cumulative count, "count", "sum"}."""
    stack = ctx.stack
    out: dict[str, float] = {}
    for proc in stack.st.processes("worker"):
        if not proc.alive():
            continue
        text = stack.scrape(proc)
        for labels, value in stack.samples(text, f"{RESULT_BYTES}_bucket"):
            out[labels["le"]] = out.get(labels["le"], 0.0) + value
        for key in ("count", "sum"):
            out[key] = out.get(key, 0.0) + sum(v for _, v in stack.samples(text, f"{RESULT_BYTES}_{key}"))
    if "+Inf" not in out:
        raise BenchError(f"no worker exports {RESULT_BYTES}")
    return out


def histogram_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}


@dataclass
class LoopRun:
    execution_id: int
    submitted: float
    terminal: Terminal
    wall_s: float
    submit_s: float


def follow(ctx: Ctx, execution_id: int, t0: float, total: int, deadline: float, count_sql: str,
           api: Any = None, poll: float = 0.5) -> Terminal:
    """Wait for the execution's terminal state (WatchExecution on a thread: the time is
    taken there) while showing progress from ``count_sql`` (one %s: the execution id)."""
    stack = ctx.stack
    box: list[Any] = []
    done = threading.Event()

    def watch() -> None:
        try:
            box.append(stack.watch(execution_id, deadline, api=api))
        except Exception as exc:  # reported below
            box.append(exc)
        finally:
            done.set()

    threading.Thread(target=watch, name=f"watch-{execution_id}", daemon=True).start()
    while not done.wait(poll):
        try:
            ctx.progress.update(int(stack.scalar(count_sql, (execution_id,)) or 0), total)
        except Exception:
            pass
    got = box[0] if box else None
    if isinstance(got, Exception):
        raise BenchError(f"execution {execution_id}: following it failed: {got}")
    if got is None:
        stack.cancel(execution_id)
        done_n = stack.scalar(count_sql, (execution_id,))
        raise BenchError(f"execution {execution_id} did not finish within {deadline - t0:.0f}s "
                         f"({done_n}/{total} done); cancelled")
    ctx.progress.update(total, total)
    return got


def run_loop(ctx: Ctx, playbook: str, n: int, *, timeout: float, api: Any = None) -> LoopRun:
    """Submit a fan-out loop over ``n`` items and wait for it (client-observed time)."""
    stack = ctx.stack
    t0 = time.monotonic()
    eid = stack.submit(playbook, {"n": n}, api=api)
    t_sub = time.monotonic()
    term = follow(ctx, eid, t0, n, t0 + timeout,
                  "SELECT count(*) FROM noetl.loop_result WHERE execution_id = %s", api=api,
                  poll=0.5 if n <= 20_000 else 1.0)
    return LoopRun(eid, t0, term, term.at - t0, t_sub - t0)


def verify_loop(ctx: Ctx, run: LoopRun, n: int, expected_sum: int, *, strict: bool = True) -> dict[str, Any]:
    """COMPLETED; n ordered results, each accepted once; the values add up. Returns counts.
    With ``strict=False`` commands accepted more than once are counted, not raised."""
    stack = ctx.stack
    eid = run.execution_id
    if run.terminal.status != "COMPLETED":
        raise BenchError(f"execution {eid} ended {run.terminal.status}: {run.terminal.error}")
    rows, distinct, ok = stack.sql(
        "SELECT count(*), count(DISTINCT idx), count(*) FILTER (WHERE status = 'ok') FROM noetl.loop_result"
        " WHERE execution_id = %s", (eid,))[0]
    if (rows, distinct, ok) != (n, n, n):
        raise BenchError(f"execution {eid}: loop_result has {rows} rows ({distinct} distinct, {ok} ok), expected {n}")
    total = stack.scalar(
        "SELECT sum(convert_from(p.data, 'UTF8')::bigint) FROM noetl.loop_result r"
        " JOIN noetl.result_payload p USING (ref_id) WHERE r.execution_id = %s", (eid,))
    if int(total or 0) != expected_sum:
        raise BenchError(f"execution {eid}: results add up to {total}, expected {expected_sum}")
    dup = stack.scalar(
        "SELECT count(*) FROM (SELECT command_id FROM noetl.event WHERE execution_id = %s"
        " AND event_type IN ('call.done', 'call.error') GROUP BY command_id HAVING count(*) > 1) d", (eid,))
    if int(dup or 0) and strict:
        raise BenchError(f"execution {eid}: {dup} command(s) with more than one accepted result")
    events = dict(stack.sql("SELECT event_type, count(*) FROM noetl.event WHERE execution_id = %s GROUP BY 1",
                            (eid,)))
    span = stack.sql(
        "SELECT extract(epoch FROM max(created_at) FILTER (WHERE event_type = 'loop.done')"
        " - min(created_at) FILTER (WHERE event_type = 'step.enter')) FROM noetl.event WHERE execution_id = %s",
        (eid,))[0][0]
    return {"duplicated_commands": int(dup or 0), "events": int(sum(events.values())), "events_by_type": {k: int(v) for k, v in events.items()},
            "engine_span_s": round(float(span or 0.0), 3),
            "check": f"COMPLETED; {n:,} loop_result rows, distinct indexes, all ok; sum of results = "
                     f"{expected_sum:,}; one accepted call.done per command"}
