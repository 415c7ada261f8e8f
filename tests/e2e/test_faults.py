"""Infrastructure faults under a running 5,000-item loop (issue 11, acceptance): the roles
run as processes against a real Postgres and NATS; the roles reach Postgres through a
fault proxy (tests/e2e/faultproxy.py) so that it can be made unreachable, while the
tests' own connections go direct.

Each fault, with a 5,000-item parallel loop running: Postgres restarted (fast stop and
start, same data); Postgres SIGKILLed and restarted; NATS SIGKILLed and restarted;
Postgres unreachable for 20 s. Every execution COMPLETES with exact results in
iteration order, one accepted result per iteration, one ``loop.done``, no iteration
result turned into a ``call.error``, and afterwards every shard has a live engine: an
execution on each of the 16 shards completes. Also: an engine loop killed by an
injected exception is restarted and the execution goes on within a lease period.

One stack for the module (api=2, worker=2) with fast leases (shard lease 3 s,
heartbeat 1 s, command lease 5 s).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos import HEADER, Db, moved, owner, process_of, scrape, stack_for
from faultproxy import FaultProxy
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import Runner, accepted_iterations
from waiting import until_sync

from noetl_cli import devstack
from noetl_cli.supervise import open_channel
from noetl_proto.v1 import execution_pb2

pytestmark = pytest.mark.e2e

N = 5000
SHARDS = 16
LEASE_SEC = 3.0
TIMINGS: dict[str, Any] = {}

LOOP = HEADER.format(name="fault_loop") + """workload:
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
        result = x * 3 + idx
    next:
      arcs:
        - step: after
          when: "{{ event.name == 'loop.done' }}"
  - step: after
    tool:
      kind: python
      input: {stats: "{{ fan.stats }}"}
      code: "result = stats"
"""

CANARY = HEADER.format(name="fault_canary") + """workflow:
  - step: start
    tool: {kind: python, code: "result = 7"}
"""


@pytest.fixture(scope="module")
def faults_file() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="noetl-faults-")) / "armed"
    path.touch()
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def proxy() -> Iterator[FaultProxy]:
    with FaultProxy() as p:
        yield p


@pytest.fixture(scope="module")
def runner(proxy: FaultProxy, faults_file: Path) -> Iterator[Runner]:
    env = {"NOETL_COMMAND_LEASE_SEC": "5", "NOETL_FAULTS_FILE": str(faults_file)}
    with stack_for("faults", {"api": 2, "worker": 2}, env, role_postgres_dsn=proxy.dsn_via) as r:
        yield r


@pytest.fixture(scope="module", autouse=True)
def report_timings() -> Iterator[None]:
    """The measured recovery figures, printed at the end of the module (docs/BENCHMARKS.md)."""
    yield
    for name, value in TIMINGS.items():
        print(f"recovery timing: {name}: {value}")


def restart_count(text: str, role: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'noetl_shard_loop_restarts_total{{role="{role}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def accepted(db: Db, execution_id: int) -> int:
    return int(db.value("SELECT count(*) FROM noetl.loop_result WHERE execution_id = %s", (execution_id,)))


def start_loop(runner: Runner, db: Db, at_least: int) -> tuple[int, list[int]]:
    """Submit the 5,000-item loop and return once ``at_least`` iterations are accepted."""
    items = [(i * 7919) % N for i in range(N)]
    eid = runner.submit(LOOP, {"items": items}, timeout=600).execution_id
    until_sync(lambda: accepted(db, eid) >= at_least, timeout=180, what=f"{at_least} accepted iterations")
    assert accepted(db, eid) < N, "the loop finished before the fault"
    return eid, [x * 3 + i for i, x in enumerate(items)]


def assert_exact(runner: Runner, db: Db, eid: int, expected: list[int], timeout: float = 300) -> None:
    """COMPLETED; every iteration's value in order; one accepted result per command and
    iteration, none an error; one loop.done; the log of the shard intact."""
    out = runner.wait(eid, timeout)
    assert out.status == "COMPLETED", out.error
    value = out.result("fan")
    assert value["stats"] == {"total": N, "success": N, "failed": 0}, value["stats"]
    wrong = [(i, got, want) for i, (got, want) in enumerate(zip(value["results"], expected, strict=True))
             if got != want]
    assert not wrong, f"{len(wrong)} results wrong or out of place, first: {wrong[:5]}"
    assert out.result("after") == {"total": N, "success": N, "failed": 0}
    rows = db.one("SELECT count(DISTINCT command_id) FILTER (WHERE event_type IN ('call.done', 'call.error')) AS cmds,"
                  " count(*) FILTER (WHERE event_type IN ('call.done', 'call.error')) AS accepted,"
                  " count(*) FILTER (WHERE event_type = 'call.error') AS errors,"
                  " count(*) FILTER (WHERE event_type = 'loop.done') AS loops"
                  " FROM noetl.event WHERE execution_id = %s AND step = 'fan'", (eid,))
    # one accepted result per command (a batch of iterations or one), each iteration covered once
    assert rows["cmds"] == rows["accepted"] and rows["errors"] == 0 and rows["loops"] == 1, rows
    assert accepted_iterations(runner, eid, "fan") == list(range(N))
    db.assert_routed_once(eid)
    db.assert_shard_log_intact(db.shard_of(eid))


def every_shard_progresses(runner: Runner, timeout: float = 120) -> None:
    """An execution on each of the 16 shards completes: no shard is left without a live
    engine. Submits canaries until every shard got one."""
    by_shard: dict[int, int] = {}
    deadline = time.monotonic() + timeout

    def one_on_every_shard() -> bool:
        sub = runner.submit(CANARY)
        by_shard.setdefault(sub.shard_id, sub.execution_id)
        assert len(by_shard) == SHARDS, f"none yet on shards {sorted(set(range(SHARDS)) - set(by_shard))}"
        return True

    until_sync(one_on_every_shard, timeout=timeout, what="a canary on every shard", interval=0,
               ignoring=AssertionError)
    for shard, eid in sorted(by_shard.items()):
        out = runner.wait(eid, max(10.0, deadline - time.monotonic()))
        assert out.status == "COMPLETED" and out.result("start") == 7, (shard, out.status, out.error)


def progress_resumes(db: Db, eid: int, since: float, what: str) -> None:
    """Wait until iterations are accepted again; record how long after ``since`` it took."""
    before = accepted(db, eid)
    until_sync(lambda: accepted(db, eid) > before or accepted(db, eid) == N,
               timeout=120, what="iterations accepted again")
    TIMINGS[what] = round(time.monotonic() - since, 2)


def wait_serving(state: devstack.StackState, timeout: float = 60) -> None:
    def all_serving() -> bool:
        return all(p.health() == "SERVING" for p in state.processes())
    until_sync(all_serving, timeout=timeout, what="every role SERVING again")


def liveness(address: str, ca_file: str) -> str:
    """The status of the ``noetl.liveness`` health service (what the chart's liveness probe asks)."""
    with open_channel(address, ca_file) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="noetl.liveness"), timeout=5)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def health_of(state: devstack.StackState, role: str) -> set[str]:
    return {p.health() for p in state.processes(role)}


# ---------------------------------------------------------------- Postgres restarted


def restart_postgres(state: devstack.StackState) -> None:
    state.stop_postgres("fast")
    # the roles notice and say so: NOT_SERVING while Postgres is gone
    until_sync(lambda: "NOT_SERVING" in health_of(state, "api"),
               timeout=30, what="the api NOT_SERVING while Postgres is down")
    state.start_postgres()


def kill_postgres(state: devstack.StackState) -> None:
    state.kill_postgres()
    time.sleep(1.0)  # a sleep, not a wait: the fault is a second with no database at all
    state.start_postgres()


@pytest.mark.parametrize("fault", [restart_postgres, kill_postgres], ids=["restarted", "sigkilled"])
def test_postgres_restarted_under_a_running_loop(runner: Runner, db: Db, fault: Any) -> None:
    state = runner.state
    eid, expected = start_loop(runner, db, 500)
    db.close()
    down_at = time.monotonic()
    fault(state)
    back = time.monotonic()
    TIMINGS[f"{fault.__name__}: database down (s)"] = round(back - down_at, 1)
    db.reconnect()
    progress_resumes(db, eid, back, f"{fault.__name__}: progress resumed (s after the database was back)")
    wait_serving(state)
    assert_exact(runner, db, eid, expected)
    every_shard_progresses(runner)


# ---------------------------------------------------------------- NATS


def test_nats_sigkilled_under_a_running_loop(runner: Runner, db: Db) -> None:
    state = runner.state
    eid, expected = start_loop(runner, db, 500)
    state.kill_nats()
    time.sleep(1.0)  # a sleep, not a wait: the fault is a second with no NATS
    before = accepted(db, eid)
    state.start_nats()
    back = time.monotonic()
    # progress resumes soon after NATS is back: iterations are accepted again
    until_sync(lambda: accepted(db, eid) > before + 10, timeout=30, what="iterations accepted after the NATS restart")
    resumed = time.monotonic() - back
    TIMINGS["nats restart: progress resumed (s after the server accepted clients)"] = round(resumed, 2)
    assert resumed <= 3.0, f"progress resumed {resumed:.1f}s after NATS came back"
    assert_exact(runner, db, eid, expected)
    every_shard_progresses(runner)


# ---------------------------------------------------------------- Postgres unreachable


def test_postgres_unreachable_for_20_seconds(runner: Runner, db: Db, proxy: FaultProxy) -> None:
    state = runner.state
    eid, expected = start_loop(runner, db, 500)
    proxy.set_mode("refuse")
    try:
        until_sync(lambda: health_of(state, "api") == {"NOT_SERVING"},
                   timeout=30, what="every api NOT_SERVING while unreachable")
        # not ready, but alive: a liveness probe must not get them restarted
        assert {liveness(p.grpc, state.ca_file) for p in state.processes()} == {"SERVING"}
        # a client is told what is wrong at once, not after a timeout
        started = time.monotonic()
        with pytest.raises(Exception, match="postgres unavailable"):
            runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(execution_id=eid), timeout=10)
        assert time.monotonic() - started < 5
        time.sleep(20)  # a sleep, not a wait: the fault is twenty seconds without the database
    finally:
        proxy.set_mode("pass")
    progress_resumes(db, eid, time.monotonic(), "postgres unreachable 20 s: progress resumed (s after it was back)")
    wait_serving(state)
    assert_exact(runner, db, eid, expected)
    every_shard_progresses(runner)


# ---------------------------------------------------------------- a crashed engine loop


def test_an_engine_loop_killed_by_an_injected_exception_resumes(runner: Runner, db: Db, faults_file: Path) -> None:
    state = runner.state
    eid, expected = start_loop(runner, db, 300)
    shard = db.shard_of(eid)
    api = process_of(state, owner(db, "api", shard).instance)
    restarts_before = restart_count(scrape(api), "engine")
    with open(faults_file, "a") as fh:
        fh.write(f"engine.loop {shard}\n")
    until_sync(lambda: f"engine.loop {shard}" not in faults_file.read_text(),
               timeout=30, what="the armed fault to fire")
    fired = time.monotonic()
    at_fire = accepted(db, eid)
    until_sync(lambda: accepted(db, eid) > at_fire + 10,
               timeout=LEASE_SEC * 3, what="iterations accepted after the crash")
    TIMINGS["engine loop crash: progress resumed (s)"] = round(time.monotonic() - fired, 2)
    assert time.monotonic() - fired <= LEASE_SEC + 2, "the engine loop did not resume within a lease period"
    assert restart_count(scrape(api), "engine") == restarts_before + 1, "the crash was not counted as a restart"
    assert_exact(runner, db, eid, expected)


# ---------------------------------------------------------------- an api replica frozen for 2 minutes

SLOW = HEADER.format(name="fault_slow_loop") + """workload:
  items: []
workflow:
  - step: fan
    loop:
      in: "{{ items }}"
      iterator: item
      spec: {mode: parallel, max_in_flight: 4}
    tool:
      kind: python
      input: {x: "{{ item }}"}
      code: |
        import time
        time.sleep(0.1)
        result = x
"""

FREEZE_SEC = 120


def lease_epochs_after(db: Db, shard: int, epoch: int, since: Any) -> int:
    """Events of ``shard`` appended under lease ``epoch`` at or after ``since``."""
    return int(db.value("SELECT count(*) FROM noetl.event WHERE shard_id = %s AND (meta->>'lease_epoch')::bigint = %s"
                        " AND created_at >= %s", (shard, epoch, since)))


def test_an_api_replica_frozen_for_two_minutes(runner: Runner, db: Db) -> None:
    """SIGSTOP of the api replica owning a running loop's shard, for 2 minutes: the loop
    resumes on the other replica within a lease + 5 s and completes exact; executions on
    the other replica's shards never stall meanwhile (calls to the frozen replica fail
    over); after SIGCONT nothing the zombie commits is accepted."""
    state = runner.state
    until_sync(lambda: all(p.health() == "SERVING" for p in state.processes("api")),
               timeout=60, what="both api replicas SERVING")
    eid, expected = start_loop(runner, db, 500)
    shard = db.shard_of(eid)
    before = owner(db, "api", shard)
    frozen = process_of(state, before.instance)
    # a slow loop on a shard the other replica owns: it must keep going through the freeze
    slow_items = list(range(2000))
    while True:
        sub = runner.submit(SLOW, {"items": slow_items}, timeout=600)
        if owner(db, "api", sub.shard_id).instance != frozen.instance:
            break
        runner.api.executions.CancelExecution(execution_pb2.CancelExecutionRequest(
            execution_id=sub.execution_id, reason="on the replica about to freeze"), timeout=10)
    other = sub.execution_id
    until_sync(lambda: accepted(db, other) >= 20, timeout=60, what="the slow loop running")

    frozen.kill(signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        # the frozen replica's shard moves and the loop goes on there
        until_sync(lambda: moved(db, "api", shard, before),
                   timeout=LEASE_SEC + 10, what=f"a new owner of shard {shard}")
        TIMINGS["api SIGSTOP: shard moved (s)"] = round(time.monotonic() - frozen_at, 2)
        at_move = accepted(db, eid)
        until_sync(lambda: accepted(db, eid) > at_move, timeout=30, what="the loop progressing on its new owner")
        resumed = time.monotonic() - frozen_at
        TIMINGS["api SIGSTOP: loop resumed on the other replica (s)"] = round(resumed, 2)
        assert resumed <= LEASE_SEC + 5, (f"resumed {resumed:.1f}s after the freeze (lease {LEASE_SEC}s + 5s):"
                                          f" {TIMINGS}")
        # the other replica's executions never stall: progress in every 5 s window
        stalls = []
        window_start, last = time.monotonic(), accepted(db, other)
        while time.monotonic() - frozen_at < 45 and last < len(slow_items):
            time.sleep(5)  # a sleep, not a wait: one 5 s window in which the slow loop must progress
            now_count = accepted(db, other)
            if now_count == last:
                stalls.append(round(time.monotonic() - frozen_at, 1))
            last = now_count
        assert not stalls, f"the slow loop on a live replica's shard stalled in the windows ending at {stalls}s"
        assert_exact(runner, db, eid, expected)
        TIMINGS["api SIGSTOP: window starts checked"] = round(time.monotonic() - window_start, 1)
        remaining = FREEZE_SEC - (time.monotonic() - frozen_at)
        if remaining > 0:
            time.sleep(remaining)  # a sleep, not a wait: the fault is the replica frozen for two minutes
        thawed_at = db.now()
    finally:
        frozen.kill(signal.SIGCONT)
    # the zombie wakes up with a batch it may have had in flight: nothing of it is accepted
    until_sync(lambda: frozen.health() == "SERVING", timeout=60, what="the thawed replica SERVING again (rejoined)")
    assert lease_epochs_after(db, shard, before.epoch, thawed_at) == 0, "the zombie committed after waking"
    db.assert_shard_log_intact(shard)
    out = runner.wait(other, 300)
    assert out.status == "COMPLETED", out.error
    assert out.result("fan")["results"] == slow_items
    every_shard_progresses(runner)
