"""Tools are at-least-once: a worker's result can reach the engine twice (a publish retried
after a lost ack, a re-issued command whose first worker was only slow). The duplicate is
recorded (``call.duplicate``) and ignored, never routed twice.

The test takes a real worker's ``CallResult`` from the NATS events stream
(``noetl.events.{shard}.call``) after the engine accepted it and publishes it again under
a different ``Nats-Msg-Id`` (the same id would be swallowed by JetStream's dedup window,
which is checked too), once while the execution still runs and once after it completed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos import HEADER, Db, StreamMsg, stack_for, stream_messages, stream_publish
from harness import Runner
from waiting import until_sync

from noetl_common import natsio
from noetl_proto.v1 import messages_pb2

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    with stack_for("duplicates", {}) as r:
        yield r


def playbook(gate: Path) -> str:
    """start -> slow (runs until the test opens ``gate``) -> last."""
    return HEADER.format(name="duplicates") + (
        "workflow:\n"
        "  - step: start\n"
        "    tool: {kind: python, code: \"result = {'n': 1}\"}\n"
        "    next: {arcs: [{step: slow}]}\n"
        "  - step: slow\n"
        "    tool:\n      kind: python\n      code: |\n"
        "        import os, time\n"
        "        deadline = time.monotonic() + 90\n"
        f"        while not os.path.exists({str(gate)!r}) and time.monotonic() < deadline:\n"
        "            time.sleep(0.05)\n"
        "        result = 2\n"
        "    next: {arcs: [{step: last}]}\n"
        "  - step: last\n"
        "    tool: {kind: python, code: 'result = 3'}\n")


def results_of(runner: Runner, shard: int, command_id: str) -> list[StreamMsg]:
    """The CallResults published for ``command_id`` on the shard's call subject."""
    found = []
    for msg in stream_messages(runner.state, natsio.events_subject(shard, natsio.KIND_CALL)):
        inp = messages_pb2.EngineInput.FromString(msg.data)
        if inp.WhichOneof("input") == "call_result" and inp.call_result.command_id == command_id:
            found.append(msg)
    return found


def events_of(db: Db, execution_id: int, event_type: str, command_id: str) -> list[dict[str, Any]]:
    return db.all("SELECT shard_seq, step, result, meta FROM noetl.event WHERE execution_id = %s"
                  " AND event_type = %s AND command_id = %s ORDER BY shard_seq", (execution_id, event_type, command_id))


def replay(runner: Runner, original: StreamMsg, tag: str) -> None:
    """Publish ``original`` again: under its own Msg-Id JetStream drops it; under another it is stored."""
    url = runner.state
    own_id = original.headers.get("Nats-Msg-Id", "")
    assert own_id, f"the worker published without a Msg-Id: {original.headers}"
    assert stream_publish(url, original.subject, original.data, own_id).duplicate is True
    ack = stream_publish(url, original.subject, original.data, f"{own_id}#{tag}")
    assert not ack.duplicate and ack.seq > original.seq


def test_a_duplicate_result_is_recorded_and_never_routed_twice(runner: Runner, db: Db, tmp_path: Path) -> None:
    gate = tmp_path / "open"
    eid = runner.submit(playbook(gate)).execution_id
    shard = db.shard_of(eid)
    start_cmd, last_cmd = f"{eid}:start:1", f"{eid}:last:1"

    # the engine accepted start's result and routed it: slow is running
    until_sync(lambda: events_of(db, eid, "step.enter", f"{eid}:slow:1"),
               timeout=30, what="the step after start to be entered")
    [accepted] = events_of(db, eid, "call.done", start_cmd)
    [original] = results_of(runner, shard, start_cmd)  # the worker published it once
    assert messages_pb2.EngineInput.FromString(original.data).call_result.attempt == 1

    # the same result again while the execution runs
    replay(runner, original, "dup-running")
    [dup] = until_sync(lambda: events_of(db, eid, "call.duplicate", start_cmd),
                       timeout=30, what="the duplicate to be recorded")
    assert dup["meta"]["reason"] == "not pending" and dup["meta"]["attempt"] == 1
    assert dup["result"] == accepted["result"] and dup["shard_seq"] > accepted["shard_seq"]
    assert len(results_of(runner, shard, start_cmd)) == 2  # it really reached the engine's stream

    gate.touch()
    out = runner.wait(eid, 90)
    assert out.status == "COMPLETED", out.error
    assert (out.result("start"), out.result("slow"), out.result("last")) == ({"n": 1}, 2, 3)
    assert out.steps["start"]["visits"] == 1 and out.steps["slow"]["visits"] == 1

    # the duplicate was folded while slow still ran (not a late no-op), and changed nothing
    slow_done = events_of(db, eid, "call.done", f"{eid}:slow:1")[0]
    assert dup["shard_seq"] < slow_done["shard_seq"]
    assert len(events_of(db, eid, "call.done", start_cmd)) == 1
    assert len(events_of(db, eid, "step.enter", f"{eid}:slow:1")) == 1
    counts = db.assert_routed_once(eid)
    assert counts["step.enter"] == 3 and counts["call.done"] == 3 and counts["call.duplicate"] == 1, counts
    assert counts.get("command.reissued", 0) == 0

    # and once more after the execution completed: recorded, still nothing routed
    [last_result] = results_of(runner, shard, last_cmd)
    replay(runner, last_result, "dup-terminal")
    [late] = until_sync(lambda: events_of(db, eid, "call.duplicate", last_cmd),
                        timeout=30, what="the late duplicate to be recorded")
    assert late["meta"]["reason"] == "terminal"
    counts = db.assert_routed_once(eid)
    assert counts["step.enter"] == 3 and counts["call.done"] == 3 and counts["call.duplicate"] == 2, counts
    assert runner.wait(eid, 10).status == "COMPLETED"

    db.assert_shard_log_intact(shard)
    db.wait_projected()
    db.assert_projection_is_a_fold(eid)
    projected = {r["step"]: r for r in db.all("SELECT step, status, visits, attempts, result_ref_id"
                                              " FROM noetl.execution_step WHERE execution_id = %s", (eid,))}
    assert projected["start"]["visits"] == 1 and projected["start"]["status"] == "COMPLETED"
    assert projected["start"]["result_ref_id"] == accepted["result"]["reference"]["ref_id"]
