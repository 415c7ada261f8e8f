"""Bad input gets a clear error naming what is wrong, the right status / exit code, and
leaves no half-written execution."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import Runner

from noetl_client import values

pytestmark = pytest.mark.e2e

COUNTS = ("SELECT (SELECT count(*) FROM noetl.execution_request),"
          " (SELECT count(*) FROM noetl.event WHERE event_type <> 'checkpoint.committed'),"
          " (SELECT count(*) FROM noetl.command), (SELECT count(*) FROM noetl.catalog)")
HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: bad\n  path: tests/bad_input\n"


@pytest.fixture
def counts(runner: Runner) -> Iterator[None]:
    """Nothing may be written for a rejected submission: no request, event or command, and
    no catalog entry (a refused playbook is not registered)."""
    before = runner.sql(COUNTS)[0]
    yield
    after = runner.sql(COUNTS)[0]
    assert after == before


def rejected(runner: Runner, text: str, payload: dict[str, Any] | None = None, *, raw: bytes | None = None) -> str:
    """Submit and expect INVALID_ARGUMENT; returns its message. ``raw``: the request's
    bytes, sent as they are (what a client with a broken encoder would send)."""
    from noetl_proto.v1 import execution_pb2

    with pytest.raises(grpc.RpcError) as info:
        if raw is not None:
            runner.api.channel.unary_unary("/noetl.v1.ExecutionService/SubmitExecution",
                                           request_serializer=lambda b: b)(raw, timeout=30)
        else:
            runner.api.executions.SubmitExecution(execution_pb2.SubmitExecutionRequest(
                playbook_yaml=text, payload=values.to_struct(payload or {})), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()  # type: ignore[attr-defined]
    return str(info.value.details())  # type: ignore[attr-defined]


def test_malformed_yaml(runner: Runner, counts: None) -> None:
    msg = rejected(runner, HEADER + "workflow:\n  - step: start\n    tool: {kind: python, code: 'x'\n")
    assert "malformed YAML" in msg and "line" in msg


def test_unknown_tool_kind(runner: Runner, counts: None) -> None:
    msg = rejected(runner, HEADER + "workflow:\n  - step: start\n    tool: {kind: fortran, code: x}\n")
    assert "workflow[0].tool" in msg and "unknown tool kind 'fortran'" in msg


def test_a_request_protobuf_cannot_decode_is_refused_saying_why(runner: Runner, counts: None) -> None:
    from noetl_proto.v1 import execution_pb2

    ok = HEADER + "workflow:\n  - step: start\n    tool: {kind: noop}\n"
    good = execution_pb2.SubmitExecutionRequest(playbook_yaml=ok).SerializeToString()
    # field 9 (payload, a Struct) holding bytes that are not a Struct
    broken = good + bytes([0x4A, 3, 0xFF, 0xFF, 0xFF])
    assert "the request could not be decoded" in rejected(runner, ok, raw=broken)


def test_input_naming_a_variable_that_does_not_exist_is_caught_at_submit(runner: Runner, counts: None) -> None:
    text = HEADER + ("workload: {greeting: hi}\nworkflow:\n  - step: start\n    tool:\n      kind: python\n"
                     "      input: {x: '{{ greting }}'}\n      code: 'result = x'\n")
    msg = rejected(runner, text)
    assert "workflow[0].tool.input.x" in msg and "greting" in msg and "{{ greting }}" in msg


def test_unknown_credential_is_caught_at_submit(runner: Runner, counts: None) -> None:
    text = HEADER + ("workload: {db: no_such_db}\nworkflow:\n  - step: start\n    tool:\n      kind: postgres\n"
                     "      auth: '{{ db }}'\n      command: SELECT 1\n")
    msg = rejected(runner, text)
    assert "unknown credential 'no_such_db'" in msg and "workflow[0].tool.auth" in msg


def test_a_refused_submission_registers_nothing_in_the_catalog(runner: Runner, counts: None) -> None:
    """Each check that runs after parsing (credentials, sub-playbooks, templates) refuses
    before the playbook is registered: its path never appears in the catalog."""
    head = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: refused\n  path: tests/refused_{n}\n"
    bodies = [
        "workflow:\n  - step: start\n    tool:\n      kind: duckdb\n      auth: {pg_db: {credential: no_such_pg}}\n"
        "      query: SELECT 1\n",
        "workflow:\n  - step: start\n    tool: {kind: playbook, path: tests/no_such_child}\n",
        "workflow:\n  - step: start\n    tool: {kind: python, input: {x: '{{ nope }}'}, code: 'result = x'}\n",
    ]
    for n, body in enumerate(bodies):
        rejected(runner, head.format(n=n) + body)
        assert runner.sql("SELECT count(*) FROM noetl.catalog WHERE path = %s", (f"tests/refused_{n}",))[0][0] == 0


def test_missing_attribute_at_run_time_fails_the_step_naming_the_template(runner: Runner) -> None:
    text = HEADER + ("workflow:\n  - step: start\n    tool: {kind: python, code: 'result = {\"a\": 1}'}\n"
                     "    next: {arcs: [{step: use}]}\n"
                     "  - step: use\n    tool:\n      kind: python\n      input: {v: '{{ start.missing + 1 }}'}\n"
                     "      code: 'result = v'\n")
    out = runner.run(text)
    assert out.status == "FAILED"
    assert "{{ start.missing + 1 }}" in out.steps["use"]["error"] and "missing" in out.steps["use"]["error"]
    assert "use" in out.error


def test_credential_unknown_at_run_time_fails_the_step_naming_it(runner: Runner) -> None:
    text = HEADER + ("workflow:\n  - step: start\n    tool: {kind: python, code: 'result = {\"db\": \"ghost_db\"}'}\n"
                     "    next: {arcs: [{step: query}]}\n"
                     "  - step: query\n    tool:\n      kind: postgres\n      auth: '{{ start.db }}'\n"
                     "      command: SELECT 1\n")
    out = runner.run(text)
    assert out.status == "FAILED"
    assert "ghost_db" in out.steps["query"]["error"]


def test_cli_exit_codes(runner: Runner, tmp_path: Path, counts: None) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(HEADER + "workflow: [\n")
    proc = runner.cli("run", str(bad), "--json")
    assert proc.returncode == 2 and "malformed YAML" in proc.stderr and proc.stdout == ""
    proc = runner.cli("run", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr
    good = tmp_path / "good.yaml"
    good.write_text(HEADER + "workflow:\n  - step: start\n    tool: {kind: noop}\n")
    proc = runner.cli("run", str(good), "--payload", "[1]")
    assert proc.returncode == 2 and "JSON object" in proc.stderr
    kind = tmp_path / "kind.yaml"
    kind.write_text(HEADER + "workflow:\n  - step: start\n    tool: {kind: cobol}\n")
    proc = runner.cli("run", str(kind))
    assert proc.returncode == 2 and "unknown tool kind 'cobol'" in proc.stderr


def test_cli_run_json_success_and_failure(runner: Runner, tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(HEADER + "workload: {n: 2}\nworkflow:\n  - step: start\n    tool:\n      kind: python\n"
                    "      input: {n: '{{ n }}'}\n      code: 'result = {\"sq\": n * n}'\n")
    proc = runner.cli("run", str(good), "--json", "--payload", '{"n": 7}')
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"execution_id", "status", "steps", "error"}
    assert doc["status"] == "COMPLETED" and doc["error"] is None
    assert doc["steps"] == {"start": {"status": "COMPLETED", "result": {"sq": 49}}}
    failing = tmp_path / "fail.yaml"
    failing.write_text(HEADER + "workflow:\n  - step: start\n    tool: {kind: python, code: 'raise ValueError(\"boom\")'}\n")
    proc = runner.cli("run", str(failing), "--json")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["status"] == "FAILED" and "boom" in doc["error"]
