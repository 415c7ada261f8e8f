"""Shard-manager leader failover: two shard-manager replicas, the leader SIGKILLed; the
standby takes the leader lease within one lease (+ a tick), and work goes on: running
and new executions complete, and a crashed api's shards are reassigned by the new leader."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from chaos import Db, chain, leader_other_than, owner, process_of, stack_for
from harness import Runner
from waiting import until_sync

pytestmark = pytest.mark.e2e

LEASE_SEC = 3.0
TICK_SEC = 0.5  # the leader loop ticks every min(heartbeat, 1) / 2
SIX = chain("leader-six", 6, 0.5)


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    with stack_for("leader", {"shard-manager": 2, "api": 2}) as r:
        yield r


def test_standby_shard_manager_takes_over_and_keeps_assigning(runner: Runner, db: Db) -> None:
    state = runner.state
    leader = until_sync(lambda: leader_other_than(db, ""), timeout=20, what="a leader")
    victim = process_of(state, leader["holder_instance"])
    standby = next(p for p in state.processes("shard-manager") if p is not victim)
    running = runner.submit(SIX).execution_id
    until_sync(lambda: db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s"
                                " AND event_type = 'step.enter'", (running,)),
               timeout=20, what="the execution to start")

    t0 = time.monotonic()
    state.kill("shard-manager", victim.index)
    new = until_sync(lambda: leader_other_than(db, victim.instance),
                     timeout=15, what="the standby to take the leader lease")
    failover = time.monotonic() - t0
    print(f"\nshard-manager leader {victim.instance}@{leader['epoch']} -> {new['holder_instance']}@{new['epoch']}"
          f" in {failover:.2f}s")
    assert new["holder_instance"] == standby.instance and new["epoch"] == leader["epoch"] + 1
    assert failover <= LEASE_SEC + TICK_SEC + 0.5, f"leader failover took {failover:.2f}s"

    # work continues: the running execution and one submitted after the kill complete
    after = runner.submit(SIX).execution_id
    assert runner.wait(running, 60).status == "COMPLETED"
    assert runner.wait(after, 60).status == "COMPLETED"

    # an api crash is handled by the new leader: its shards go to the surviving api
    probe = runner.submit(SIX).execution_id
    shard = db.shard_of(probe)
    until_sync(lambda: db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s"
                                " AND event_type = 'step.enter'", (probe,)) >= 2,
               timeout=20, what="the probe to be mid-run")
    before = owner(db, "api", shard)
    dead_api = process_of(state, before.instance)
    held = [r["shard_id"] for r in db.all("SELECT shard_id FROM noetl.shard_lease WHERE role = 'api'"
                                          " AND owner_runtime_id = %s", (before.runtime_id,))]
    state.kill("api", dead_api.index)
    survivor = next(p for p in state.processes("api") if p is not dead_api)

    def reassigned() -> bool:
        return all(owner(db, "api", s).instance == survivor.instance for s in held)

    until_sync(reassigned, timeout=15, what=f"{dead_api.instance}'s shards {held} to move to {survivor.instance}")
    assert owner(db, "api", shard).epoch > before.epoch
    assert "declared dead" in open(standby.log).read()
    assert runner.wait(probe, 60).status == "COMPLETED"
    db.assert_routed_once(probe)
    db.assert_shard_log_intact(shard)
