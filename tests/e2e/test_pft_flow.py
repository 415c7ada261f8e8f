"""A PFT-shaped flow of our own (playbooks/pft_flow.yaml) against our own fixture server
(bench/fixture_api.py: batch and paginated endpoints, a 503 on the first try of some
batches): parallel claim -> fetch -> save slots with jump/break policies drain an
execution-scoped queue for several facilities, a facility loop pages through an endpoint,
and steps read their own result as `output` in their `set` and arcs, down to the last.
Every row must land."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Runner

from bench.fixture_api import PFT_DATA_TYPES, PFT_FLAKY_EVERY, TestApi, pft_mds_count, pft_pages, serve

pytestmark = pytest.mark.e2e

PLAYBOOK = Path(__file__).resolve().parent / "playbooks" / "pft_flow.yaml"
FACILITIES, PATIENTS, BATCH = 4, 50, 10


@pytest.fixture(scope="module")
def http_api() -> Iterator[TestApi]:
    with serve() as api:
        yield api


def test_pft_flow_lands_every_row_and_its_last_step_reads_output(runner: Runner, http_api: TestApi) -> None:
    out = runner.run(PLAYBOOK, {"api_url": http_api.url}, timeout=240)
    assert out.status == "COMPLETED", (out.error, {k: v["error"] for k, v in out.steps.items() if v["error"]})
    patients = range(1, FACILITIES * PATIENTS + 1)
    batches = FACILITIES * PATIENTS // BATCH * len(PFT_DATA_TYPES)

    # The last steps: check_results' `set` read its own output into ctx, which `end` read;
    # end's own `set` (reading `output`) ran: the execution completed.
    assert out.result("check_results") == {"status": "passed", "facilities_checked": FACILITIES, "short": []}
    assert out.result("end") == {"status": "completed", "check_status": "passed", "remaining": 0,
                                 "batches": batches}

    # Every row, in the tables: each patient's every page of each paged type, demographics, MDS.
    for data_type in ("assessments", "conditions", "medications", "vital_signs"):
        got = runner.sql("SELECT patient_id, count(*), bool_or(is_last_page) FROM pft_e2e_page_rows "
                         "WHERE data_type = %s GROUP BY patient_id ORDER BY patient_id", (data_type,))
        assert got == [(p, pft_pages(data_type, p), True) for p in patients], data_type
    demographics = runner.sql("SELECT patient_id, facility_id, payload->>'name' FROM pft_e2e_demographics "
                              "ORDER BY patient_id")
    assert demographics == [(p, (p - 1) // PATIENTS + 1, f"patient O'{p}") for p in patients]
    mds = runner.sql("SELECT facility_id, count(*) FROM pft_e2e_mds GROUP BY facility_id ORDER BY facility_id")
    assert mds == [(f, pft_mds_count(f)) for f in range(1, FACILITIES + 1)]
    queue = runner.sql("SELECT status, count(*) FROM pft_e2e_batch_queue WHERE execution_id = %s GROUP BY status",
                       (str(out.execution_id),))
    assert queue == [("done", batches)]

    # The slots: a parallel loop whose width was a template, each slot looping claim ->
    # fetch -> save by jump until its claim came back empty (break).
    slots = out.result("process_batches")
    assert slots["stats"] == {"total": 6, "success": 6, "failed": 0}
    assert all(r == {"status": "ok", "row_count": 0} or r.get("row_count") == 0 for r in slots["results"]), slots
    fetches = http_api.requests("/api/v1/pft/batch/assessments")
    flaky = [f for f in fetches if (int(f.query["patientIds"].split(",")[0]) - 1) % PFT_FLAKY_EVERY == 0]
    assert flaky and len(flaky) == 2 * len({f.query["patientIds"] for f in flaky}), "each 503 retried once"
    # The facility loop: load_next_facility ran once per facility (mark_facility's arcs end
    # the loop when none remains), fetch_mds paged through each facility's ids.
    assert out.steps["load_next_facility"]["visits"] == FACILITIES
    assert out.steps["mark_facility"]["visits"] == FACILITIES
    assert out.steps["fetch_mds"]["visits"] == FACILITIES
    assert len(http_api.requests("/api/v1/pft/mds")) == sum(
        -(-pft_mds_count(f) // 4) for f in range(1, FACILITIES + 1))


FAILING = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: pft_error_e2e, path: tests/e2e/pft_error}
workflow:
  - step: start
    tool:
      kind: python
      code: |
        def ratio(a, b):
            return a / b
        result = ratio(1, 0)
    next:
      arcs:
        - step: recover
          when: "{{ event.name == 'call.error' and output.error.kind == 'unknown' }}"
          set:
            ctx.exception: "{{ output.error.exception_type }}"
  - step: recover
    tool:
      kind: python
      input: {exception: "{{ ctx.exception }}"}
      code: |
        raise ValueError(f"recovered from {exception}")
"""


def test_a_python_error_shows_its_type_message_and_traceback(runner: Runner) -> None:
    out = runner.run(FAILING, timeout=60)
    assert out.status == "FAILED"
    first, *trace = out.steps["start"]["error"].splitlines()
    assert first == "ZeroDivisionError: division by zero"
    assert trace[0] == "Traceback (most recent call last):" and any("in ratio" in ln for ln in trace)
    assert out.steps["recover"]["error"].splitlines()[0] == "ValueError: recovered from ZeroDivisionError"
    assert "ValueError: recovered from ZeroDivisionError" in out.error
    shown = runner.cli("status", str(out.execution_id))
    assert "start" in shown.stdout and "(ZeroDivisionError: division by zero)" in shown.stdout, shown
    assert "Traceback (most recent call last):" in shown.stdout
