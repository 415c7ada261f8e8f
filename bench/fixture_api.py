"""A small HTTP test API of our own (stdlib only) for the playbooks that call out over
http: the e2e tests' conformance playbooks (pagination/basic, pagination/cursor,
v10_canonical_example), their PFT-shaped flow, and the bench's ``pft`` scenario. It lives
here, in ``bench/``, so both import the one server: ``tests/e2e`` puts the repository root
on ``sys.path`` (``tests/e2e/conftest.py``) and imports ``bench.fixture_api``.

    with serve() as api:          # ThreadingHTTPServer on 127.0.0.1, port 0
        api.url                   # "http://127.0.0.1:PORT"
        api.requests("/api/v1/events")

    python -m bench.fixture_api   # the same server in a process of its own (the bench runs it
                                  # so, to sample its CPU apart from the client's): prints its
                                  # URL on a line, serves until stdin closes or SIGTERM

Endpoints:

* ``POST /api/v1/concurrency/reset`` -> ``{"status": "reset"}`` (zeroes the probe counters)
* ``GET /api/v1/concurrency/stats`` -> ``{"started", "completed", "active", "max_active"}``
* ``GET /api/v1/concurrency/probe?delay_seconds=..&label=..``: counts itself active while it
  sleeps ``delay_seconds`` (at least MIN_PROBE_SEC), then answers ``{"status": "ok", "label", "delay_seconds",
  "active_at_start", "started_at", "finished_at"}``
* ``GET /api/v1/events?cursor=..&limit=..`` -> ``{"events": [...], "next_cursor": "..." | null}``
  over ``EVENT_COUNT`` events with ids 1..35 (an empty or missing cursor is the first page)
* ``GET /data`` -> ``DATA`` (a JSON list of records)
* PFT-shaped (``test_pft_flow.py``): ``GET /api/v1/pft/batch/{data_type}?patientIds=1,2&
  patientsPerFacility=N`` -> ``{"rows": [...], "rowCount"}``, a row per patient and page
  (``pft_pages``: assessments 2-4 pages, conditions 1-3, medications 2-3, vital_signs 1,
  demographics one row without a page); the first request for a batch whose first patient
  id is 1 modulo ``PFT_FLAKY_EVERY`` answers 503 (a retry gets it).
  ``GET /api/v1/pft/mds?facility=F&page=P&pageSize=S`` -> ``{"items", "page", "hasMore"}``
  over ``pft_mds_count(F)`` assessment ids of facility F.
* ``GET /_summary`` -> ``{"requests": {path: n}, "statuses": {code: n}}``: what was served
  so far (the summary requests themselves are neither logged nor counted).

Every request is recorded (method, path, query, time) so tests can assert what the
runtime actually sent.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

EVENT_COUNT = 35
PFT_DATA_TYPES = ("assessments", "conditions", "medications", "vital_signs", "demographics")
PFT_FLAKY_EVERY = 30
DEFAULT_LIMIT = 10
MAX_PROBE_DELAY_SEC = 30.0
# A probe is active for at least this long, like a call to upstream's test API across a
# cluster network (milliseconds), not the ~0.3 ms this loopback server needs: a playbook's
# overlap check (pagination/basic: max_active >= 2) then measures whether concurrent
# iterations overlap, not which of five requests sent within ~2 ms of each other reached
# the server first (CI saw the slow probe arrive 1.3 ms after four finished fast ones).
MIN_PROBE_SEC = 0.025
DATA = [{"id": i, "name": f"record_{i}", "value": i * 10} for i in range(1, 4)]


def event(i: int) -> dict[str, Any]:
    return {"id": i, "type": "test.event", "payload": {"sequence": i, "name": f"event_{i:02d}"}}


def pft_pages(data_type: str, patient_id: int) -> int:
    """Pages of a patient's data of one type (0: the type has no pages, one row)."""
    return {"assessments": 2 + patient_id % 3, "conditions": 1 + patient_id % 3,
            "medications": 2 + patient_id % 2, "vital_signs": 1}.get(data_type, 0)


def pft_mds_count(facility: int) -> int:
    return 7 + 3 * facility


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    at: float


@dataclass
class ApiState:
    started: int = 0
    completed: int = 0
    active: int = 0
    max_active: int = 0
    log: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed_once: set[str] = field(default_factory=set)
    statuses: dict[int, int] = field(default_factory=dict)

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"started": self.started, "completed": self.completed, "active": self.active,
                    "max_active": self.max_active}

    def summary(self) -> dict[str, Any]:
        with self.lock:
            paths: dict[str, int] = {}
            for r in self.log:
                paths[r.path] = paths.get(r.path, 0) + 1
            return {"requests": paths, "statuses": {str(k): v for k, v in sorted(self.statuses.items())}}

    def reset(self) -> None:
        with self.lock:
            self.started = self.completed = self.active = self.max_active = 0


class TestApi:
    """A running server: its URL, its counters and the requests it saw."""

    __test__ = False  # not a pytest class

    def __init__(self, server: ThreadingHTTPServer, state: ApiState) -> None:
        self._server = server
        self.state = state
        host, port = server.server_address[:2]
        self.url = f"http://{host!s}:{port}"

    def requests(self, path: str | None = None) -> list[Request]:
        with self.state.lock:
            return [r for r in self.state.log if path is None or r.path == path]

    def clear(self) -> None:
        with self.state.lock:
            self.state.log.clear()


def _events_page(query: dict[str, str]) -> tuple[int, dict[str, Any]]:
    cursor = query.get("cursor") or ""
    try:
        offset = int(cursor) if cursor else 0
        limit = int(query.get("limit") or DEFAULT_LIMIT)
    except ValueError:
        return 400, {"error": f"bad cursor/limit: {query}"}
    if offset < 0 or limit <= 0:
        return 400, {"error": f"bad cursor/limit: {query}"}
    end = min(offset + limit, EVENT_COUNT)
    events = [event(i) for i in range(offset + 1, end + 1)]
    return 200, {"events": events, "next_cursor": str(end) if end < EVENT_COUNT else None}


def _probe(state: ApiState, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
    try:
        delay = min(max(float(query.get("delay_seconds") or 0), 0.0), MAX_PROBE_DELAY_SEC)
    except ValueError:
        return 400, {"error": f"bad delay_seconds: {query.get('delay_seconds')!r}"}
    with state.lock:
        state.started += 1
        state.active += 1
        state.max_active = max(state.max_active, state.active)
        active_at_start = state.active
    started_at = time.time()
    try:
        time.sleep(max(delay, MIN_PROBE_SEC))  # a slow upstream (not a wait): delay_seconds is what the test asks for
    finally:
        with state.lock:
            state.active -= 1
            state.completed += 1
    return 200, {"status": "ok", "label": query.get("label"), "delay_seconds": delay,
                 "active_at_start": active_at_start, "started_at": started_at, "finished_at": time.time()}


def _pft_batch(state: ApiState, data_type: str, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
    try:
        ids = [int(p) for p in (query.get("patientIds") or "").split(",") if p]
        per_facility = int(query.get("patientsPerFacility") or 0)
    except ValueError:
        return 400, {"error": f"bad patientIds/patientsPerFacility: {query}"}
    if data_type not in PFT_DATA_TYPES or not ids or per_facility <= 0:
        return 400, {"error": f"bad batch request {data_type} {query}"}
    if (ids[0] - 1) % PFT_FLAKY_EVERY == 0:
        key = f"{data_type}:{ids[0]}"
        with state.lock:
            first = key not in state.failed_once
            state.failed_once.add(key)
        if first:
            return 503, {"error": "try again"}
    rows: list[dict[str, Any]] = []
    for pid in ids:
        facility = (pid - 1) // per_facility + 1
        pages = pft_pages(data_type, pid)
        if not pages:
            rows.append({"patient_id": pid, "facility_mapping_id": facility,
                         "payload": {"type": data_type, "patient": pid, "name": f"patient O'{pid}"}})
        rows += [{"patient_id": pid, "facility_mapping_id": facility, "page_number": page,
                  "payload": {"type": data_type, "patient": pid, "page": page}, "is_last_page": page == pages}
                 for page in range(1, pages + 1)]
    return 200, {"rows": rows, "rowCount": len(rows)}


def _pft_mds(query: dict[str, str]) -> tuple[int, dict[str, Any]]:
    try:
        facility, page, size = int(query["facility"]), int(query.get("page") or 1), int(query["pageSize"])
    except (KeyError, ValueError):
        return 400, {"error": f"bad mds request {query}"}
    total = pft_mds_count(facility)
    start = (page - 1) * size
    items = [{"assessment_id": f"f{facility}-a{i}", "facility_mapping_id": facility}
             for i in range(start + 1, min(start + size, total) + 1)]
    return 200, {"items": items, "page": page, "hasMore": start + size < total}


def _handler(state: ApiState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # TCP_NODELAY: a response goes out as two writes (headers, then body); with Nagle on,
        # the body waits for the client's delayed ACK of the headers on a kept-alive
        # connection: ~45 ms per request instead of ~4 (httpx, 40 batch requests in a row).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, status: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            with state.lock:
                state.statuses[status] = state.statuses.get(status, 0) + 1
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _route(self, method: str) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            if (method, parts.path) == ("GET", "/_summary"):
                raw = json.dumps(state.summary()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
                return
            with state.lock:
                state.log.append(Request(method, parts.path, query, time.time()))
            route = (method, parts.path)
            if route == ("POST", "/api/v1/concurrency/reset"):
                state.reset()
                self._send(200, {"status": "reset"})
            elif route == ("GET", "/api/v1/concurrency/stats"):
                self._send(200, state.stats())
            elif route == ("GET", "/api/v1/concurrency/probe"):
                self._send(*_probe(state, query))
            elif route == ("GET", "/api/v1/events"):
                self._send(*_events_page(query))
            elif route == ("GET", "/data"):
                self._send(200, DATA)
            elif method == "GET" and parts.path.startswith("/api/v1/pft/batch/"):
                self._send(*_pft_batch(state, parts.path.rsplit("/", 1)[1], query))
            elif route == ("GET", "/api/v1/pft/mds"):
                self._send(*_pft_mds(query))
            else:
                self._send(404, {"error": f"no route {method} {parts.path}"})

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler


@contextmanager
def serve() -> Iterator[TestApi]:
    state = ApiState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="test-api", daemon=True)
    thread.start()
    try:
        yield TestApi(server, state)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def main() -> None:
    """Serve in this process until stdin closes or SIGTERM; the URL is the first line out."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SystemExit: the server is shut down on the way out
    with serve() as api:
        print(api.url, flush=True)
        while sys.stdin.read(4096):
            pass


if __name__ == "__main__":
    main()
