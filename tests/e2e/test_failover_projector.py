"""Projector scaling 1 -> 2 -> 1 while executions run continuously: shards move between
projectors (epoch bumps for role 'projector'), and afterwards no event was skipped or
folded wrongly: every execution's read model equals a fresh fold of its log, and every
shard's projection watermark equals its last ``shard_seq``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from chaos import Db, chain, samples, scrape, stack_for
from harness import Runner
from waiting import until_sync

pytestmark = pytest.mark.e2e

SHARDS = 16
QUICK = chain("quick", 3, 0.05)


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    with stack_for("projector", {"projector": 1, "worker": 2}) as r:
        yield r


class Load:
    """Submits executions back to back (a few in flight) until stopped."""

    def __init__(self, runner: Runner, in_flight: int = 4) -> None:
        self.runner = runner
        self.ids: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(in_flight)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                eid = self.runner.submit(QUICK).execution_id
                self.ids.append(eid)
                self.runner.wait(eid, 60)
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)
                return

    def submitted(self) -> int:
        return len(self.ids)


def projector_leases(db: Db) -> dict[int, tuple[str, int]]:
    return {r["shard_id"]: (r["instance"], r["epoch"]) for r in db.all(
        "SELECT l.shard_id, l.epoch, r.instance FROM noetl.shard_lease l LEFT JOIN noetl.runtime r"
        " ON r.runtime_id = l.owner_runtime_id WHERE l.role = 'projector'")}


def owned_only_by(db: Db, instance: str) -> dict[int, tuple[str, int]] | None:
    now = projector_leases(db)
    return now if len(now) == SHARDS and {o for o, _ in now.values()} == {instance} else None


def test_projector_scale_out_and_in_during_a_run(runner: Runner, db: Db) -> None:
    state = runner.state
    until_sync(lambda: owned_only_by(db, "projector-0"), timeout=20, what="projector-0 to own every shard")
    with Load(runner) as load:
        until_sync(lambda: load.submitted() >= 8, timeout=60, what="executions to run")
        start = projector_leases(db)

        extra = state.add_replica("projector")

        def split() -> dict[int, tuple[str, int]] | None:
            now = projector_leases(db)
            held = [s for s, (o, _) in now.items() if o == extra.instance]
            return now if len(held) == SHARDS // 2 else None

        scaled_out = until_sync(split, timeout=20, what=f"{extra.instance} to take half of the shards")
        moved = [s for s, (o, _) in scaled_out.items() if o == extra.instance]
        assert all(scaled_out[s][1] > start[s][1] for s in moved), "a shard moved without an epoch bump"
        # the new replica actually projects its shards while the load runs
        until_sync(lambda: sum(1 for s in samples(scrape(extra), "noetl_projected_events_total")
                               if int(s.get("shard", -1)) in moved) > 0,
                   timeout=30, what=f"{extra.instance} to project")
        mark = load.submitted()
        until_sync(lambda: load.submitted() >= mark + 8, timeout=60, what="more executions while two projectors run")

        state.stop("projector", extra.index)
        scaled_in = until_sync(lambda: owned_only_by(db, "projector-0"),
                               timeout=20, what="projector-0 to own every shard again")
        assert all(scaled_in[s][1] > scaled_out[s][1] for s in moved), "a shard moved back without an epoch bump"
        mark = load.submitted()
        until_sync(lambda: load.submitted() >= mark + 8, timeout=60, what="more executions after the scale-in")
    assert not load.errors, load.errors[:3]
    ids = list(load.ids)
    for eid in ids:
        assert runner.wait(eid, 60).status == "COMPLETED"
    db.wait_projected()
    for eid in ids:
        db.assert_routed_once(eid)
        db.assert_projection_is_a_fold(eid)
    for shard in range(SHARDS):
        db.assert_shard_log_intact(shard)
    print(f"\n{len(ids)} executions folded and projected identically across projector 1 -> 2 -> 1")
