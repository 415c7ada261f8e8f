"""The PFT flow (upstream's PFT test shape, the project's own playbook: ``playbooks.pft_flow``):
facilities x patients x data types through claim -> http -> save. The flow seeds an
execution-scoped queue of patient batches (one per 5 batch data types), ``pft_slots``
parallel slots drain it (claim with FOR UPDATE SKIP LOCKED -> GET the batch from the
fixture server, a 503 on the first try of every batch whose first patient id is 1 modulo
30, retried -> save the rows and mark the batch done in one statement -> jump back to the
claim), then a facility loop pages through each facility's MDS endpoint (the sixth data
type), a validate step counts what landed and a python step checks the counts.

The fixture server is the e2e tests' own (``bench/fixture_api.py``), run in a process of
its own (``python -m bench.fixture_api``, a fresh one per run so its 503s come again) so
its CPU is sampled apart from the bench client's, as the tree ``fixture-api``.

Verified before the time is reported: COMPLETED; every patient's every page of each paged
type in the sink table (count, last page flagged, facility), each patient's demographics
row, each facility's MDS ids; every batch of the queue done, claimed once; the server saw
exactly one request per batch plus one retry per 503 and one per MDS page; the flow's own
check passed; the slot loop's stats say none failed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noetl_client import values
from noetl_proto.v1 import catalog_pb2

from ..fixture_api import PFT_DATA_TYPES, PFT_FLAKY_EVERY, pft_mds_count, pft_pages
from ..playbooks import PFT_TABLES, pft_flow, pft_table
from ..stack import BenchError
from .common import Ctx, Meter, deadline_for, follow

PREFIX = "bench_pft"
CREDENTIAL = "bench_pg"
REPO = Path(__file__).resolve().parents[2]
PAGED = tuple(t for t in PFT_DATA_TYPES if pft_pages(t, 1))
BATCH_PATH = "/api/v1/pft/batch/"
MDS_PATH = "/api/v1/pft/mds"
WARMUP = (2, 10)  # facilities, patients per facility
TASK_SECONDS = "noetl_worker_task_seconds"


@dataclass(frozen=True)
class Size:
    facilities: int
    patients: int  # per facility
    batch: int
    slots: int
    mds_page: int

    @property
    def total(self) -> int:
        return self.facilities * self.patients

    def batch_starts(self) -> list[int]:
        """The first patient id of each batch of one data type (the seed step's batching)."""
        return list(range(1, self.total + 1, self.batch))

    @property
    def batches(self) -> int:
        return len(self.batch_starts()) * len(PFT_DATA_TYPES)

    @property
    def flaky(self) -> int:
        """Batch requests the server answers 503 first (each retried once)."""
        return sum(1 for s in self.batch_starts() if (s - 1) % PFT_FLAKY_EVERY == 0) * len(PFT_DATA_TYPES)

    def mds_requests(self) -> int:
        return sum(-(-pft_mds_count(f) // self.mds_page) for f in range(1, self.facilities + 1))

    def page_rows(self) -> int:
        return sum(pft_pages(t, p) for t in PAGED for p in range(1, self.total + 1))

    def mds_rows(self) -> int:
        return sum(pft_mds_count(f) for f in range(1, self.facilities + 1))

    def payload(self, url: str) -> dict[str, Any]:
        return {"api_url": url, "num_facilities": self.facilities, "patients_per_facility": self.patients,
                "batch_size": self.batch, "concurrency": self.slots, "batch_slots": list(range(1, self.slots + 1)),
                "mds_page_size": self.mds_page}


class FixtureServer:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url

    def summary(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/_summary", timeout=10) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out


@contextlib.contextmanager
def fixture_server() -> Iterator[FixtureServer]:
    """``python -m bench.fixture_api`` in a process of its own; stopped (stdin closed, then
    SIGTERM, then SIGKILL) on the way out."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.fixture_api"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""),
                                  daemon=True)
        reader.start()
        reader.join(timeout=15)
        url = box[0].strip() if box else ""
        if not url.startswith("http://"):
            raise BenchError(f"the fixture server did not start (exit {proc.poll()}, said {url!r})")
        yield FixtureServer(proc, url)
    finally:
        with contextlib.suppress(Exception):
            if proc.stdin:
                proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _tables(ctx: Ctx) -> None:
    stack = ctx.stack
    for name in PFT_TABLES:
        stack.execute(f"DROP TABLE IF EXISTS {pft_table(PREFIX, name)}")
    t = {name: pft_table(PREFIX, name) for name in PFT_TABLES}
    stack.execute(f"CREATE TABLE {t['facility']} (facility_id int PRIMARY KEY, active boolean NOT NULL DEFAULT true)")
    stack.execute(f"CREATE TABLE {t['queue']} (execution_id text NOT NULL, data_type text NOT NULL, "
                  "batch_id int NOT NULL, patient_ids int[] NOT NULL, status text NOT NULL DEFAULT 'pending', "
                  "worker text, attempts int NOT NULL DEFAULT 0, PRIMARY KEY (execution_id, data_type, batch_id))")
    stack.execute(f"CREATE TABLE {t['page_rows']} (data_type text NOT NULL, patient_id int NOT NULL, "
                  "facility_id int NOT NULL, page_number int NOT NULL, payload jsonb, is_last_page boolean NOT NULL, "
                  "PRIMARY KEY (data_type, patient_id, page_number))")
    stack.execute(f"CREATE TABLE {t['demographics']} (patient_id int PRIMARY KEY, facility_id int NOT NULL, "
                  "payload jsonb)")
    stack.execute(f"CREATE TABLE {t['mds']} (assessment_id text PRIMARY KEY, facility_id int NOT NULL)")


def run(ctx: Ctx) -> dict[str, Any]:
    plan, stack = ctx.plan, ctx.stack
    stack.client.credentials.PutCredential(catalog_pb2.PutCredentialRequest(
        name=CREDENTIAL, kind="postgres", data=values.to_struct({"dsn": stack.st.postgres_dsn})), timeout=10)
    playbook = pft_flow(PREFIX, CREDENTIAL)
    warm = Size(WARMUP[0], WARMUP[1], plan.pft_batch, plan.pft_slots, plan.pft_mds_page)
    ctx.progress.start(f"pft: warm-up ({warm.total} patients)", warm.batches, "batches")
    with fixture_server() as server:
        _tables(ctx)
        _flow(ctx, playbook, warm, server)
    size = Size(plan.pft_facilities, plan.pft_patients, plan.pft_batch, plan.pft_slots, plan.pft_mds_page)
    ctx.progress.start(f"pft: {size.facilities} facilities x {size.patients:,} patients x "
                       f"{len(PFT_DATA_TYPES) + 1} data types, {size.slots} slots", size.batches, "batches")
    with fixture_server() as server:
        _tables(ctx)
        tasks0 = task_seconds(ctx)
        with Meter(ctx, extra={"fixture-api": [server.proc.pid]}) as meter:
            eid, wall = _flow(ctx, playbook, size, server)
        checked = _verify(ctx, eid, size, server)
        tasks = {k: {"count": int(v["count"] - tasks0.get(k, {}).get("count", 0)),
                     "sum_s": round(v["sum"] - tasks0.get(k, {}).get("sum", 0.0), 3)}
                 for k, v in task_seconds(ctx).items()}
    ctx.progress.finish()
    rows = checked["rows"]
    http = checked["http_requests"]
    return {"facilities": size.facilities, "patients_per_facility": size.patients, "patients": size.total,
            "data_types": len(PFT_DATA_TYPES) + 1, "batch_size": size.batch, "slots": size.slots,
            "mds_page_size": size.mds_page, "batches": size.batches, "execution_id": eid,
            "wall_s": round(wall, 3), "rows_per_s": round(rows / wall, 1),
            "patients_per_s": round(size.total / wall, 1), "http_per_s": round(http / wall, 1),
            "batches_per_s": round(size.batches / wall, 1),
            "ms_per_batch_per_slot": round(1000 * wall * size.slots / size.batches, 2),
            # the tool calls the workers timed (noetl_worker_task_seconds over the run): per kind,
            # how many and their summed duration; per batch, the time a slot spent inside them
            "tasks": tasks,
            "task_ms_per_batch": {k: round(1000 * v["sum_s"] / size.batches, 2) for k, v in tasks.items()},
            **checked, "meter": meter.summary(size.total, "patient")}


def task_seconds(ctx: Ctx) -> dict[str, dict[str, float]]:
    """The workers' ``noetl_worker_task_seconds`` now, summed over the worker processes:
    {tool kind: {"count", "sum"}}."""
    stack = ctx.stack
    out: dict[str, dict[str, float]] = {}
    for proc in stack.st.processes("worker"):
        if not proc.alive():
            continue
        text = stack.scrape(proc)
        for key in ("count", "sum"):
            for labels, value in stack.samples(text, f"{TASK_SECONDS}_{key}"):
                kind = out.setdefault(labels.get("kind", "?"), {"count": 0.0, "sum": 0.0})
                kind[key] += value
    return out


def _flow(ctx: Ctx, playbook: str, size: Size, server: FixtureServer) -> tuple[int, float]:
    stack = ctx.stack
    t0 = time.monotonic()
    eid = stack.submit(playbook, size.payload(server.url))
    term = follow(ctx, eid, t0, size.batches, t0 + deadline_for(size.total * len(PFT_DATA_TYPES), per_item=0.02),
                  f"SELECT count(*) FROM {pft_table(PREFIX, 'queue')} WHERE execution_id = %s::text "
                  "AND status = 'done'")
    if term.status != "COMPLETED":
        raise BenchError(f"pft execution {eid} ended {term.status}: {term.error}")
    return eid, term.at - t0


def _verify(ctx: Ctx, eid: int, size: Size, server: FixtureServer) -> dict[str, Any]:
    stack = ctx.stack
    t = {name: pft_table(PREFIX, name) for name in PFT_TABLES}
    per = size.patients
    problems: list[str] = []
    # every page of every paged type, per patient: count, the last page flagged, the facility
    got = {(dt, pid): (int(n), bool(last), int(fmin), int(fmax), int(pmax)) for dt, pid, n, last, fmin, fmax, pmax
           in stack.sql(f"SELECT data_type, patient_id, count(*), bool_or(is_last_page) AND "
                        f"count(*) FILTER (WHERE is_last_page) = 1, min(facility_id), max(facility_id), "
                        f"max(page_number) FROM {t['page_rows']} GROUP BY 1, 2")}
    want = {(dt, p): (pft_pages(dt, p), True, (p - 1) // per + 1, (p - 1) // per + 1, pft_pages(dt, p))
            for dt in PAGED for p in range(1, size.total + 1)}
    if got != want:
        wrong = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        problems.append(f"page rows: {len(wrong)} (data type, patient) pairs wrong, e.g. "
                        + ", ".join(f"{k}: {got.get(k)} vs {want.get(k)}" for k in wrong[:3]))
    demo = {int(p): (int(f), name) for p, f, name in
            stack.sql(f"SELECT patient_id, facility_id, payload->>'name' FROM {t['demographics']}")}
    want_demo = {p: ((p - 1) // per + 1, f"patient O'{p}") for p in range(1, size.total + 1)}
    if demo != want_demo:
        problems.append(f"demographics: {len(demo)} rows, {sum(demo.get(p) != v for p, v in want_demo.items())} "
                        "patients missing or wrong")
    mds = dict(stack.sql(f"SELECT facility_id, count(*) FROM {t['mds']} GROUP BY 1"))
    want_mds = {f: pft_mds_count(f) for f in range(1, size.facilities + 1)}
    if mds != want_mds:
        problems.append(f"mds per facility {mds}, expected {want_mds}")
    queue = stack.sql(f"SELECT status, count(*), min(attempts), max(attempts) FROM {t['queue']} "
                      "WHERE execution_id = %s GROUP BY 1", (str(eid),))
    if queue != [("done", size.batches, 1, 1)]:
        problems.append(f"queue (status, batches, min/max claims) {queue}, expected all {size.batches} done, "
                        "claimed once")
    served = server.summary()
    batch_reqs = sum(n for p, n in served["requests"].items() if p.startswith(BATCH_PATH))
    mds_reqs = served["requests"].get(MDS_PATH, 0)
    s503 = served["statuses"].get("503", 0)
    if (batch_reqs, s503, mds_reqs) != (size.batches + size.flaky, size.flaky, size.mds_requests()):
        problems.append(f"http: {batch_reqs} batch requests ({s503} answered 503), {mds_reqs} mds pages; expected "
                        f"{size.batches + size.flaky} ({size.flaky}), {size.mds_requests()}")
    results = stack.results(eid)
    check, end = results.get("check_results") or {}, results.get("end") or {}
    if check.get("status") != "passed" or end.get("status") != "completed" or int(end.get("batches", -1)) != size.batches:
        problems.append(f"the flow's own check: check_results {check}, end {end}")
    meta = stack.scalar("SELECT meta FROM noetl.event WHERE execution_id = %s AND event_type = 'loop.done'", (eid,))
    if not meta or int(meta.get("total", -1)) != size.slots or int(meta.get("failed", -1)) != 0:
        problems.append(f"slot loop stats {meta}, expected total {size.slots}, failed 0")
    if problems:
        raise BenchError(f"pft execution {eid}: " + "; ".join(problems))
    events = int(stack.scalar("SELECT count(*) FROM noetl.event WHERE execution_id = %s", (eid,)) or 0)
    commands = int(stack.scalar("SELECT count(*) FROM noetl.command WHERE execution_id = %s", (eid,)) or 0)
    page_rows, mds_rows = size.page_rows(), size.mds_rows()
    return {"rows": page_rows + size.total + mds_rows, "page_rows": page_rows, "demographics_rows": size.total,
            "mds_rows": mds_rows, "http_requests": batch_reqs + mds_reqs, "http_503": s503,
            "events": events, "commands": commands,
            "check": f"COMPLETED; {page_rows:,} page rows ({len(PAGED)} paged types: every page of every patient, "
                     f"last page flagged, right facility), {size.total:,} demographics rows, {mds_rows:,} MDS ids "
                     f"over {size.facilities} facilities; all {size.batches:,} queue batches done, each claimed "
                     f"once; the server saw {batch_reqs:,} batch requests = one per batch + one retry per 503 "
                     f"({s503}) and {mds_reqs} MDS pages; the flow's check passed; slot loop: {size.slots} slots, "
                     "none failed"}
