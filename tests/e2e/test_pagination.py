"""Upstream's http pagination playbooks (read in place from ../shared) end to end against
our own paginated test API (bench/fixture_api.py), whose URL replaces the workload's
`api_url` through the submission payload."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from chaos import Db
from harness import Runner, conformance

from bench.fixture_api import EVENT_COUNT, TestApi, event, serve

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def http_api() -> Iterator[TestApi]:
    with serve() as api:
        yield api


def test_pagination_basic_probes_overlap(runner: Runner, http_api: TestApi, db: Db) -> None:
    """One slow probe (4 s) and four fast ones in a parallel loop (max_in_flight 5): the
    fast ones must not wait for the slow one (its own check: max_active >= 2)."""
    http_api.clear()
    out = runner.run(conformance("pagination/basic/test_pagination_basic.yaml"), {"api_url": http_api.url},
                     timeout=90)
    assert out.status == "COMPLETED", f"{out.error}\n{_probe_timeline(http_api, db, out.execution_id)}"
    assert out.result("reset_probe_stats") == {"status": "reset", "started": 0, "completed": 0, "max_active": 0}
    assert out.result("build_probe_plan") == {"probe_delays": [4.0, 0.0, 0.0, 0.0, 0.0], "expected_total": 5}
    validate = out.result("validate_results")
    assert validate["max_active"] >= 2
    assert validate == {"status": "success", "started": 5, "completed": 5, "active": 0,
                        "max_active": validate["max_active"], "expected_total": 5, "expected_min_overlap": 2}
    assert out.result("end") == {"status": "complete"}

    probes = out.result("run_probes")
    assert probes["stats"] == {"total": 5, "success": 5, "failed": 0}
    bodies = [r["body"] for r in probes["results"]]
    assert [r["status_code"] for r in probes["results"]] == [200] * 5
    # Results are in iteration order (the slow probe first) although it finished last.
    assert [b["delay_seconds"] for b in bodies] == [4.0, 0.0, 0.0, 0.0, 0.0]
    assert {b["label"] for b in bodies} == {"pagination-basic"}
    slow, fast = bodies[0], bodies[1:]
    assert all(f["finished_at"] < slow["finished_at"] for f in fast), bodies  # none waited for the slow one
    probe_calls = http_api.requests("/api/v1/concurrency/probe")
    assert len(probe_calls) == 5


def _probe_timeline(http_api: TestApi, db: Db, execution_id: int) -> str:
    """What a failed overlap check needs to be understood: when each probe's command was
    created, claimed (by whom, which attempt) and ended, and when each probe reached the server."""
    commands = db.all("SELECT command_id, attempt, worker_id, created_at, claimed_at, updated_at FROM noetl.command "
                       "WHERE execution_id = %s AND step = 'run_probes' ORDER BY command_id", (execution_id,))
    return json.dumps({"commands": commands, "probes": [(r.at, r.query.get("delay_seconds"))
                                                       for r in http_api.requests("/api/v1/concurrency/probe")]},
                      default=str, indent=1)


def test_pagination_cursor_collects_every_page(runner: Runner, http_api: TestApi) -> None:
    http_api.clear()
    out = runner.run(conformance("pagination/cursor/test_pagination_cursor.yaml"), {"api_url": http_api.url})
    assert out.status == "COMPLETED", out.error
    assert out.result("validate_results") == {"status": "success", "total_events": 35, "first_id": 1, "last_id": 35}
    last = out.result("check_pagination")
    assert last["collected_events"] == [event(i) for i in range(1, EVENT_COUNT + 1)]
    assert last["has_more"] is False and last["next_cursor"] == "" and last["total_collected"] == 35
    assert out.steps["fetch_page"]["visits"] == 4 and out.steps["check_pagination"]["visits"] == 4
    final_page = out.result("fetch_page")
    assert final_page["status_code"] == 200
    assert final_page["body"] == {"events": [event(i) for i in range(31, 36)], "next_cursor": None}
    assert out.result("end") == {"status": "complete"}
    calls = http_api.requests("/api/v1/events")
    assert [(c.method, c.query) for c in calls] == [
        ("GET", {"cursor": cursor, "limit": "10"}) for cursor in ("", "10", "20", "30")]
