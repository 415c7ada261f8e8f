"""Epoch barriers: the checkpointer asks, the engine appends `checkpoint.committed`
exactly once per epoch, the checkpointer seals once the projection passed it; every
event carries meta.epoch_id."""

from __future__ import annotations

import json
import time

import pytest
from harness import Runner

pytestmark = pytest.mark.e2e

PLAYBOOK = ("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: cp, path: tests/checkpoints}\n"
            "workflow:\n  - step: start\n    tool: {kind: noop}\n")


def test_barrier_is_appended_once_per_epoch_and_sealed(runner: Runner) -> None:
    out = runner.run(PLAYBOOK)
    events = runner.events(out.execution_id)
    shard, last = events[0].shard_id, events[-1].shard_seq
    deadline = time.monotonic() + 20
    while True:
        sealed = runner.sql("SELECT epoch, last_shard_seq FROM noetl.checkpoint WHERE shard_id = %s"
                            " ORDER BY epoch DESC LIMIT 1", (shard,))
        if sealed and sealed[0][1] >= last:
            break
        assert time.monotonic() < deadline, f"shard {shard} not sealed past {last}: {sealed}"
        time.sleep(0.1)
    epoch, sealed_seq = sealed[0]
    barrier = runner.sql("SELECT shard_seq, meta FROM noetl.event WHERE shard_id = %s"
                         " AND event_type = 'checkpoint.committed' AND (meta->>'checkpoint_epoch')::bigint = %s",
                         (shard, epoch))
    assert len(barrier) == 1 and barrier[0][0] == sealed_seq
    dupes = runner.sql("SELECT meta->>'checkpoint_epoch', count(*) FROM noetl.event"
                       " WHERE event_type = 'checkpoint.committed' GROUP BY 1 HAVING count(*) > 1")
    assert dupes == []
    # every event of the execution carries the checkpoint epoch it was appended in
    assert all("epoch_id" in json.loads(e.meta_json) for e in events)
    # the projection had passed the barrier when it was sealed
    projected = runner.sql("SELECT last_shard_seq FROM noetl.projection_checkpoint WHERE shard_id = %s", (shard,))
    assert projected[0][0] >= sealed_seq


def test_idle_shards_are_not_barriered_again(runner: Runner) -> None:
    """Once a shard is sealed up to its last event, no new barrier is requested."""
    out = runner.run(PLAYBOOK)
    shard = runner.events(out.execution_id)[0].shard_id
    deadline = time.monotonic() + 20
    while True:
        row = runner.sql("SELECT l.event_seq, (SELECT max(last_shard_seq) FROM noetl.checkpoint c"
                         " WHERE c.shard_id = l.shard_id) FROM noetl.shard_lease l WHERE role = 'api'"
                         " AND shard_id = %s", (shard,))[0]
        if row[1] is not None and row[1] == row[0]:
            break
        assert time.monotonic() < deadline, row
        time.sleep(0.1)
    count = runner.sql("SELECT count(*) FROM noetl.event WHERE shard_id = %s"
                       " AND event_type = 'checkpoint.committed'", (shard,))[0][0]
    time.sleep(2.5)  # a few checkpoint intervals: nothing new may be appended on an idle shard
    again = runner.sql("SELECT count(*) FROM noetl.event WHERE shard_id = %s"
                       " AND event_type = 'checkpoint.committed'", (shard,))[0][0]
    assert again == count
