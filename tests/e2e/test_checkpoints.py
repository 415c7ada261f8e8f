"""Epoch barriers: the checkpointer asks, the engine appends `checkpoint.committed`
exactly once per epoch, the checkpointer seals once the projection passed it; every
event carries meta.epoch_id."""

from __future__ import annotations

import time
import urllib.request

import pytest
from harness import Runner
from waiting import until_sync

from noetl_client import values

pytestmark = pytest.mark.e2e

PLAYBOOK = ("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: cp, path: tests/checkpoints}\n"
            "workflow:\n  - step: start\n    tool: {kind: noop}\n")


def test_barrier_is_appended_once_per_epoch_and_sealed(runner: Runner) -> None:
    out = runner.run(PLAYBOOK)
    events = runner.events(out.execution_id)
    shard, last = events[0].shard_id, events[-1].shard_seq

    def sealed_past_last() -> tuple[int, int]:
        sealed = runner.sql("SELECT epoch, last_shard_seq FROM noetl.checkpoint WHERE shard_id = %s"
                            " ORDER BY epoch DESC LIMIT 1", (shard,))
        assert sealed and sealed[0][1] >= last, f"last sealed: {sealed}"
        return sealed[0]

    epoch, sealed_seq = until_sync(sealed_past_last, timeout=20, what=f"shard {shard} sealed past {last}",
                                   interval=0.1, ignoring=AssertionError)
    barrier = runner.sql("SELECT shard_seq, meta FROM noetl.event WHERE shard_id = %s"
                         " AND event_type = 'checkpoint.committed' AND (meta->>'checkpoint_epoch')::bigint = %s",
                         (shard, epoch))
    assert len(barrier) == 1 and barrier[0][0] == sealed_seq
    dupes = runner.sql("SELECT meta->>'checkpoint_epoch', count(*) FROM noetl.event"
                       " WHERE event_type = 'checkpoint.committed' GROUP BY 1 HAVING count(*) > 1")
    assert dupes == []
    # every event of the execution carries the checkpoint epoch it was appended in
    assert all("epoch_id" in values.from_struct(e.meta) for e in events)
    # the projection had passed the barrier when it was sealed
    projected = runner.sql("SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s", (shard,))
    assert projected[0][0] >= sealed_seq


def test_idle_shards_are_not_barriered_again(runner: Runner) -> None:
    """Once a shard is sealed up to its last event, no new barrier is requested."""
    out = runner.run(PLAYBOOK)
    shard = runner.events(out.execution_id)[0].shard_id

    def sealed_to_the_end() -> bool:
        row = runner.sql("SELECT l.event_seq, (SELECT max(last_shard_seq) FROM noetl.checkpoint c"
                         " WHERE c.shard_id = l.shard_id) FROM noetl.shard_lease l WHERE role = 'api'"
                         " AND shard_id = %s", (shard,))[0]
        assert row[1] is not None and row[1] == row[0], f"(event_seq, sealed): {row}"
        return True

    until_sync(sealed_to_the_end, timeout=20, what=f"shard {shard} sealed up to its last event", interval=0.1,
               ignoring=AssertionError)
    count = runner.sql("SELECT count(*) FROM noetl.event WHERE shard_id = %s"
                       " AND event_type = 'checkpoint.committed'", (shard,))[0][0]
    time.sleep(2.5)  # a sleep, not a wait: a few checkpoint intervals in which an idle shard gets nothing new
    again = runner.sql("SELECT count(*) FROM noetl.event WHERE shard_id = %s"
                       " AND event_type = 'checkpoint.committed'", (shard,))[0][0]
    assert again == count


def _age_seconds(runner: Runner, shard: int) -> float | None:
    """noetl_checkpoint_age_seconds{shard} from the checkpointer(s) holding it."""
    for proc in runner.state.processes("checkpointer"):
        if not proc.metrics or not proc.alive():
            continue
        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(f'noetl_checkpoint_age_seconds{{shard="{shard}"}} '):
                    return float(line.rsplit(" ", 1)[1])
    return None


UNSEALED = ("SELECT count(*) FROM noetl.shard_lease l WHERE l.role = 'api' AND l.event_seq >"
            " COALESCE((SELECT max(last_shard_seq) FROM noetl.checkpoint c WHERE c.shard_id = l.shard_id), 0)")


def test_checkpoint_age_is_the_oldest_unsealed_events_age(runner: Runner) -> None:
    """The gauge is the age of the shard's oldest event not covered by a sealed checkpoint:
    0 when all are sealed, and a shard that sat idle reports how old its new work is, never
    its idle time (nor more than the log says the oldest event waited)."""
    idle = 6.0
    until_sync(lambda: not runner.sql(UNSEALED)[0][0], timeout=30, what="every shard sealed", interval=0.1)
    time.sleep(idle)  # a sleep, not a wait: every shard stays idle and sealed for `idle` s (the test's point)
    eid = runner.submit(PLAYBOOK).execution_id
    shard = int(runner.sql("SELECT shard_id FROM noetl.execution_request WHERE execution_id = %s", (eid,))[0][0])
    seen: list[float] = []

    def sealed_at_age_0() -> bool:
        age = _age_seconds(runner, shard)
        if age is None:  # not a "not yet": fails at once
            pytest.fail(f"no checkpoint age exported for shard {shard}")
        seen.append(age)
        assert not runner.sql(UNSEALED)[0][0] and age == 0.0, f"ages {seen[-5:]}"
        return True

    until_sync(sealed_at_age_0, timeout=30, what=f"shard {shard} sealed", ignoring=AssertionError)
    assert runner.wait(eid, 30).status == "COMPLETED"
    # how long the oldest event of the execution's epoch waited, from the log
    waited = runner.sql(
        "SELECT extract(epoch FROM c.sealed_at - min(e.created_at)) FROM noetl.event e"
        " JOIN noetl.checkpoint c ON c.shard_id = e.shard_id AND c.last_shard_seq >= e.shard_seq"
        " WHERE e.execution_id = %s AND c.epoch = (SELECT min(epoch) FROM noetl.checkpoint c2"
        "   WHERE c2.shard_id = e.shard_id AND c2.last_shard_seq >= e.shard_seq) GROUP BY c.sealed_at", (eid,))
    assert waited, "the execution's events were not sealed"
    assert max(seen) < idle, f"the gauge reported the idle time: {max(seen):.3f} s"
    assert max(seen) <= float(max(w for (w,) in waited)) + 0.25, (max(seen), waited)
