"""Worker crashes: a worker SIGKILLed in the middle of a long task loses its claim lease,
the reaper reports it, the engine re-issues the command (attempt 2) and the execution
completes; a task that always kills its worker is dead-lettered after
NOETL_COMMAND_MAX_ATTEMPTS attempts and fails the execution naming the step; a task that
runs for several claim leases on a live worker is never reaped."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos import HEADER, Db, process_of, stack_for, stream_messages
from harness import Runner, metric_sum
from waiting import until_sync

from noetl_cli import devstack
from noetl_common import natsio
from noetl_proto.v1 import messages_pb2

pytestmark = pytest.mark.e2e

MAX_ATTEMPTS = 3
COMMAND_LEASE_SEC = 2


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    env = {"NOETL_COMMAND_LEASE_SEC": str(COMMAND_LEASE_SEC), "NOETL_COMMAND_MAX_ATTEMPTS": str(MAX_ATTEMPTS)}
    with stack_for("worker", {"worker": 2}, env) as r:
        yield r


class Resurrector:
    """Restarts every worker replica that died, recording how it died."""

    def __init__(self, state: devstack.StackState) -> None:
        self.state = state
        self.deaths: list[tuple[str, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Resurrector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.state.processes("worker"):
                if not p.alive():
                    self.deaths.append((p.instance, p.exit_code()))
                    try:
                        self.state.restart("worker", p.index)
                    except devstack.StackError:
                        # The restarted worker may claim the re-issued command and be killed by
                        # it before it reports SERVING: that death is seen on the next pass.
                        continue
            self._stop.wait(0.05)


def claimed(db: Db, execution_id: int) -> dict[str, Any] | None:
    return db.one("SELECT command_id, worker_id, attempt FROM noetl.command WHERE execution_id = %s"
                  " AND status = 'claimed'", (execution_id,))


def test_worker_killed_mid_task_is_reissued_after_its_lease(runner: Runner, db: Db, tmp_path: Path) -> None:
    state = runner.state
    marks = tmp_path  # the task drops a file here when it starts
    text = HEADER.format(name="long") + (
        "workflow:\n  - step: start\n    tool:\n      kind: python\n      code: |\n"
        "        import os, time\n"
        f"        open(os.path.join({str(marks)!r}, str(os.getpid())), 'w').close()\n"
        "        time.sleep(4)\n"
        "        result = 'slept'\n")
    eid = runner.submit(text).execution_id
    first = until_sync(lambda: claimed(db, eid), timeout=20, what="the command to be claimed")
    assert first["attempt"] == 1
    until_sync(lambda: any(marks.iterdir()), timeout=20, what="the task to start running")  # mid-task now
    victim = process_of(state, first["worker_id"])
    assert victim.role == "worker"
    state.kill("worker", victim.index)
    until_sync(lambda: not victim.alive(), timeout=10, what=f"{victim.instance} to die")
    killed = time.monotonic()
    reissued = until_sync(lambda: db.one(
        "SELECT meta FROM noetl.event WHERE execution_id = %s AND event_type = 'command.reissued'", (eid,)),
        timeout=COMMAND_LEASE_SEC + 10, what="the command to be re-issued")
    print(f"\nre-issued {time.monotonic() - killed:.2f}s after the worker died (claim lease {COMMAND_LEASE_SEC}s)")
    assert reissued["meta"]["attempt"] == 2 and "lease expired" in reissued["meta"]["reason"]
    state.restart("worker", victim.index)

    out = runner.wait(eid, 60)
    assert out.status == "COMPLETED" and out.result("start") == "slept"
    assert out.steps["start"]["attempts"] == 2
    done = db.all("SELECT meta FROM noetl.event WHERE execution_id = %s AND event_type = 'call.done'", (eid,))
    assert len(done) == 1 and done[0]["meta"]["attempt"] == 2
    db.assert_routed_once(eid)
    assert db.value("SELECT attempt FROM noetl.command WHERE execution_id = %s", (eid,)) == 2
    db.wait_projected()
    db.assert_projection_is_a_fold(eid)


def test_task_that_kills_its_worker_is_dead_lettered(runner: Runner, db: Db) -> None:
    state = runner.state
    text = HEADER.format(name="crash") + (
        "workflow:\n  - step: start\n    tool: {kind: noop}\n    next: {arcs: [{step: boom}]}\n"
        "  - step: boom\n    tool:\n      kind: python\n      code: |\n"
        "        import os, signal, time\n"
        "        os.kill(os.getppid(), signal.SIGKILL)\n"
        "        time.sleep(30)\n")
    dead_letters = metric_sum(state, "api", "noetl_engine_dead_letters_total")
    with Resurrector(state) as supervisor:
        eid = runner.submit(text).execution_id
        out = runner.wait(eid, 120)
    assert out.status == "FAILED", out
    assert "'boom'" in out.error and "dead-lettered" in out.error, out.error
    assert out.steps["boom"]["status"] == "FAILED" and out.steps["boom"]["attempts"] == MAX_ATTEMPTS
    # every attempt killed the worker that ran it (SIGKILL from its own python child)
    assert len(supervisor.deaths) >= MAX_ATTEMPTS, supervisor.deaths
    assert all(code == -signal.SIGKILL for _, code in supervisor.deaths), supervisor.deaths
    reissues = [r["meta"]["attempt"] for r in db.all(
        "SELECT meta FROM noetl.event WHERE execution_id = %s AND event_type = 'command.reissued'"
        " ORDER BY shard_seq", (eid,))]
    assert reissues == list(range(2, MAX_ATTEMPTS + 1))
    dead = db.all("SELECT step, meta FROM noetl.event WHERE execution_id = %s"
                  " AND event_type = 'command.dead_lettered'", (eid,))
    assert len(dead) == 1 and dead[0]["step"] == "boom" and dead[0]["meta"]["attempt"] == MAX_ATTEMPTS
    assert db.value("SELECT status FROM noetl.command WHERE execution_id = %s AND step = 'boom'", (eid,)) == "dead"
    # counted by the engine that appended it (noetl_engine_dead_letters_total, the alert's metric)
    assert metric_sum(state, "api", "noetl_engine_dead_letters_total") == dead_letters + 1
    db.assert_routed_once(eid)
    db.wait_projected()
    db.assert_projection_is_a_fold(eid)
    # the workers are back and serve
    until_sync(lambda: all(p.alive() for p in state.processes("worker")), timeout=30, what="every worker up again")
    ok = runner.run(HEADER.format(name="after") + "workflow:\n  - step: start\n    tool: {kind: python, code: 'result = 7'}\n")
    assert ok.status == "COMPLETED" and ok.result("start") == 7


LONG_TASK_SEC = 7  # well past the 2 s claim lease


def test_a_long_task_is_never_reaped(runner: Runner, db: Db) -> None:
    """A task running for several claim leases keeps its claim: the worker renews it every
    lease/3, so the reaper (running, owning the shard) never reports it and the engine
    never re-issues it."""
    text = HEADER.format(name="marathon") + (
        "workflow:\n  - step: start\n    tool:\n      kind: python\n      code: |\n"
        "        import time\n"
        f"        time.sleep({LONG_TASK_SEC})\n"
        "        result = 'finished'\n"
        "    next: {arcs: [{step: after}]}\n"
        "  - step: after\n    tool: {kind: noop}\n")
    eid = runner.submit(text).execution_id
    shard = db.shard_of(eid)
    command = f"{eid}:start:1"
    first = until_sync(lambda: claimed(db, eid), timeout=20, what="the command to be claimed")
    assert first["command_id"] == command and first["attempt"] == 1
    reaper = db.lease("reaper", shard)
    assert reaper["owner_runtime_id"] and reaper["status"] == "alive", f"no live reaper owns shard {shard}"

    # while it runs, one claim (same worker, attempt 1) whose lease keeps moving forward
    samples: list[dict[str, Any]] = []

    def sampled_to_the_end() -> bool:
        row = db.one("SELECT status, attempt, worker_id, lease_until FROM noetl.command WHERE command_id = %s",
                     (command,))
        assert row is not None
        if row["status"] != "claimed":
            return True
        samples.append(row)
        return False

    until_sync(sampled_to_the_end, timeout=LONG_TASK_SEC + 120, what="the long task to end its claim", interval=0.25)
    assert {(s["attempt"], s["worker_id"]) for s in samples} == {(1, first["worker_id"])}, samples
    renewals = sorted({s["lease_until"] for s in samples})
    assert len(renewals) >= 3, f"the claim lease was not renewed while the task ran: {renewals}"
    assert (renewals[-1] - renewals[0]).total_seconds() > COMMAND_LEASE_SEC

    out = runner.wait(eid, 60)
    assert out.status == "COMPLETED", out.error
    assert out.result("start") == "finished" and out.steps["start"]["attempts"] == 1
    counts = db.assert_routed_once(eid)
    assert counts.get("command.reissued", 0) == 0 and counts.get("command.dead_lettered", 0) == 0, counts
    assert counts.get("call.duplicate", 0) == 0, counts
    done = db.all("SELECT created_at, meta FROM noetl.event WHERE execution_id = %s AND event_type = 'call.done'"
                  " AND command_id = %s", (eid, command))
    assert len(done) == 1 and done[0]["meta"]["attempt"] == 1
    entered = db.value("SELECT created_at FROM noetl.event WHERE execution_id = %s AND event_type = 'step.enter'"
                       " AND command_id = %s", (eid, command))
    ran = (done[0]["created_at"] - entered).total_seconds()
    assert ran > 3 * COMMAND_LEASE_SEC, f"the task ran {ran:.1f}s: not long enough to prove anything"
    assert db.one("SELECT status, attempt FROM noetl.command WHERE command_id = %s", (command,)) == {
        "status": "done", "attempt": 1}
    # the reaper never even reported it to the engine
    reports = [messages_pb2.EngineInput.FromString(m.data).expired for m in
               stream_messages(runner.state, natsio.events_subject(shard, natsio.KIND_EXPIRED))]
    assert [r for r in reports if r.command_id == command] == []
    db.wait_projected()
    db.assert_projection_is_a_fold(eid)
