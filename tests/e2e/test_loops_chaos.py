"""Loops at scale under SIGKILL (issue 4, acceptance): processes killed for real.

One stack for the module (api=2, worker=2) with fast leases (heartbeat 1 s, shard
lease 3 s, command lease 5 s, republish after 3 s).

* A 1,000-item parallel loop (max_in_flight 32) of a python task whose value depends on
  the item and its index (it sleeps 50 ms, so the killed worker is running iterations,
  not just reporting finished ones) completes with the 1,000 values in iteration order and exactly
  one ``loop.done`` while a worker (after ~250 accepted iterations) and the api replica
  owning the execution's shard (after ~500) are SIGKILLed.
* A cursor loop (max_in_flight 16) over a 5,000-row work table, whose claim SQL has no
  stale-claim clause, lands every row's side effect in a sink idempotent on its key,
  undisturbed (every row exactly once) and with a worker SIGKILLed after ~1,500 rows
  (no row stranded or lost; the rows run twice are bounded by the killed worker's slots).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from chaos import HEADER, Db, moved, owner, process_of, stack_for
from harness import Runner, execute, put_credential
from waiting import until_sync

from noetl_cli import devstack

pytestmark = pytest.mark.e2e

COMMAND_LEASE_SEC = 5
SHARDS = 16
TIMINGS: dict[str, Any] = {}


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    env = {"NOETL_COMMAND_LEASE_SEC": str(COMMAND_LEASE_SEC), "NOETL_COMMAND_REPUBLISH_AFTER_SEC": "3"}
    with stack_for("loopchaos", {"api": 2, "worker": 2}, env) as r:
        yield r


def wait_api_balanced(db: Db, state: devstack.StackState) -> None:
    """Every api shard owned by a live replica, within one of the fair share."""
    live = {p.instance for p in state.processes("api") if p.alive()}

    def balanced() -> bool:
        rows = db.all("SELECT r.instance, count(*) AS n FROM noetl.shard_lease l JOIN noetl.runtime r"
                      " ON r.runtime_id = l.owner_runtime_id WHERE l.role = 'api' AND r.status = 'alive'"
                      " GROUP BY 1")
        held = {r["instance"]: r["n"] for r in rows}
        return (set(held) == live and sum(held.values()) == SHARDS
                and max(held.values()) - min(held.values()) <= 1)

    until_sync(balanced, timeout=30, what=f"api shards balanced over {sorted(live)}")


def every_worker_up(state: devstack.StackState) -> None:
    for p in state.processes("worker"):
        if not p.alive():
            state.restart("worker", p.index)


def loop_done_count(db: Db, execution_id: int, instance: str) -> int:
    return int(db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s AND event_type = 'loop.done'"
                        " AND meta->>'loop_instance' = %s", (execution_id, instance)))


def claimed_by(db: Db, execution_id: int) -> dict[str, list[dict[str, Any]]]:
    """{worker: [its claimed commands of the execution]}."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in db.all("SELECT command_id, worker_id, attempt FROM noetl.command WHERE execution_id = %s"
                    " AND status = 'claimed'", (execution_id,)):
        out.setdefault(r["worker_id"], []).append(r)
    return out


def kill_busiest_worker(db: Db, state: devstack.StackState, execution_id: int) -> tuple[Any, list[dict[str, Any]]]:
    """SIGKILL the worker holding the most claimed commands of the execution; returns it
    and the commands it held when it died (read a moment after its death: a claim it had
    in flight may still commit in the api; after that nothing changes them)."""
    held = until_sync(lambda: claimed_by(db, execution_id), timeout=30, what="a claimed command of the execution")
    instance = max(held, key=lambda w: len(held[w]))
    victim = process_of(state, instance)
    assert victim.role == "worker" and victim.alive()
    state.kill("worker", victim.index)
    until_sync(lambda: not victim.alive(), timeout=10, what=f"{victim.instance} to die")
    # a sleep, not a wait: a claim in flight has no signal; a moment, well under the command
    # lease (5 s), so nothing has expired yet
    time.sleep(1.0)
    return victim, claimed_by(db, execution_id).get(instance, [])


# ---------------------------------------------------------------- 1,000-item parallel loop

N = 1000
FAN = HEADER.format(name="fan_chaos") + """workload:
  items: []
workflow:
  - step: fan
    loop:
      in: "{{ items }}"
      iterator: item
      spec: {mode: parallel, max_in_flight: 32}
    tool:
      kind: python
      input: {x: "{{ item }}", idx: "{{ iter._index }}"}
      code: |
        import time
        time.sleep(0.05)
        result = x * 2 + idx
    next:
      arcs:
        - step: after
          when: "{{ event.name == 'loop.done' }}"
  - step: after
    tool:
      kind: python
      input: {values: "{{ fan.results }}", stats: "{{ fan.stats }}"}
      code: "result = {'n': len(values), 'sum': sum(values), 'stats': stats}"
"""


def accepted(db: Db, execution_id: int) -> int:
    return int(db.value("SELECT count(*) FROM noetl.loop_result WHERE execution_id = %s", (execution_id,)))


def test_parallel_loop_survives_sigkill_of_a_worker_and_the_shard_owner(runner: Runner, db: Db) -> None:
    state = runner.state
    wait_api_balanced(db, state)
    items = [(i * 7919) % N for i in range(N)]  # a permutation: item i is not i
    expected = [x * 2 + i for i, x in enumerate(items)]
    started = time.monotonic()
    eid = runner.submit(FAN, {"items": items}).execution_id
    shard = db.shard_of(eid)

    # 1) a worker, after ~250 accepted iterations
    until_sync(lambda: accepted(db, eid) >= 250, timeout=120, what="250 accepted iterations")
    worker, held = kill_busiest_worker(db, state, eid)
    at_worker_kill = accepted(db, eid)
    TIMINGS["fan: accepted iterations when the worker was killed"] = at_worker_kill
    TIMINGS["fan: iterations the killed worker held"] = len(held)
    assert at_worker_kill < N and loop_done_count(db, eid, "fan:1") == 0, "the loop ended before the kill"

    # 2) the api replica owning the execution's shard, after ~500 accepted iterations
    until_sync(lambda: accepted(db, eid) >= 500, timeout=120, what="500 accepted iterations")
    before = owner(db, "api", shard)
    api = process_of(state, before.instance)
    assert api.role == "api" and api.alive()
    state.kill("api", api.index)
    killed_at = time.monotonic()
    at_owner_kill = accepted(db, eid)
    TIMINGS["fan: accepted iterations when the shard owner was killed"] = at_owner_kill
    assert at_owner_kill < N and loop_done_count(db, eid, "fan:1") == 0, "the loop ended before the owner kill"
    after = until_sync(lambda: moved(db, "api", shard, before), timeout=30, what=f"a new owner of shard {shard}")
    assert after.instance != api.instance
    TIMINGS["fan: shard takeover observed (s after the kill)"] = round(time.monotonic() - killed_at, 2)

    out = runner.wait(eid, 180)
    TIMINGS["fan: submit -> terminal (s)"] = round(time.monotonic() - started, 2)
    assert out.status == "COMPLETED", out.error
    value = out.result("fan")
    assert value["stats"] == {"total": N, "success": N, "failed": 0}
    assert len(value["results"]) == N
    wrong = [(i, got, want) for i, (got, want) in enumerate(zip(value["results"], expected, strict=True))
             if got != want]
    assert not wrong, f"{len(wrong)} results out of place or wrong, first: {wrong[:5]}"
    # a later step sees the same value
    assert out.result("after") == {"n": N, "sum": sum(expected), "stats": {"total": N, "success": N, "failed": 0}}

    # exactly one loop.done for the instance, after the new owner took over
    assert loop_done_count(db, eid, "fan:1") == 1
    done = db.one("SELECT (meta->>'lease_epoch')::bigint AS epoch, meta FROM noetl.event WHERE execution_id = %s"
                  " AND event_type = 'loop.done'", (eid,))
    assert done is not None and done["epoch"] > before.epoch, done
    assert {k: done["meta"][k] for k in ("total", "success", "failed")} == {"total": N, "success": N, "failed": 0}
    # one accepted result per iteration command (a batch of iterations, `:{first}+{count}`,
    # or one); duplicates only as call.duplicate; every index covered exactly once
    rows = db.all("SELECT command_id, count(*) FILTER (WHERE event_type IN ('call.done', 'call.error')) AS accepted,"
                  " count(*) FILTER (WHERE event_type = 'call.error') AS errors,"
                  " count(*) FILTER (WHERE event_type = 'call.duplicate') AS duplicates,"
                  " min((meta->>'index')::int) FILTER (WHERE event_type = 'call.done') AS first,"
                  " min(COALESCE((meta->>'count')::int, 1)) FILTER (WHERE event_type = 'call.done') AS n"
                  " FROM noetl.event WHERE execution_id = %s AND command_id LIKE %s GROUP BY 1",
                  (eid, f"{eid}:fan:1:%"))
    assert all(r["accepted"] == 1 and r["errors"] == 0 for r in rows), [r for r in rows if r["accepted"] != 1][:5]
    assert sorted(i for r in rows for i in range(r["first"], r["first"] + r["n"])) == list(range(N))
    counts = db.assert_routed_once(eid)
    assert counts["call.done"] == len(rows) + 1, counts  # the loop's commands + `after`
    # the ordered table of references: 1,000 distinct indexes, none missing
    lr = db.one("SELECT count(*) AS n, count(DISTINCT idx) AS d, min(idx) AS lo, max(idx) AS hi,"
                " count(*) FILTER (WHERE status <> 'ok') AS bad FROM noetl.loop_result WHERE execution_id = %s"
                " AND loop_instance = 'fan:1'", (eid,))
    assert lr == {"n": N, "d": N, "lo": 0, "hi": N - 1, "bad": 0}, lr
    assert db.value("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND step = 'fan'"
                    " AND status <> 'done'", (eid,)) == 0
    # the killed worker's iterations were re-issued and completed by another attempt
    reissued = {r["command_id"] for r in db.all(
        "SELECT command_id FROM noetl.event WHERE execution_id = %s AND event_type = 'command.reissued'", (eid,))}
    TIMINGS["fan: iterations re-issued"] = len(reissued)
    TIMINGS["fan: late results recorded as call.duplicate"] = sum(r["duplicates"] for r in rows)
    assert reissued, "no iteration was re-issued: the worker kill hit nothing"
    assert reissued <= {c["command_id"] for c in held}, "an iteration the killed worker did not hold was re-issued"
    db.assert_shard_log_intact(shard)
    db.wait_projected()
    db.assert_projection_is_a_fold(eid)

    state.restart("api", api.index)
    every_worker_up(state)
    wait_api_balanced(db, state)
    assert worker.alive()


# ---------------------------------------------------------------- cursor loop over 5,000 rows

ROWS = 5000
CRED = "loopchaos_pg"
SCHEMA = "loopchaos"


def cursor_playbook(tag: str) -> str:
    work, sink = f"{SCHEMA}.work_{tag}", f"{SCHEMA}.sink_{tag}"
    # No stale-claim clause: a row claimed by a slot that dies is handed back by the runtime.
    claim = (f"UPDATE {work} SET status = 'claimed' WHERE id = (SELECT id FROM {work} WHERE status = 'pending'"
             " ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING *")
    apply = (f"INSERT INTO {sink} (key, v) VALUES ({{{{ row.id }}}}, {{{{ row.v }}}})"
             f" ON CONFLICT (key) DO UPDATE SET hits = {sink}.hits + 1;"
             f" UPDATE {work} SET status = 'done' WHERE id = {{{{ row.id }}}}")
    return HEADER.format(name=f"cursor_chaos_{tag}") + f"""workflow:
  - step: drain
    loop:
      iterator: row
      cursor:
        kind: postgres
        auth: {CRED}
        claim: "{claim}"
      spec: {{mode: cursor, max_in_flight: 16}}
    tool:
      - name: apply
        kind: postgres
        auth: {CRED}
        command: "{apply}"
    next:
      arcs:
        - step: after
          when: "{{{{ event.name == 'loop.done' }}}}"
  - step: after
    tool:
      kind: python
      input: {{stats: "{{{{ drain.stats }}}}", slots: "{{{{ drain.results }}}}"}}
      code: "result = {{'stats': stats, 'slots': len(slots)}}"
"""


def make_tables(runner: Runner, tag: str) -> tuple[str, str]:
    work, sink = f"{SCHEMA}.work_{tag}", f"{SCHEMA}.sink_{tag}"
    execute(runner, f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
    execute(runner, f"DROP TABLE IF EXISTS {work}, {sink}")
    execute(runner, f"CREATE TABLE {work} (id int PRIMARY KEY, v int NOT NULL,"
                    " status text NOT NULL DEFAULT 'pending')")
    execute(runner, f"INSERT INTO {work} (id, v) SELECT g, g * 3 + 1 FROM generate_series(1, {ROWS}) g")
    execute(runner, f"CREATE TABLE {sink} (key int PRIMARY KEY, v int NOT NULL, hits int NOT NULL DEFAULT 1)")
    return work, sink


@pytest.mark.parametrize("scenario", ["undisturbed", "worker_killed"])
def test_cursor_loop_lands_every_row_once(runner: Runner, db: Db, scenario: str) -> None:
    state = runner.state
    every_worker_up(state)
    put_credential(runner, CRED)
    tag = "a" if scenario == "undisturbed" else "b"
    work, sink = make_tables(runner, tag)
    started = time.monotonic()
    eid = runner.submit(cursor_playbook(tag)).execution_id

    held: list[dict[str, Any]] = []
    if scenario == "worker_killed":
        until_sync(lambda: db.value(f"SELECT count(*) FROM {sink}") >= 1500,
                   timeout=180, what="1,500 rows in the sink")
        victim, held = kill_busiest_worker(db, state, eid)
        at_kill = int(db.value(f"SELECT count(*) FROM {sink}"))
        TIMINGS[f"cursor {scenario}: sink rows when {victim.instance} was killed"] = at_kill
        TIMINGS[f"cursor {scenario}: slots on the killed worker"] = len(held)
        assert held, "the killed worker held no slot"
        assert at_kill < ROWS and loop_done_count(db, eid, "drain:1") == 0, "the loop ended before the kill"

    out = runner.wait(eid, 300)
    TIMINGS[f"cursor {scenario}: submit -> terminal (s)"] = round(time.monotonic() - started, 2)
    assert out.status == "COMPLETED", out.error

    # every work row's side effect landed, none lost, nothing else; every row done
    sink_stats = db.one(f"SELECT count(*) AS n, count(DISTINCT key) AS keys, COALESCE(sum(hits), 0) AS runs,"
                        f" count(*) FILTER (WHERE hits > 1) AS twice, COALESCE(max(hits), 0) AS max_hits FROM {sink}")
    assert sink_stats is not None
    assert sink_stats["n"] == ROWS and sink_stats["keys"] == ROWS, sink_stats
    missing = db.value(f"SELECT count(*) FROM {work} w LEFT JOIN {sink} s ON s.key = w.id WHERE s.key IS NULL")
    strangers = db.value(f"SELECT count(*) FROM {sink} s LEFT JOIN {work} w ON w.id = s.key WHERE w.id IS NULL")
    mismatched = db.value(f"SELECT count(*) FROM {sink} s JOIN {work} w ON w.id = s.key WHERE s.v <> w.v")
    assert (missing, strangers, mismatched) == (0, 0, 0)
    statuses = dict((r["status"], r["n"]) for r in db.all(
        f"SELECT status, count(*) AS n FROM {work} GROUP BY 1"))
    assert statuses == {"done": ROWS}, f"work rows not done (stranded?): {statuses}"

    # the loop's value: stats over rows, one result per slot; one loop.done
    value = out.result("drain")
    stats = value["stats"]
    assert len(value["results"]) == 16
    assert sum(r["processed"] for r in value["results"]) == stats["total"]
    assert stats["failed"] == 0 and stats["success"] == stats["total"], stats
    assert out.result("after") == {"stats": stats, "slots": 16}
    assert loop_done_count(db, eid, "drain:1") == 1
    counts = db.assert_routed_once(eid)
    assert counts["call.done"] == 16 + 1, counts  # the slots + `after`
    assert db.value("SELECT count(*) FROM noetl.command WHERE execution_id = %s AND step = 'drain'"
                    " AND status = 'done'", (eid,)) == 16
    reissued = [r["command_id"] for r in db.all(
        "SELECT command_id FROM noetl.event WHERE execution_id = %s AND event_type = 'command.reissued'", (eid,))]

    twice, runs = int(sink_stats["twice"]), int(sink_stats["runs"])
    TIMINGS[f"cursor {scenario}: rows run twice"] = twice
    TIMINGS[f"cursor {scenario}: stats"] = stats
    if scenario == "undisturbed":
        assert reissued == [], reissued
        assert runs == ROWS and sink_stats["max_hits"] == 1, sink_stats  # every row exactly once
        assert stats == {"total": ROWS, "success": ROWS, "failed": 0}
    else:
        # Every slot of the dead worker was re-issued and resumed with the row it had
        # claimed; each re-issued slot can run at most one row a second time.
        TIMINGS[f"cursor {scenario}: slots re-issued"] = len(reissued)
        assert sorted(reissued) == sorted(c["command_id"] for c in held), (held, reissued)
        assert sink_stats["max_hits"] <= 2, sink_stats
        assert twice == runs - ROWS
        assert twice <= len(held), f"{twice} rows ran twice, {len(held)} slot(s) were on the killed worker"
        # rows are counted once per claim: every row at least once, re-runs of a resumed
        # row once, a row whose claim was rolled back by the kill (and claimed again) twice
        assert ROWS <= stats["total"] <= runs, (stats, sink_stats)
    db.assert_shard_log_intact(db.shard_of(eid))
    every_worker_up(state)


def test_zz_report_timings() -> None:
    for what, value in TIMINGS.items():
        print(f"\n{what}: {value}")
