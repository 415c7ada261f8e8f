"""Fan-out throughput and growth: a parallel loop over range(n) of trivial python tasks
(iteration i returns 2 * i), submit -> COMPLETED seen on WatchExecution.

* fan-out: n = 1,000 at ``max_in_flight`` 16 and 64: wall time and iterations/s;
* growth: the same loop (``max_in_flight`` 16) at 100 / 1,000 / 10,000 (/ 100,000):
  wall time, events written (rows of noetl.event for the execution), write
  transactions and JetStream messages per iteration, and each role's peak RSS (VmRSS of
  the role process and its children, sampled every 0.5 s during the run). The 1,000-item
  point is the fan-out run at width 16 (the same loop, measured once).

* sequential: the same loop with ``mode: sequential`` (one iteration at a time), 1,000
  items (quick mode: fewer, see the plan): wall time and iterations/s; checked as above
  and, besides, that every command (one iteration, or a batch its worker runs one at a
  time) was dispatched only after the previous one was done, taking up the indexes where
  it left off.

Every run is verified (n ordered results, accepted once each, sum == n * (n - 1)) before
its time is reported. Around each measured run the workers' ``noetl_event_result_bytes``
histogram is scraped; the report adds the runs' deltas up for the p99 envelope size.
"""

from __future__ import annotations

import itertools
from typing import Any

from noetl_common.vocab import loop_span

from ..playbooks import fan_out, fan_out_expected_sum, sequential_loop
from ..stack import BenchError
from .common import Ctx, Meter, deadline_for, histogram_delta, result_bytes, run_loop, verify_loop

WARMUP_ITEMS = 20


def one_loop(ctx: Ctx, n: int, width: int, label: str, *, playbook: str | None = None) -> dict[str, Any]:
    playbook = playbook or fan_out(width)
    ctx.progress.start(f"{label}: warm-up ({WARMUP_ITEMS} items)", WARMUP_ITEMS, "iterations")
    warm = run_loop(ctx, playbook, WARMUP_ITEMS, timeout=120)
    verify_loop(ctx, warm, WARMUP_ITEMS, fan_out_expected_sum(WARMUP_ITEMS))
    ctx.progress.start(f"{label}: {n:,} items, max_in_flight {width}", n, "iterations")
    bytes0 = result_bytes(ctx)
    with Meter(ctx) as meter:
        run = run_loop(ctx, playbook, n, timeout=deadline_for(n))
    checked = verify_loop(ctx, run, n, fan_out_expected_sum(n))
    envelopes = histogram_delta(bytes0, result_bytes(ctx))
    ctx.progress.finish()
    return {"items": n, "max_in_flight": width, "execution_id": run.execution_id,
            "wall_s": round(run.wall_s, 3), "iterations_per_s": round(n / run.wall_s, 1),
            **checked, "events_per_item": round(checked["events"] / n, 3),
            "result_bytes": envelopes, "meter": meter.summary(n, "iteration")}


def sequential(ctx: Ctx) -> dict[str, Any]:
    """The loop one iteration at a time: iterations/s, and proof that it was sequential."""
    n = ctx.plan.sequential_items
    out = one_loop(ctx, n, 1, "sequential loop", playbook=sequential_loop())
    eid = out["execution_id"]
    rows = sorted(ctx.stack.sql("SELECT command_id, created_at, updated_at FROM noetl.command"
                                " WHERE execution_id = %s AND status = 'done'", (eid,)), key=lambda r: r[1])
    # each command one iteration, or a batch its worker ran one at a time (noetl_flow.loops.batch_size)
    spans = [loop_span(str(r[0])) or (int(str(r[0]).rsplit(":", 1)[1]), 1) for r in rows]
    overlaps = sum(cur[1] < prev[2] for prev, cur in itertools.pairwise(rows))
    unordered = sum(not prev[0] < cur[0] <= prev[0] + prev[1] for prev, cur in itertools.pairwise(spans))
    if not rows or spans[0][0] != 0 or overlaps or unordered:
        raise BenchError(f"execution {eid}: {len(rows)} done commands, {overlaps} issued before the previous one "
                         f"was done, {unordered} not taking up the indexes where the previous one left off")
    out["commands"] = len(rows)
    out["check"] += (f"; {len(rows):,} commands (batches of up to {max(c for _, c in spans)} iterations, each run "
                     "one at a time by its worker), each issued no earlier than the previous one was done, in "
                     "index order")
    out["ms_per_iteration"] = round(1000 * out["wall_s"] / n, 2)
    return out


def fanout(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": []}
    errors = []
    for width in ctx.plan.fanout_widths:
        try:
            out["runs"].append(one_loop(ctx, ctx.plan.fanout_items, width, "fan-out"))
        except BenchError as exc:
            errors.append(f"max_in_flight {width}: {exc}")
            out["runs"].append({"items": ctx.plan.fanout_items, "max_in_flight": width, "error": str(exc)})
    if errors and len(errors) == len(ctx.plan.fanout_widths):
        raise BenchError("; ".join(errors))
    return out


def growth(ctx: Ctx, fanout_result: dict[str, Any] | None) -> dict[str, Any]:
    plan = ctx.plan
    reuse = {r["items"]: r for r in (fanout_result or {}).get("runs", [])
             if r.get("max_in_flight") == plan.growth_width and "error" not in r}
    points = []
    for n in plan.growth_sizes:
        if n in reuse:
            points.append({**reuse[n], "reused": "the fan-out run at the same width"})
            continue
        try:
            points.append(one_loop(ctx, n, plan.growth_width, "growth"))
        except BenchError as exc:
            points.append({"items": n, "max_in_flight": plan.growth_width, "error": str(exc)})
    good = [p for p in points if "error" not in p]
    if not good:
        raise BenchError("; ".join(f"{p['items']}: {p['error']}" for p in points))
    return {"points": points, **shape(good)}


def shape(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Is the cost linear, is memory flat? Compared from the 1,000-item point (or the
    smallest above 100) to the largest."""
    base = next((p for p in points if p["items"] == 1000), None) or next(
        (p for p in sorted(points, key=lambda p: p["items"]) if p["items"] > 100), points[0])
    top = max(points, key=lambda p: p["items"])
    out: dict[str, Any] = {"from_items": base["items"], "to_items": top["items"]}
    if top is base:
        return out
    per_item = {p["items"]: p["wall_s"] / p["items"] for p in points}
    out["wall_per_item_ms"] = {k: round(v * 1000, 3) for k, v in per_item.items()}
    out["wall_per_item_ratio"] = round(per_item[top["items"]] / per_item[base["items"]], 2)
    out["events_per_item"] = {p["items"]: p["events_per_item"] for p in points}

    def cpu_ms(p: dict[str, Any]) -> float:  # the stack's CPU per item, idle use subtracted
        trees = p["meter"]["usage"]["trees"]
        return 1000 * sum(v.get("cpu_s_minus_idle", v["cpu_s"]) for k, v in trees.items()
                          if k != "bench-client") / p["items"]

    out["cpu_ms_per_item"] = {p["items"]: round(cpu_ms(p), 2) for p in points}
    out["cpu_per_item_ratio"] = round(cpu_ms(top) / cpu_ms(base), 2)
    out["others_cores"] = {p["items"]: p["meter"]["usage"]["others_cores_busy"] for p in points}
    b_rss = base["meter"]["usage"]["trees"]
    t_rss = top["meter"]["usage"]["trees"]
    growth = {}
    for role in t_rss:
        if role in b_rss and role not in ("bench-client",):
            growth[role] = {"from_mib": b_rss[role]["peak_rss_mib"], "to_mib": t_rss[role]["peak_rss_mib"],
                            "delta_mib": round(t_rss[role]["peak_rss_mib"] - b_rss[role]["peak_rss_mib"], 1)}
    out["rss_growth"] = growth
    return out
