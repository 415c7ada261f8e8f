"""Prefect 3, the same scenarios: run with bench/.venv-prefect/bin/python.

Starts ``prefect server start`` (its local server: SQLite under a throwaway
PREFECT_HOME, no UI, analytics off) on a free loopback port, points this process at it
(PREFECT_API_URL) and runs flows in this process, the way Prefect runs them:

* turnaround: a flow of 3 tasks in a row (a = seed, b = a + 1, c = 2 * b), the flow call
  timed per run (flow run created on the server -> its result), one at a time;
* fan-out: a flow mapping a task over range(N) (``task.map``) on a
  ``ThreadPoolTaskRunner(max_workers=width)`` (16, 64): the in-flight bound that matches
  ``max_in_flight``; the flow sums the results.
Each result is checked (c == 2 * (seed + 1); N results summing to N * (N - 1)).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Out, args, summary_ms


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    a = args()
    out = Out(a.out, a.progress)
    home = tempfile.mkdtemp(prefix="noetl-bench-prefect-")
    port = free_port()
    os.environ.update({
        "PREFECT_HOME": home,
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "DO_NOT_TRACK": "1",
    })
    cli = os.path.join(os.path.dirname(sys.executable), "prefect")
    out.progress("starting the Prefect server")
    t0 = time.monotonic()
    log_path = os.path.join(os.path.dirname(os.path.abspath(a.out)), "peer-prefect-server.log")
    log = open(log_path, "wb")
    server = subprocess.Popen([cli, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui",
                               "--analytics-off"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                log.flush()
                raise SystemExit(f"prefect server exited with {server.returncode}: "
                                 + open(log_path).read()[-2000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("prefect server did not answer /api/health within 180 s")
            time.sleep(0.25)
        out.set("server_start_s", round(time.monotonic() - t0, 2))
        out.set("storage", "local server: SQLite file under PREFECT_HOME")
        run(a, out, port)
        out.set("ok", True)
        # The client sends task-run events in the background; let it hand them to the server
        # before the server stops (else it retries them at exit for minutes).
        out.progress("waiting for the client to send its pending events")
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            from prefect.events.worker import EventsWorker

            EventsWorker.drain_all(timeout=120)
        out.set("events_drain_s", round(time.monotonic() - t0, 1))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def quiesce(port: int, timeout: float = 90.0) -> float:
    """Wait until the server answers a small read quickly again (it persists the events of
    a big flow after the flow returns; SQLite then answers 503 for a while). Returns the
    seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        t = time.monotonic()
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/flow_runs/filter", data=b'{"limit": 1}',
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200 and time.monotonic() - t < 0.25:
                    return round(time.monotonic() - t0, 1)
        except OSError:
            pass
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1)


def attempt(fn, notes: list[str], what: str, tries: int = 3):  # type: ignore[no-untyped-def]
    """Call ``fn``; on a server error retry (after a pause) up to ``tries`` times, noting it."""
    for k in range(tries):
        try:
            return fn()
        except Exception as exc:
            if k == tries - 1:
                raise
            notes.append(f"{what}: attempt {k + 1} failed ({type(exc).__name__}: {str(exc)[:160]}); retried")
            time.sleep(10)
    return None


def run(a, out: Out, port: int) -> None:  # type: ignore[no-untyped-def]
    import prefect
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    out.set("versions", {"prefect": prefect.__version__})

    @task
    def step_a(seed: int) -> int:
        return seed

    @task
    def step_b(v: int) -> int:
        return v + 1

    @task
    def step_c(v: int) -> int:
        return v * 2

    @task
    def double(i: int) -> int:
        return i * 2

    @flow
    def three(seed: int) -> int:
        return step_c(step_b(step_a(seed)))

    notes: list[str] = []
    out.set("notes", notes)
    for _ in range(a.warmup):
        attempt(lambda: three(1), notes, "turnaround warm-up")
    rng = random.Random(7)
    lat = []
    for i in range(a.runs):
        seed = rng.randrange(1_000_000)
        t0 = time.monotonic()
        got = three(seed)
        lat.append(time.monotonic() - t0)
        if got != 2 * (seed + 1):
            raise SystemExit(f"turnaround run {i}: got {got}, expected {2 * (seed + 1)}")
        out.progress("turnaround", i + 1, a.runs)
    out.set("turnaround", {**summary_ms(lat), "measured_by": "flow call (flow run created -> result), in process",
                           "check": f"all {a.runs} runs returned c == 2 * (seed + 1)"})

    for width in [int(w) for w in a.widths.split(",")]:
        @flow(task_runner=ThreadPoolTaskRunner(max_workers=width))
        def fan(n: int) -> list[int]:
            values = [f.result() for f in double.map(range(n))]
            return [len(values), sum(values)]

        out.progress(f"fan-out warm-up, {width} threads (waiting for the server to settle first)")
        waited = quiesce(port)
        attempt(lambda: fan(20), notes, f"fan-out {width} warm-up")
        out.progress(f"fan-out {a.items} tasks (task.map), {width} threads", 0, a.items)
        t0 = time.monotonic()
        try:
            count, total = fan(a.items)
        except Exception as exc:
            notes.append(f"fan-out {width}: the measured run failed ({type(exc).__name__}: {str(exc)[:160]}); "
                         "measured again after the server settled")
            quiesce(port)
            t0 = time.monotonic()
            count, total = fan(a.items)
        wall = time.monotonic() - t0
        if count != a.items or total != a.items * (a.items - 1):
            raise SystemExit(f"fan-out {width}: {count} results summing to {total}")
        out.fanout(width, {"items": a.items, "max_in_flight": width, "wall_s": round(wall, 3),
                           "iterations_per_s": round(a.items / wall, 1), "settle_wait_s": waited,
                           "check": f"{a.items} results summing to {a.items * (a.items - 1):,}"})
        out.set("notes", notes)
        out.progress(f"fan-out {a.items} tasks (task.map), {width} threads", a.items, a.items)


if __name__ == "__main__":
    code = 1
    try:
        main()
        code = 0
    except SystemExit as exc:
        print(f"prefect peer: {exc}", file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        # The results are written; skip the client's exit-time retries against the stopped server.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
