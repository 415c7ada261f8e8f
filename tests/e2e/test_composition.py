"""Sub-playbooks (`kind: playbook`): upstream's playbook_composition runs its child
user_profile_scorer once per user inside a sequential loop (both read in place from
../shared; the child is registered in the catalog first, as upstream deploys it).
Expected scores are computed here from the child's own formulas. Cancelling a parent
whose step waits on a running child cancels the child too."""

from __future__ import annotations

import pytest
from harness import INSERTED_ONE, Runner, cancel, conformance, register_playbook
from waiting import until_sync

from noetl_proto.v1 import catalog_pb2, execution_pb2

pytestmark = pytest.mark.e2e

PARENT = "playbook_composition/playbook_composition.yaml"
CHILD = "playbook_composition/user_profile_scorer.yaml"
CHILD_PATH = "fixtures/playbooks/playbook_composition/user_profile_scorer"
USERS = [
    {"name": "Alice", "age": 28, "department": "Engineering", "years_experience": 5, "performance_rating": 4.2},
    {"name": "Bob", "age": 34, "department": "Marketing", "years_experience": 8, "performance_rating": 3.8},
    {"name": "Charlie", "age": 29, "department": "Engineering", "years_experience": 3, "performance_rating": 4.5},
    {"name": "Diana", "age": 42, "department": "Management", "years_experience": 15, "performance_rating": 4.0},
]
DEPARTMENTS = {"Engineering": 15.0, "Management": 12.0, "Product": 12.0, "Marketing": 8.0, "Sales": 10.0,
               "HR": 6.0, "Finance": 8.0}


def score(user: dict[str, object]) -> dict[str, object]:
    """user_profile_scorer's formulas (its workbook + compute_total_score), in its order."""
    years = float(user["years_experience"])  # type: ignore[arg-type]
    if years >= 15:
        experience = 30.0
    elif years >= 10:
        experience = 25.0 + (years - 10) * 1.0
    elif years >= 5:
        experience = 15.0 + (years - 5) * 2.0
    elif years >= 2:
        experience = 10.0 + (years - 2) * 1.67
    else:
        experience = years * 5.0
    experience = round(experience, 1)
    performance = round((float(user["performance_rating"]) - 1.0) * 6.25, 1)  # type: ignore[arg-type]
    department = DEPARTMENTS.get(str(user["department"]), 5.0)
    age = float(user["age"])  # type: ignore[arg-type]
    if 25 <= age <= 35:
        age_score = 10.0
    elif 35 < age <= 45:
        age_score = 8.0
    elif 45 < age <= 55:
        age_score = 6.0
    elif age > 55:
        age_score = 5.0
    else:
        age_score = 7.0
    total = round(experience * 0.4 + performance * 0.35 + department * 0.15 + age_score * 0.1, 1)
    if total >= 80 and years >= 10:
        category = "Executive"
    elif total >= 65 and years >= 7:
        category = "Senior"
    elif total >= 50 and years >= 3:
        category = "Mid-Level"
    else:
        category = "Junior"
    breakdown = {"experience": experience * 0.4, "performance": performance * 0.35,
                 "department": department * 0.15, "age": age_score * 0.1}
    return {"user_name": user["name"], "profile_score": total, "score_category": category,
            "score_breakdown": breakdown}


def test_user_profile_scorer_standalone(runner: Runner) -> None:
    out = runner.run(conformance(CHILD))
    assert out.status == "COMPLETED", out.error
    expected = score({"name": "TestUser", "age": 30, "department": "Engineering", "years_experience": 5,
                      "performance_rating": 4.0})
    assert out.result("finalize_result") == {**expected, "execution_id": "standalone_execution",
                                             "processing_status": "completed"}


def test_playbook_composition_runs_the_child_per_user(runner: Runner) -> None:
    entry = register_playbook(runner, conformance(CHILD))
    assert entry.path == CHILD_PATH
    eid = int(runner.submit(conformance(PARENT).read_text()).execution_id)
    out = runner.wait(eid, timeout=150)
    assert out.status == "COMPLETED", out.error

    expected = {u["name"]: score(u) for u in USERS}
    rows = runner.sql("SELECT id, user_name, profile_score, score_category FROM public.user_profile_results"
                      " WHERE execution_id = %s ORDER BY user_name", (str(eid),))
    assert [(r[0], r[1], r[3]) for r in rows] == [
        (f"{eid}:{name}", name, expected[name]["score_category"]) for name in sorted(expected)]
    for _, name, profile_score, _ in rows:
        assert profile_score == pytest.approx(expected[name]["profile_score"], abs=1e-9), name

    # The loop value is the last pipeline task's (store_result, postgres) per user.
    assert out.result("process_users") == {"results": [INSERTED_ONE] * 4,
                                           "stats": {"total": 4, "success": 4, "failed": 0}}
    # `validate_results` reads `process_users.data`, absent from a loop's value
    # {"results", "stats"}: its own code takes the "tracking" branch, and `end` then
    # reports validation_passed False. These are the values the playbook computes.
    assert out.result("validate_results") == {
        "status": "tracking", "all_valid": None, "total_users": 0, "valid_users": 0, "validation_details": [],
        "summary": "Awaiting loop aggregation of process_users results"}
    assert out.result("end") == {"pipeline_status": "completed", "users_processed": 4, "validation_passed": False,
                                 "message": "Playbook composition test completed successfully"}

    # Children are committed submissions with the parent recorded (their read models may
    # trail the parent's by a projector batch: wait for each).
    children = [int(r[0]) for r in runner.sql("SELECT execution_id FROM noetl.execution_request"
                                              " WHERE parent_execution_id = %s ORDER BY execution_id", (eid,))]
    assert len(children) == 4, children
    finals = []
    for child_id in children:
        child = runner.wait(child_id, timeout=30)
        assert child.status == "COMPLETED", child.error
        got = runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(execution_id=child_id),
                                                 timeout=10).execution
        assert got.parent_execution_id == eid and got.playbook_path == CHILD_PATH
        final = child.result("finalize_result")
        assert str(final["execution_id"]) == str(eid)  # execution_context: '{{ execution_id }}' of the parent
        finals.append(final)
    # Sequential loop: the children ran in the users' order.
    assert [f["user_name"] for f in finals] == [u["name"] for u in USERS]
    for final in finals:
        want = expected[str(final["user_name"])]
        assert final["score_category"] == want["score_category"]
        assert final["profile_score"] == pytest.approx(want["profile_score"], abs=1e-9)
        assert final["score_breakdown"] == pytest.approx(want["score_breakdown"])
        assert final["processing_status"] == "completed"


SLOW_CHILD = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: slow_child, path: tests/composition/slow_child}
workflow:
  - step: start
    tool: {kind: python, code: "import time\\ntime.sleep(60)\\nresult = 'late'"}
"""
WAITING_PARENT = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: waiting_parent, path: tests/composition/waiting_parent}
workflow:
  - step: start
    tool: {kind: playbook, path: tests/composition/slow_child}
    next: {arcs: [{step: after}]}
  - step: after
    tool: {kind: python, code: "result = 'never'"}
"""


def test_cancelling_the_parent_cancels_the_running_child(runner: Runner) -> None:
    runner.api.catalog.RegisterPlaybook(catalog_pb2.RegisterPlaybookRequest(content=SLOW_CHILD), timeout=30)
    parent = int(runner.submit(WAITING_PARENT).execution_id)

    def child_running() -> int | None:
        rows = runner.sql("SELECT c.execution_id FROM noetl.execution_request c JOIN noetl.command k"
                          " ON k.execution_id = c.execution_id AND k.status = 'claimed'"
                          " WHERE c.parent_execution_id = %s", (parent,))
        return int(rows[0][0]) if rows else None

    child = until_sync(child_running, timeout=60, what="the child's step to be running")
    assert cancel(runner, parent)
    out = runner.wait(parent, timeout=60)
    assert out.status == "CANCELLED", out
    assert "after" not in out.steps
    # the cascade reaches the child, whose running python task is stopped (not left to sleep 60 s)
    got = runner.wait(child, timeout=30)
    assert got.status == "CANCELLED", got
    statuses = runner.sql("SELECT status FROM noetl.command WHERE execution_id = %s", (child,))
    assert [r[0] for r in statuses] == ["cancelled"], statuses
    assert not runner.sql("SELECT 1 FROM noetl.event WHERE execution_id = %s AND event_type = 'call.done'",
                          (child,))
