"""Failover with processes killed for real (the meta-control acceptance tests).

One stack for the module (api=3, projector=2, worker=2) with fast leases (heartbeat
1 s, lease 3 s). Each test finds the replica that owns the shard of a running
execution through ``noetl.shard_lease`` -> ``noetl.runtime`` -> the launcher's
``ServiceProcess``, then crashes (SIGKILL) or freezes (SIGSTOP/SIGCONT) it, and checks:
another replica takes the shard over with a bumped epoch, the executions complete, each
command has exactly one accepted result, no step is entered twice, the shard's log stays
gap-free with lease epochs that never go back (a fenced-out zombie appended nothing),
and the read models equal a fresh fold of the log."""

from __future__ import annotations

import json
import signal
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from chaos import (
    Db,
    api_without,
    chain,
    log_has,
    moved,
    owner,
    process_of,
    samples,
    scrape,
    stack_for,
)
from harness import Runner
from waiting import until_sync

from noetl_cli import devstack
from noetl_cli.supervise import ServiceProcess

pytestmark = pytest.mark.e2e

SIX = chain("six", 6, 0.5)
SHARDS = 16
TAKEOVER_LIMIT_SEC = 5.0
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    with stack_for("failover", {"api": 3, "projector": 2, "worker": 2}) as r:
        yield r


def wait_balanced(db: Db, state: devstack.StackState, role: str) -> None:
    """Every shard of ``role`` owned by a live replica of the stack, within one of the fair share."""
    live = {p.instance for p in state.processes(role) if p.alive()}

    def balanced() -> bool:
        rows = db.all("SELECT r.instance, count(*) AS n FROM noetl.shard_lease l JOIN noetl.runtime r"
                      " ON r.runtime_id = l.owner_runtime_id WHERE l.role = %s AND r.status = 'alive'"
                      " GROUP BY 1", (role,))
        held = {r["instance"]: r["n"] for r in rows}
        return (set(held) == live and sum(held.values()) == SHARDS
                and max(held.values()) - min(held.values()) <= 1)

    until_sync(balanced, timeout=30, what=f"{role} shards balanced over {sorted(live)}")


def entered(db: Db, execution_id: int) -> int:
    return int(db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s AND event_type = 'step.enter'",
                        (execution_id,)))


def finished(db: Db, execution_id: int) -> bool:
    return bool(db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s AND event_type IN"
                         " ('playbook.completed', 'playbook.failed', 'playbook.cancelled')", (execution_id,)))


def new_epoch_event(db: Db, shard: int, old_epoch: int) -> dict[str, Any] | None:
    return db.one("SELECT shard_seq, created_at, (meta->>'lease_epoch')::bigint AS lease_epoch FROM noetl.event"
                  " WHERE shard_id = %s AND (meta->>'lease_epoch')::bigint > %s ORDER BY shard_seq LIMIT 1",
                  (shard, old_epoch))


def lease_lost_logged(proc: ServiceProcess, shard: int, epoch: int) -> bool:
    """The zombie noticed: its shard loop raised LeaseLost (trust window or fence), or the
    shard-manager made it rejoin and it dropped the shard."""
    return (log_has(proc, rf"shard {shard} epoch {epoch} (no longer trusted|is no longer held)")
            or log_has(proc, rf"shard {shard} lost while retrying")
            or log_has(proc, rf"asked \S+ to rejoin; dropping shards \[[^\]]*\b{shard}\b"))


def test_sigkill_of_the_engine_owner_hands_the_shard_over(runner: Runner, db: Db) -> None:
    state = runner.state
    wait_balanced(db, state, "api")
    eid = runner.submit(SIX).execution_id
    shard = db.shard_of(eid)
    until_sync(lambda: entered(db, eid) >= 2, timeout=30, what="the second step to be entered")
    before = owner(db, "api", shard)
    victim = process_of(state, before.instance)
    assert victim.role == "api" and victim.alive()

    t0 = time.monotonic()
    killed_at = db.now()
    state.kill("api", victim.index)
    after = until_sync(lambda: moved(db, "api", shard, before), timeout=15, what=f"a new owner of shard {shard}")
    first = until_sync(lambda: new_epoch_event(db, shard, before.epoch),
                       timeout=15, what="the new owner's first batch")
    observed = time.monotonic() - t0
    takeover = (first["created_at"] - killed_at).total_seconds()
    TIMINGS["api takeover (kill -> first batch)"] = takeover
    print(f"\nshard {shard}: {before.instance}@{before.epoch} -> {after.instance}@{after.epoch};"
          f" first batch {takeover:.2f}s after the kill (observed {observed:.2f}s)")
    assert after.instance != victim.instance and process_of(state, after.instance).alive()
    assert takeover < TAKEOVER_LIMIT_SEC, f"takeover took {takeover:.2f}s"
    assert not victim.alive()

    out = runner.wait(eid, 60)  # the multi-replica target still includes the dead replica
    assert out.status == "COMPLETED", out.error
    assert [out.result(s) for s in ("start", "s2", "s3", "s4", "s5", "s6")] == [1, 2, 3, 4, 5, 6]
    cli = runner.cli("status", str(eid), "--json")
    assert cli.returncode == 0 and "COMPLETED" in cli.stdout, cli.stderr
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as fh:  # a new run through the CLI, same target
        fh.write(chain("after-kill", 2, 0))
        fh.flush()
        cli = runner.cli("run", fh.name, "--json")
    assert cli.returncode == 0 and json.loads(cli.stdout)["status"] == "COMPLETED", (cli.stdout, cli.stderr)
    counts = db.assert_routed_once(eid)
    assert counts["step.enter"] == 6 and counts["call.done"] == 6, counts
    db.assert_shard_log_intact(shard)
    db.wait_projected()
    db.assert_projection_is_a_fold(eid)

    # the api that took over exports the replay counter for the shard
    text = scrape(process_of(state, after.instance))
    assert {"shard": str(shard)} in samples(text, "noetl_engine_replayed_inputs_total")
    state.restart("api", victim.index)
    wait_balanced(db, state, "api")


def test_sigstopped_engine_owner_is_fenced_out(runner: Runner, db: Db) -> None:
    state = runner.state
    wait_balanced(db, state, "api")
    first = runner.submit(SIX).execution_id
    shard = db.shard_of(first)
    until_sync(lambda: entered(db, first) >= 2, timeout=30, what="the second step to be entered")
    before = owner(db, "api", shard)
    zombie = process_of(state, before.instance)
    live = api_without(state, zombie)
    others = Runner(state)
    others.api = live
    try:
        t0 = time.monotonic()
        zombie.kill(signal.SIGSTOP)
        try:
            more = [others.submit(SIX).execution_id for _ in range(4)]
            after = until_sync(lambda: moved(db, "api", shard, before),
                               timeout=15, what=f"a new owner of shard {shard}")
            until_sync(lambda: new_epoch_event(db, shard, before.epoch),
                       timeout=15, what="the new owner's first batch")
            TIMINGS["api takeover from a frozen owner (stop -> first batch)"] = time.monotonic() - t0
            assert after.instance != zombie.instance
            # the new owner makes progress on the execution while the zombie is frozen
            progressed = entered(db, first)
            until_sync(lambda: entered(db, first) > progressed or finished(db, first), timeout=20,
                       what="progress under the new owner")
        finally:
            zombie.kill(signal.SIGCONT)
        until_sync(lambda: lease_lost_logged(zombie, shard, before.epoch), timeout=15,
                   what=f"{zombie.instance} to notice it lost shard {shard}")
        for eid in [first, *more]:
            out = others.wait(eid, 90)
            assert out.status == "COMPLETED", (eid, out.error)
            counts = db.assert_routed_once(eid)
            assert counts["step.enter"] == 6 and counts["call.done"] == 6, (eid, counts)
        rows = db.assert_shard_log_intact(shard)
        # nothing of the old epoch after the new owner's first event
        cut = next(r["shard_seq"] for r in rows if r["lease_epoch"] > before.epoch)
        assert all(r["lease_epoch"] > before.epoch for r in rows if r["shard_seq"] >= cut)
        # the zombie rejoined as a new member and serves again (its shards are rebalanced to it)
        until_sync(lambda: db.value("SELECT count(*) FROM noetl.runtime WHERE instance = %s AND status = 'alive'"
                                    " AND runtime_id <> %s", (zombie.instance, before.runtime_id)), timeout=15,
                   what=f"{zombie.instance} to rejoin")
        wait_balanced(db, state, "api")
        # and its engines work: an execution on each shard it now owns completes
        mine = [r["shard_id"] for r in db.all(
            "SELECT l.shard_id FROM noetl.shard_lease l JOIN noetl.runtime r ON r.runtime_id = l.owner_runtime_id"
            " WHERE l.role = 'api' AND r.instance = %s", (zombie.instance,))]
        assert mine
        probes: dict[int, int] = {}

        def a_probe_on_each() -> bool:
            eid = runner.submit(chain("probe", 1, 0)).execution_id
            probes.setdefault(db.shard_of(eid), eid)
            assert set(mine) <= set(probes), f"none yet on shards {sorted(set(mine) - set(probes))}"
            return True

        until_sync(a_probe_on_each, timeout=30, what=f"a probe on each of {zombie.instance}'s shards {mine}",
                   interval=0, ignoring=AssertionError)
        for s in mine:
            assert runner.wait(probes[s], 30).status == "COMPLETED"
        db.wait_projected()
        for eid in [first, *more]:
            db.assert_projection_is_a_fold(eid)
    finally:
        live.close()


def test_sigstopped_projector_is_fenced_out(runner: Runner, db: Db) -> None:
    state = runner.state
    wait_balanced(db, state, "projector")
    eid = runner.submit(SIX).execution_id
    shard = db.shard_of(eid)
    until_sync(lambda: entered(db, eid) >= 2, timeout=30, what="the second step to be entered")
    before = owner(db, "projector", shard)
    zombie = process_of(state, before.instance)
    zombie.kill(signal.SIGSTOP)
    try:
        more = [runner.submit(SIX).execution_id for _ in range(4)]
        after = until_sync(lambda: moved(db, "projector", shard, before),
                           timeout=15, what=f"a new projector for shard {shard}")
        assert after.instance != zombie.instance
        # the new owner projects the shard while the old one is frozen
        mark = int(db.value("SELECT event_seq FROM noetl.shard_lease WHERE role = 'api' AND shard_id = %s", (shard,)))
        until_sync(lambda: db.value("SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s",
                                    (shard,)) >= mark, timeout=15, what="projection by the new owner")
    finally:
        zombie.kill(signal.SIGCONT)
    until_sync(lambda: lease_lost_logged(zombie, shard, before.epoch), timeout=15,
               what=f"{zombie.instance} to notice it lost shard {shard}")
    for e in [eid, *more]:
        assert runner.wait(e, 90).status == "COMPLETED"
    wait_balanced(db, state, "projector")
    db.wait_projected()
    for e in [eid, *more]:
        db.assert_projection_is_a_fold(e)
    assert db.value("SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s", (shard,)) == \
        db.lease("api", shard)["event_seq"]


def test_meta_control_metrics_are_exported(runner: Runner, db: Db) -> None:
    state = runner.state
    db.wait_projected()
    sharded = [p for role in ("api", "projector", "checkpointer", "compactor", "reaper")
               for p in state.processes(role)]

    def every_member_exports_its_shards() -> dict[str, str] | None:
        # a member picks a new assignment up on its next heartbeat (a lost shard's series is
        # removed, so a member between a loss and its next gain exports none for a moment);
        # checkpoint age is reported once the checkpointer looked at a shard
        texts = {p.instance: scrape(p) for p in state.processes() if p.alive()}
        return texts if all(samples(texts[p.instance], "noetl_shard_owner") for p in sharded) else None

    texts = until_sync(every_member_exports_its_shards,
                       timeout=15, what="every sharded member to export noetl_shard_owner",
                       interval=0.5)
    for role in ("api", "projector", "checkpointer", "compactor", "reaper"):
        for p in state.processes(role):
            text = texts[p.instance]
            owned = samples(text, "noetl_shard_owner")
            assert owned and all({"role", "shard", "instance"} <= set(s) for s in owned), (p.instance, owned)
            assert {"role": role} in samples(text, "noetl_lease_renewals_total"), p.instance
            assert {"role": role} in samples(text, "noetl_lease_losses_total"), p.instance
    lag = [s for p in state.processes("projector") for s in samples(texts[p.instance], "noetl_projection_lag_seconds")]
    assert lag and all("shard" in s for s in lag)
    age = [s for p in state.processes("checkpointer") for s in samples(texts[p.instance], "noetl_checkpoint_age_seconds")]
    assert age and all("shard" in s for s in age)
    reaped = samples(texts[state.processes("reaper")[0].instance], "noetl_reaped_commands_total")
    assert {"reason": "lease_expired"} in reaped and {"reason": "republished"} in reaped
    replayed = [s for p in state.processes("api") for s in samples(texts[p.instance],
                                                                   "noetl_engine_replayed_inputs_total")]
    assert replayed, "no api exports noetl_engine_replayed_inputs_total after takeovers"


def test_zz_report_timings() -> None:
    for what, seconds in TIMINGS.items():
        print(f"\n{what}: {seconds:.2f}s")
