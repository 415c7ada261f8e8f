"""Concurrency limits through all seven roles: at most N running executions of a path (per
key), the rest PENDING in submission order and told why, a slot freed by every way an
execution ends, a deleted limit releasing its queue; set and listed through the CLI."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from harness import Outcome, Runner, cancel
from waiting import until_sync

from noetl_cli.client import Api
from noetl_client import values
from noetl_proto.v1 import catalog_pb2, common_pb2, concurrency_pb2, execution_pb2

pytestmark = pytest.mark.e2e

SLOW = """\
apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: {name}
  path: {path}
workload:
  pause: 0.6
  customer: nobody
workflow:
  - step: start
    tool:
      kind: python
      input: {{pause: "{{{{ workload.pause }}}}", customer: "{{{{ workload.customer }}}}"}}
      code: |
        import time
        began = time.time()
        time.sleep(pause)
        result = {{"began": began, "ended": time.time(), "customer": customer}}
"""


def register(runner: Runner, path: str) -> None:
    text = SLOW.format(name=path.replace("/", "_"), path=path)
    runner.api.catalog.RegisterPlaybook(catalog_pb2.RegisterPlaybookRequest(content=text), timeout=10)


def submit(runner: Runner, path: str, payload: dict[str, object] | None = None) -> int:
    return runner.api.executions.SubmitExecution(execution_pb2.SubmitExecutionRequest(
        ref=execution_pb2.PlaybookRef(path=path), payload=values.to_struct(payload or {})), timeout=30).execution_id


def get(runner: Runner, eid: int) -> execution_pb2.Execution:
    return runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(
        execution_id=eid, include_results=True), timeout=10).execution


def overlap(spans: list[tuple[float, float]]) -> int:
    """The most spans that were open at one instant."""
    points = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, d in points:
        now += d
        most = max(most, now)
    return most


def finish_all(runner: Runner, ids: list[int], timeout: float = 90) -> list[Outcome]:
    return [runner.wait(eid, timeout) for eid in ids]


def test_at_most_n_run_the_rest_wait_in_order_and_say_why(runner: Runner) -> None:
    path = "tests/limited_two"
    register(runner, path)
    out = runner.cli("limit", "set", path, "--max", "2", "--json")
    assert out.returncode == 0, out.stderr
    limit_id = json.loads(out.stdout)["limit_id"]
    # a sleep, not a wait: the engine reads the limits at most once a second and shows no
    # sign of having read them; let it see this one
    time.sleep(1.2)
    ids = [submit(runner, path) for _ in range(10)]  # the acceptance: 10 submitted, at most 2 running

    reason = until_sync(lambda: get(runner, ids[-1]).waiting,
                        timeout=30, what="the last execution waiting for the limit")
    assert f"concurrency limit {limit_id} ({path})" in reason and "of 2 running" in reason, reason
    assert get(runner, ids[-1]).status == common_pb2.EXECUTION_STATUS_PENDING
    shown = runner.cli("status", str(ids[-1]))  # it waits >= 1.2 s: two rounds of 0.6 s ahead of it
    assert "waiting: concurrency limit" in shown.stdout, shown.stdout
    # the two granted together end together: between their slots freed and the next two
    # started none may be running for a moment, so list until the slots show held, and
    # never more than the limit on any read
    seen: list[int] = []

    def held() -> bool:
        listed = json.loads(runner.cli("limit", "list", "--path", path, "--json").stdout)
        assert listed[0]["max_running"] == 2, listed
        seen.append(listed[0]["keys"][0]["running"] if listed[0]["keys"] else 0)
        return seen[-1] >= 1

    until_sync(held, timeout=30, what="the limit's slots listed as held")
    assert max(seen) <= 2, seen

    outcomes = finish_all(runner, ids)
    assert all(o.status == "COMPLETED" for o in outcomes), [o.error for o in outcomes]
    spans = [(o.result("start")["began"], o.result("start")["ended"]) for o in outcomes]
    assert overlap(spans) == 2  # never more than the limit, and the limit was used
    # slots go in submission order: none began before one submitted earlier (two granted
    # together may reach their workers a few ms apart)
    began = [b for b, _ in spans]
    assert all(began[i] >= began[j] - 0.05 for i in range(len(began)) for j in range(i)), began
    assert all(began[i] >= min(e for _, e in spans[:i]) - 0.05 for i in range(2, len(spans)))  # waited for a slot
    after = json.loads(runner.cli("limit", "list", "--path", path, "--json").stdout)
    assert after[0]["keys"] == []  # every slot given back
    assert runner.cli("limit", "delete", str(limit_id)).returncode == 0


def test_one_queue_per_key_and_cancel_and_delete_free_the_queue(runner: Runner) -> None:
    path = "tests/limited_per_customer"
    register(runner, path)
    resp = runner.api.concurrency.SetLimit(concurrency_pb2.SetLimitRequest(
        playbook_path=path, key_template="{{ workload.customer }}", max_running=1), timeout=10)
    time.sleep(1.2)  # a sleep, not a wait: the engine reads the limits at most once a second
    a = [submit(runner, path, {"customer": "acme", "pause": 0.8}) for _ in range(2)]
    b = [submit(runner, path, {"customer": "beta", "pause": 0.8}) for _ in range(2)]
    outcomes = finish_all(runner, a + b)
    assert all(o.status == "COMPLETED" for o in outcomes), [o.error for o in outcomes]
    spans = {eid: (o.result("start")["began"], o.result("start")["ended"]) for eid, o in zip(a + b, outcomes, strict=True)}
    assert overlap([spans[e] for e in a]) == 1 and overlap([spans[e] for e in b]) == 1  # one per customer
    assert overlap(list(spans.values())) == 2  # the two customers ran side by side

    # a waiting execution cancelled never runs and holds nothing
    runner.api.concurrency.SetLimit(concurrency_pb2.SetLimitRequest(
        playbook_path=path, key_template="{{ workload.customer }}", max_running=1), timeout=10)
    first = submit(runner, path, {"customer": "acme", "pause": 2.0})
    until_sync(lambda: get(runner, first).status == common_pb2.EXECUTION_STATUS_RUNNING,
               timeout=30, what="the first running")
    queued = submit(runner, path, {"customer": "acme", "pause": 0.1})
    until_sync(lambda: get(runner, queued).waiting, timeout=30, what="the second waiting")
    assert cancel(runner, queued)
    assert runner.wait(queued, 30).status == "CANCELLED"
    # deleting the limit starts the rest (no slot needed any more)
    third = submit(runner, path, {"customer": "acme", "pause": 0.1})
    until_sync(lambda: get(runner, third).waiting, timeout=30, what="the third waiting")
    runner.api.concurrency.DeleteLimit(concurrency_pb2.DeleteLimitRequest(limit_id=resp.limit.limit_id), timeout=10)
    assert runner.wait(third, 30).status == "COMPLETED"
    assert get(runner, first).status != common_pb2.EXECUTION_STATUS_FAILED


def test_bad_limits_are_refused_naming_the_field(runner: Runner) -> None:
    register(runner, "tests/limited_bad")
    for args, needle in (
        (["tests/limited_bad", "--max", "0"], "--max"),
        (["tests/nowhere", "--max", "1"], "playbook_path"),
        (["tests/limited_bad", "--max", "1", "--key", "acme"], "is not a template"),
        (["tests/limited_bad", "--max", "1", "--key", "{{ secrets.x }}"], "reads secrets"),
    ):
        out = runner.cli("limit", "set", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert needle in out.stderr, (args, out.stderr)
    listed = json.loads(runner.cli("limit", "list", "--path", "tests/limited_bad", "--json").stdout)
    assert listed == []


def test_only_an_admin_sets_or_deletes_a_limit(runner: Runner) -> None:
    register(runner, "tests/limited_auth")
    for role in ("worker", "service"):  # the tokens the local stack issues besides admin's
        other = Api(runner.state.api, token=runner.state.tokens[role], ca_file=runner.state.ca_file)
        try:
            for call, request in ((other.concurrency.SetLimit, concurrency_pb2.SetLimitRequest(
                                      playbook_path="tests/limited_auth", max_running=1)),
                                  (other.concurrency.DeleteLimit, concurrency_pb2.DeleteLimitRequest(limit_id=1))):
                with pytest.raises(grpc.RpcError) as exc:
                    call(request, timeout=10)
                assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, (role, exc.value)
        finally:
            other.close()
    assert json.loads(runner.cli("limit", "list", "--path", "tests/limited_auth", "--json").stdout) == []
