"""Recovery: a stack with 2 api replicas and fast failover (heartbeat 1 s, lease 3 s)
runs an N-item parallel loop; once a share of the iterations is in, the api replica
that owns the execution's shard (``noetl.shard_lease`` -> ``noetl.runtime``) is killed
with SIGKILL (its whole process group). Measured from the log (Postgres clock):

* resume: the kill -> the first iteration result accepted by the new owner (an event
  with a later ``meta.lease_epoch``), and the gap between the last result accepted
  before the kill and that one;
* duplicates: commands with more than one accepted ``call.done`` (must be 0), and
  ``loop_result`` rows == items (distinct indexes), sum of the results;
* replayed inputs: ``noetl_engine_replayed_inputs_total{shard}`` on the new owner;
* for information: redeliveries recorded as ``call.duplicate`` (refused, not accepted),
  and iterations that ran more than once on workers (``attempt`` > 1).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..machine import ProcSampler
from ..playbooks import fan_out, fan_out_expected_sum
from ..stack import BenchError
from .common import Ctx, LoopRun, deadline_for, follow, verify_loop

WIDTH = 16


def _owner(ctx: Ctx, shard: int) -> tuple[str, int, int]:
    row = ctx.stack.sql(
        "SELECT r.instance, l.owner_runtime_id, l.epoch FROM noetl.shard_lease l LEFT JOIN noetl.runtime r"
        " ON r.runtime_id = l.owner_runtime_id WHERE l.role = 'api' AND l.shard_id = %s", (shard,))
    if not row or not row[0][0]:
        raise BenchError(f"no api owner for shard {shard}")
    return str(row[0][0]), int(row[0][1]), int(row[0][2])


def _wait(cond: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def run(ctx: Ctx) -> dict[str, Any]:
    stack, n = ctx.stack, ctx.plan.recovery_items
    apis = stack.st.processes("api")
    if len(apis) < 2:
        raise BenchError("the recovery scenario needs 2+ api replicas")
    shards = int(stack.scalar("SELECT count(*) FROM noetl.shard_lease WHERE role = 'api'") or 0)

    def balanced() -> bool:
        held = dict(stack.sql("SELECT r.instance, count(*) FROM noetl.shard_lease l JOIN noetl.runtime r"
                              " ON r.runtime_id = l.owner_runtime_id WHERE l.role = 'api' AND r.status = 'alive'"
                              " GROUP BY 1"))
        return set(held) == {p.instance for p in apis} and sum(held.values()) == shards

    _wait(balanced, 60, "api shards spread over both replicas", 0.2)
    playbook = fan_out(WIDTH)
    ctx.progress.start(f"recovery: {n:,}-item loop, max_in_flight {WIDTH}; SIGKILL of the shard's api owner at "
                       f"{ctx.plan.recovery_kill_at:.0%}", n, "iterations")
    def roots() -> dict[str, list[int]]:  # the api replicas apart
        out = stack.roots()
        out.pop("api", None)
        for p in stack.st.processes("api"):
            if p.alive():
                out[p.instance] = [p.pid]
        return out

    t0 = time.monotonic()
    before = ProcSampler(roots, interval=0.5, flat=frozenset({"bench-client"}))
    before.start()
    eid = stack.submit(playbook, {"n": n})
    shard = int(stack.scalar("SELECT shard_id FROM noetl.execution_request WHERE execution_id = %s", (eid,)))
    instance, runtime_id, epoch = _owner(ctx, shard)
    victim = stack.process_of(instance)
    survivor = stack.api_without(victim)
    kill_at = int(n * ctx.plan.recovery_kill_at)
    count_sql = "SELECT count(*) FROM noetl.loop_result WHERE execution_id = %s"
    def reached() -> bool:
        done = int(stack.scalar(count_sql, (eid,)) or 0)
        ctx.progress.update(done)
        return done >= kill_at

    _wait(reached, deadline_for(n), f"{kill_at} iterations", 0.1)
    before.stop()
    killed_db = stack.scalar("SELECT clock_timestamp()")
    killed_mono = time.monotonic()
    victim.kill()  # SIGKILL to the replica's process group
    ctx.progress.say(f"recovery: killed {instance} (owner of shard {shard}, epoch {epoch}) after "
                     f"{stack.scalar(count_sql, (eid,))} iterations")

    def new_owner() -> tuple[str, int, int] | None:
        got = _owner(ctx, shard)
        return got if got[2] > epoch and got[1] != runtime_id else None

    after = _wait(new_owner, 30, f"a new owner of shard {shard}", 0.05)
    moved_mono = time.monotonic()

    def first_new() -> Any:
        return stack.sql("SELECT min(created_at) FROM noetl.event WHERE execution_id = %s AND event_type = 'call.done'"
                         " AND (meta->>'lease_epoch')::bigint > %s", (eid, epoch))[0][0]

    first_after = _wait(first_new, 30, "the new owner's first accepted iteration", 0.05)
    seen_mono = time.monotonic()
    after_sampler = ProcSampler(roots, interval=0.5, flat=frozenset({"bench-client"}))
    after_sampler.start()
    remaining = deadline_for(n) - (time.monotonic() - t0)
    box: list[Any] = []
    threading.Thread(target=lambda: box.append(follow(ctx, eid, t0, n, time.monotonic() + remaining, count_sql,
                                                      api=survivor)), daemon=True).start()
    _wait(lambda: box, remaining + 30, "the loop to finish", 0.2)
    after_sampler.stop()
    term = box[0]
    run_ = LoopRun(eid, t0, term, term.at - t0, 0.0)
    checked = verify_loop(ctx, run_, n, fan_out_expected_sum(n), strict=False)
    last_before = stack.scalar(
        "SELECT max(created_at) FROM noetl.event WHERE execution_id = %s AND event_type = 'call.done'"
        " AND (meta->>'lease_epoch')::bigint <= %s", (eid, epoch))
    new_proc = stack.process_of(after[0])
    replayed = sum(v for labels, v in stack.samples(stack.scrape(new_proc), "noetl_engine_replayed_inputs_total")
                   if labels.get("shard") == str(shard))
    rates = stack.sql(
        "SELECT count(*) FILTER (WHERE created_at <= %s), extract(epoch FROM %s - min(created_at)),"
        " count(*) FILTER (WHERE (meta->>'lease_epoch')::bigint > %s),"
        " extract(epoch FROM max(created_at) - min(created_at) FILTER (WHERE (meta->>'lease_epoch')::bigint > %s))"
        " FROM noetl.event WHERE execution_id = %s AND event_type = 'call.done'",
        (killed_db, killed_db, epoch, epoch, eid))[0]
    before_rate = float(rates[0]) / float(rates[1]) if rates[1] else None
    after_rate = float(rates[2]) / float(rates[3]) if rates[3] else None
    rerun = int(stack.scalar("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND attempt > 1", (eid,)) or 0)
    refused = int(checked["events_by_type"].get("call.duplicate", 0))
    survivor.close()
    ctx.progress.finish()
    return {
        "items": n, "max_in_flight": WIDTH, "execution_id": eid, "shard": shard,
        "killed": {"instance": instance, "epoch": epoch, "after_iterations": kill_at},
        "new_owner": {"instance": after[0], "epoch": after[2]},
        "resume_s": round((first_after - killed_db).total_seconds(), 3),
        "gap_s": round((first_after - last_before).total_seconds(), 3) if last_before else None,
        "reassigned_after_s": round(moved_mono - killed_mono, 3),
        "observed_resume_s": round(seen_mono - killed_mono, 3),
        "duplicated_iterations": checked["duplicated_commands"],
        "replayed_inputs": replayed, "refused_redeliveries": refused, "iterations_rerun": rerun,
        "wall_s": round(run_.wall_s, 3), "events": checked["events"],
        "cpu_cores_before_kill": {k: v["cores"] for k, v in before.summary()["trees"].items()},
        "cpu_cores_after_resume": {k: v["cores"] for k, v in after_sampler.summary()["trees"].items()},
        "iterations_per_s_before_kill": round(before_rate, 1) if before_rate else None,
        "iterations_per_s_after_resume": round(after_rate, 1) if after_rate else None,
        "check": (f"COMPLETED; {n:,} loop_result rows, distinct indexes, all ok; sum of results = "
                  f"{fan_out_expected_sum(n):,}; accepted call.done per command counted"),
    }
