"""Step turnaround: a 3-step linear playbook of trivial python tasks (each passing its
value to the next), submitted one at a time; the time is SubmitExecution called ->
COMPLETED seen on a WatchExecution stream opened right after the submit answered (the
client's view, including projection and the stream's delivery). Each run's final value
is checked (c == 2 * (seed + 1)) after the timed runs.

The server-side breakdown comes from the log: request committed -> first step.enter
(engine pick-up), step.enter -> the next step.enter (one step: dispatch, notice,
claim, run, store, publish, engine batch), playbook.completed -> the client seeing it
(projection + watch delivery). The middle step is broken down further: entered -> its
command claimed (the claim's statement, or the engine's own transaction for a command
handed off), claimed -> its result stored, stored -> the next step entered; and the end:
playbook.completed -> the projector's transaction that projected it.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from ..playbooks import THREE_STEPS, three_steps_expected
from ..stack import BenchError
from ..stats import summary_ms
from .common import Ctx, Meter

WARMUP = 3


def run(ctx: Ctx, label: str = "turnaround") -> dict[str, Any]:
    stack, n = ctx.stack, ctx.plan.turnaround_runs
    ctx.progress.start(f"{label}: {n} runs of the 3-step playbook (one at a time)", n, "runs")
    for _ in range(WARMUP):  # the catalog entry, the api's and the worker's pools and caches
        eid = stack.submit(THREE_STEPS, {"seed": 1})
        if stack.watch(eid, time.monotonic() + 60) is None:
            raise BenchError("a warm-up run did not finish within 60 s")
    runs: list[tuple[int, int, float, float, float, float]] = []
    rng = random.Random(7)
    with Meter(ctx, interval=1.0) as meter:
        for i in range(n):
            seed = rng.randrange(1_000_000)
            wall0 = time.time()
            t0 = time.monotonic()
            eid = stack.submit(THREE_STEPS, {"seed": seed})
            t_sub = time.monotonic()
            term = stack.watch(eid, t0 + 60)
            if term is None:
                stack.cancel(eid)
                raise BenchError(f"run {i} (execution {eid}) did not finish within 60 s")
            runs.append((eid, seed, t0, t_sub, term.at, wall0))
            if term.status != "COMPLETED":
                raise BenchError(f"run {i} (execution {eid}) ended {term.status}: {term.error}")
            ctx.progress.update(i + 1)
    # verify every run's result before reporting a time
    for eid, seed, *_ in runs:
        got = (stack.results(eid).get("c") or {}).get("v")
        if got != three_steps_expected(seed):
            raise BenchError(f"execution {eid}: c = {got}, expected {three_steps_expected(seed)}")
    lat = [t1 - t0 for _, _, t0, _, t1, _ in runs]
    out: dict[str, Any] = {"runs": n, "measured_by": "WatchExecution stream (client: submit -> COMPLETED seen)",
                           **summary_ms(lat),
                           "submit_rpc": summary_ms([ts - t0 for _, _, t0, ts, _, _ in runs]),
                           "latencies_ms": [round(x * 1000, 2) for x in lat],
                           "check": f"all {n} COMPLETED; every run's c == 2 * (seed + 1)",
                           "meter": meter.summary(n, "execution")}
    out["breakdown_ms"] = _breakdown(ctx, runs)
    ctx.progress.finish()
    return out


def _breakdown(ctx: Ctx, runs: list[tuple[int, int, float, float, float, float]]) -> dict[str, float]:
    """Medians, in ms, of where a run's time goes (log timestamps, same host clock)."""
    ids = [r[0] for r in runs]
    seen_at = {eid: wall0 + (t1 - t0) for eid, _, t0, _, t1, wall0 in runs}
    sent_at = {eid: wall0 for eid, _, _, _, _, wall0 in runs}
    req = dict(ctx.stack.sql("SELECT execution_id, extract(epoch FROM requested_at) FROM noetl.execution_request"
                             " WHERE execution_id = ANY(%s)", (ids,)))
    ev: dict[int, dict[str, float]] = {}
    for eid, etype, step, at in ctx.stack.sql(
            "SELECT execution_id, event_type, step, extract(epoch FROM created_at) FROM noetl.event"
            " WHERE execution_id = ANY(%s)", (ids,)):
        ev.setdefault(eid, {})[f"{etype}:{step or ''}"] = float(at)
    claimed = {(eid, step): float(at) for eid, step, at in ctx.stack.sql(
        "SELECT execution_id, step, extract(epoch FROM claimed_at) FROM noetl.command"
        " WHERE execution_id = ANY(%s) AND claimed_at IS NOT NULL", (ids,))}
    stored = {(eid, step): float(at) for eid, step, at in ctx.stack.sql(
        "SELECT execution_id, step, extract(epoch FROM max(created_at)) FROM noetl.result_ref"
        " WHERE execution_id = ANY(%s) GROUP BY 1, 2", (ids,))}
    projected = {eid: float(at) for eid, at in ctx.stack.sql(
        "SELECT execution_id, extract(epoch FROM updated_at) FROM noetl.execution WHERE execution_id = ANY(%s)",
        (ids,))}
    parts: dict[str, list[float]] = {k: [] for k in (
        "submit -> request committed", "request committed -> step a entered", "step a (enter -> next enter)",
        "step b (enter -> next enter)", "step c (enter -> completed)", "completed -> client saw it",
        "step b: entered -> claimed", "step b: claimed -> result stored", "step b: result stored -> c entered",
        "completed -> projected (the projector's transaction)")}
    for eid in ids:
        e = ev.get(eid, {})
        try:
            r = float(req[eid])
            a, b, c = e["step.enter:a"], e["step.enter:b"], e["step.enter:c"]
            done = next(v for k, v in e.items() if k.startswith("playbook.completed"))
        except (KeyError, StopIteration):
            continue
        vals = [r - sent_at[eid], a - r, b - a, c - b, done - c, seen_at[eid] - done]
        if (eid, "b") in claimed and (eid, "b") in stored and eid in projected:
            vals += [claimed[eid, "b"] - b, stored[eid, "b"] - claimed[eid, "b"], c - stored[eid, "b"],
                     projected[eid] - done]
        for k, v in zip(parts, vals, strict=False):
            parts[k].append(v * 1000)
    return {k: round(statistics.median(v), 2) for k, v in parts.items() if v}
