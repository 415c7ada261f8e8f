"""Schedules with the roles as processes (issue 15's acceptance).

One stack (reaper=2, fast leases: heartbeat 1 s, lease 3 s). A 1-second interval schedule
with catch-up ``all`` and one with ``once`` run while the reaper replica owning the first
is SIGKILLed (the other replica takes its shard over) and restarted, and then while every
reaper is SIGKILLed (nothing fires) and restarted. Afterwards:

* ``all``: every tick on the 1 s grid from the first to the last fired tick has exactly
  one row and exactly one execution (the execution submitted with the tick's idempotency
  key; no other execution carries the schedule's key prefix); no gap, no duplicate;
* ``once``: no duplicate either, and the stretch missed while every reaper was down
  became one run (the ``all`` schedule has several ticks there);
* the executions complete.

Also through the api: validation errors name the field, and only an admin changes
schedules."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from chaos import Db, moved, owner, process_of, stack_for
from harness import Runner, metric_sum, register_playbook
from waiting import until_sync

from noetl_cli.apichannel import Api
from noetl_client import values
from noetl_proto.v1 import schedule_pb2

pytestmark = pytest.mark.e2e

PLAYBOOK = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: tick, path: tests/schedules/tick}
workflow:
  - step: start
    tool: {kind: noop}
"""
SECOND = timedelta(seconds=1)
# needs a payload value the schedule below does not give: every submission is refused
NEEDS_PAYLOAD = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: needs, path: tests/schedules/needs}
workflow:
  - step: start
    tool: {kind: python, input: {x: "{{ needed }}"}, code: "result = x"}
"""


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    with stack_for("schedules", {"reaper": 2}) as r:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
            fh.write(PLAYBOOK)
        register_playbook(r, Path(fh.name))
        yield r


def add(runner: Runner, name: str, catch_up: str) -> dict[str, Any]:
    proc = runner.cli("schedule", "add", name, "--path", "tests/schedules/tick", "--every", "1",
                      "--catch-up", catch_up, "--payload", json.dumps({"schedule": name}), "--json")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def ticks(db: Db, schedule_id: int) -> list[dict[str, Any]]:
    return db.all("SELECT tick, fired_at, epoch, execution_id, error FROM noetl.schedule_tick WHERE schedule_id = %s"
                  " ORDER BY tick", (schedule_id,))


def submitted(db: Db, schedule_id: int) -> int:
    return int(db.value("SELECT count(*) FROM noetl.schedule_tick WHERE schedule_id = %s"
                        " AND execution_id IS NOT NULL", (schedule_id,)))


def fired_after(db: Db, schedule_id: int, at: Any, n: int) -> bool:
    """``n`` ticks after ``at`` were submitted."""
    return int(db.value("SELECT count(*) FROM noetl.schedule_tick WHERE schedule_id = %s AND tick > %s"
                        " AND execution_id IS NOT NULL", (schedule_id, at))) >= n


def executions_by_key(db: Db, schedule_id: int) -> dict[str, int]:
    rows = db.all("SELECT idempotency_key, execution_id FROM noetl.execution_request"
                  " WHERE idempotency_key LIKE %s", (f"schedule/{schedule_id}/%",))
    return {r["idempotency_key"]: r["execution_id"] for r in rows}


def test_one_execution_per_tick_across_sigkills_of_the_scheduling_role(runner: Runner, db: Db) -> None:
    state = runner.state
    every = add(runner, "every-second-all", "all")
    once = add(runner, "every-second-once", "once")
    assert len(every["next_runs"]) == 3
    a, b = every["schedule_id"], once["schedule_id"]
    until_sync(lambda: submitted(db, a) >= 3 and submitted(db, b) >= 3, timeout=30, what="the first ticks submitted")

    # 1. the reaper replica owning the `all` schedule's shard dies; the other takes it over
    before = owner(db, "reaper", every["shard_id"])
    victim = process_of(state, before.instance)
    victim.kill()
    killed_at = db.now()
    after = until_sync(lambda: moved(db, "reaper", every["shard_id"], before),
                       timeout=30, what="the reaper shard taken over")
    until_sync(lambda: fired_after(db, a, killed_at, 3), timeout=30, what="ticks fired by the new owner")
    state.restart("reaper", victim.index)

    # 2. every reaper dies: nothing fires until they are back
    for index in (0, 1):
        state.kill("reaper", index)
    down_at = db.now()
    until_sync(lambda: db.now() - down_at > 4 * SECOND, timeout=30, what="four ticks missed")
    for index in (0, 1):
        state.restart("reaper", index)
    back_at = db.now()
    until_sync(lambda: fired_after(db, a, back_at, 3) and fired_after(db, b, back_at, 2), timeout=60,
               what="ticks fired after the restart")

    for name in ("every-second-all", "every-second-once"):
        assert runner.cli("schedule", "pause", name).returncode == 0
    until_sync(lambda: not db.value("SELECT count(*) FROM noetl.schedule_tick WHERE schedule_id IN (%s, %s)"
                                    " AND execution_id IS NULL AND error IS NULL", (a, b)), timeout=30,
               what="every fired tick submitted")

    # all: the 1 s grid from the first tick to the last, once each, one execution each
    got = ticks(db, a)
    first, last = got[0]["tick"], got[-1]["tick"]
    grid = [first + i * SECOND for i in range(round((last - first) / SECOND) + 1)]
    assert [t["tick"] for t in got] == grid, "a tick missing or fired twice"
    assert all(t["error"] is None for t in got)
    keys = executions_by_key(db, a)
    assert len(keys) == len(got) and len(set(keys.values())) == len(got)
    assert sorted(keys.values()) == sorted(t["execution_id"] for t in got)
    assert {t["epoch"] for t in got if t["tick"] > killed_at} >= {after.epoch}, "the new owner fired ticks"
    # the first round after the outage (a reaper back) caught up on every tick missed
    resumed = min(t["fired_at"] for t in got if t["fired_at"] > down_at)
    assert len([t for t in got if down_at < t["tick"] <= resumed]) >= 4

    # once: no duplicates; the outage became one run
    got_once = ticks(db, b)
    assert len({t["tick"] for t in got_once}) == len(got_once)
    keys_once = executions_by_key(db, b)
    assert sorted(keys_once.values()) == sorted(t["execution_id"] for t in got_once)
    resumed = min(t["fired_at"] for t in got_once if t["fired_at"] > down_at)
    assert len([t for t in got_once if down_at < t["tick"] <= resumed]) == 1

    # the executions ran
    for execution_id in [got[0]["execution_id"], got[-1]["execution_id"], got_once[-1]["execution_id"]]:
        assert runner.wait(execution_id, timeout=60).status == "COMPLETED"
    # and the reapers say so
    assert metric_sum(state, "reaper", "noetl_schedule_fired_total") >= 1

    listed = json.loads(runner.cli("schedule", "list", "--json").stdout)
    paused = {s["name"]: s for s in listed}
    assert paused["every-second-all"]["paused"] is True and paused["every-second-all"]["next_runs"] == []
    assert paused["every-second-all"]["last_execution_id"] == got[-1]["execution_id"]


def test_a_tick_the_api_refuses_is_recorded_and_not_retried(runner: Runner, db: Db) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(NEEDS_PAYLOAD)
    register_playbook(runner, Path(fh.name))
    proc = runner.cli("schedule", "add", "refused", "--path", "tests/schedules/needs", "--every", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    sid = json.loads(proc.stdout)["schedule_id"]
    until_sync(lambda: int(db.value("SELECT count(*) FROM noetl.schedule_tick WHERE schedule_id = %s"
                                    " AND error IS NOT NULL", (sid,))) >= 2,
               timeout=30, what="refused ticks recorded")
    refused = db.all("SELECT execution_id, error FROM noetl.schedule_tick WHERE schedule_id = %s"
                     " AND error IS NOT NULL", (sid,))
    assert all(r["execution_id"] is None and r["error"].startswith("INVALID_ARGUMENT: ") and "needed" in r["error"]
               for r in refused), refused
    assert executions_by_key(db, sid) == {}
    assert runner.cli("schedule", "delete", "refused").returncode == 0
    assert ticks(db, sid) == []  # deleted with the schedule


def _add(api: Api, **fields: Any) -> grpc.RpcError:
    request = schedule_pb2.AddScheduleRequest(name="bad", playbook_path="tests/schedules/tick", interval_ms=1000)
    for key, value in fields.items():
        if key == "payload":
            request.payload.CopyFrom(values.to_struct(value))
        else:
            setattr(request, key, value)
    with pytest.raises(grpc.RpcError) as err:
        api.schedules.AddSchedule(request, timeout=10)
    return err.value


@pytest.mark.parametrize(("fields", "message"), [
    ({"interval_ms": 0, "cron": "61 * * * *"}, "cron: invalid expression"),
    ({"interval_ms": 0, "cron": "* * * * *", "time_zone": "Mars/Olympus"}, "time_zone: unknown time zone"),
    ({"interval_ms": 200}, "interval: 0.2s is below the minimum of 1s (NOETL_SCHEDULE_MIN_INTERVAL_SEC)"),
    ({"playbook_path": "tests/schedules/nope"}, "playbook_path: playbook 'tests/schedules/nope' not found"),
    ({"payload": {"blob": "x" * (4 * 1024 * 1024 + 1)}}, "payload: payload is"),
])
def test_add_refuses_bad_schedules_naming_the_field(runner: Runner, fields: dict[str, Any], message: str) -> None:
    err = _add(runner.api, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.details() or ""), err.details()


def test_only_an_admin_changes_schedules(runner: Runner) -> None:
    worker = Api(runner.state.api, token=runner.state.tokens["worker"], ca_file=runner.state.ca_file)
    try:
        assert _add(worker).code() == grpc.StatusCode.PERMISSION_DENIED
        worker.schedules.ListSchedules(schedule_pb2.ListSchedulesRequest(), timeout=10)  # readers list
    finally:
        worker.close()
