"""One trace per execution, across processes: every role of a local stack (api x2) writes
its spans to a file of its own (``NOETL_OTEL_EXPORTER=jsonl``); the files, gathered, show
the api's SubmitExecution server span, the engine span that issued the first command, the
command notice's publish, the worker's consumer span, its ClaimCommand client span (and
the api's server span for it), the tool-run span, the worker's publish of the result, the
engine folding the result, the next command handed to the worker (its publish, the
worker's consumer span, the tool run) and ``playbook.completed``, all in ONE trace; a client's
``traceparent`` is continued; and after the shard's engine is SIGKILLed mid-execution,
the api replica that takes the shard over continues the same trace (the context is
stored with the request, not held in memory)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos import Db, chain, moved, owner, process_of, stack_for
from harness import Runner
from waiting import until_sync

from noetl_common.tracing import read_jsonl
from noetl_proto.v1 import execution_pb2

pytestmark = pytest.mark.e2e

PLAYBOOK = Path(__file__).resolve().parents[2] / "examples" / "hello_world.yaml"
SUBMIT = "noetl.v1.ExecutionService/SubmitExecution"
CLAIM = "noetl.v1.WorkerService/ClaimCommand"


@pytest.fixture(scope="module")
def spans_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="noetl-spans-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def runner(spans_dir: Path) -> Iterator[Runner]:
    env = {"NOETL_OTEL_EXPORTER": "jsonl", "NOETL_OTEL_FILE": str(spans_dir / "{role}-{pid}.jsonl")}
    with stack_for("tracing", {"api": 2}, env) as r:
        yield r


class Trace:
    """The spans of one trace, gathered from every process's file."""

    def __init__(self, spans: list[dict[str, Any]], trace_id: str) -> None:
        self.trace_id = trace_id
        self.spans = [s for s in spans if s["trace_id"] == trace_id]
        self.by_id = {s["span_id"]: s for s in self.spans}

    def find(self, name: str, service: str, **attributes: Any) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["name"] == name and s["service"] == service
                and all(s["attributes"].get(k) == v for k, v in attributes.items())]

    def one(self, name: str, service: str, **attributes: Any) -> dict[str, Any]:
        found = self.find(name, service, **attributes)
        assert found, f"no {service} span {name!r} {attributes} in trace {self.trace_id}: {self.names()}"
        return found[0]

    def children(self, parent: dict[str, Any], name_prefix: str, service: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["parent_span_id"] == parent["span_id"]
                and s["name"].startswith(name_prefix) and s["service"] == service]

    def child(self, parent: dict[str, Any], name_prefix: str, service: str) -> dict[str, Any]:
        found = self.children(parent, name_prefix, service)
        assert found, (f"no {service} span {name_prefix!r}* under {parent['service']} {parent['name']!r}"
                       f" in trace {self.trace_id}: {self.names()}")
        return found[0]

    def names(self) -> list[str]:
        return sorted(f"{s['service']}:{s['name']}" for s in self.spans)


def all_spans(spans_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(sorted(spans_dir.glob("*.jsonl")))


def trace_of(spans_dir: Path, execution_id: int, *, complete: str = "playbook.completed") -> Trace:
    """The trace of an execution once its terminal span is written (polled with a deadline)."""

    def ready() -> Trace | None:
        spans = all_spans(spans_dir)
        end = [s for s in spans if s["name"] == complete and s["attributes"].get("noetl.execution_id") == execution_id]
        return Trace(spans, end[0]["trace_id"]) if end else None

    return until_sync(ready, timeout=30, what=f"the {complete} span of execution {execution_id}")


def assert_one_trace_per_execution(spans_dir: Path, execution_id: int, trace: Trace) -> None:
    """Every span naming the execution is in its trace."""
    others = {s["trace_id"] for s in all_spans(spans_dir)
              if s["attributes"].get("noetl.execution_id") == execution_id} - {trace.trace_id}
    assert not others, f"execution {execution_id} has spans in other traces: {others}"


def assert_handoff_chain(trace: Trace, execution_id: int, step: str) -> None:
    for fold in trace.find("engine.call_result", "noetl-api", **{"noetl.execution_id": execution_id}):
        for sent in trace.children(fold, "publish noetl.handoff.", "noetl-api"):
            assert sent["kind"] == "PRODUCER"
            consumer = trace.child(sent, "process noetl.handoff.", "noetl-worker")
            assert consumer["kind"] == "CONSUMER"
            tools = trace.children(consumer, "tool.run python", "noetl-worker")
            if tools and tools[0]["attributes"]["noetl.step"] == step:
                assert not trace.children(consumer, CLAIM, "noetl-worker")  # handed: no claim call
                assert trace.child(consumer, "publish noetl.events.", "noetl-worker")["name"].endswith(".call")
                return
    raise AssertionError(f"no handoff of step {step!r} in the trace: {trace.names()}")


def assert_command_chain(trace: Trace, issuer: dict[str, Any], execution_id: int, step: str) -> None:
    """issuer -> publish noetl.commands -> worker consumer -> claim (client + api server),
    tool run, result publish; the engine folds that result in the same trace."""
    notices = [p for p in trace.children(issuer, "publish noetl.commands.", "noetl-api")
               if any(c["name"].startswith("process noetl.commands.") for c in trace.spans
                      if c["parent_span_id"] == p["span_id"])]
    assert notices, f"no published notice of {issuer['name']} reached a worker: {trace.names()}"
    for notice in notices:
        assert notice["kind"] == "PRODUCER" and notice["attributes"]["messaging.system"] == "nats"
        consumer = trace.child(notice, "process noetl.commands.", "noetl-worker")
        assert consumer["kind"] == "CONSUMER"
        claim = trace.child(consumer, CLAIM, "noetl-worker")
        assert claim["kind"] == "CLIENT" and claim["status"] != "ERROR"
        served = trace.child(claim, CLAIM, "noetl-api")
        assert served["kind"] == "SERVER" and served["attributes"]["rpc.grpc.status_code"] == 0
        tools = trace.children(consumer, "tool.run python", "noetl-worker")
        if not tools or tools[0]["attributes"]["noetl.step"] != step:
            continue  # a notice of another step (hello_world issues one command per step)
        tool = tools[0]
        assert tool["attributes"]["noetl.execution_id"] == execution_id and tool["status"] == "UNSET"
        result = trace.child(consumer, "publish noetl.events.", "noetl-worker")
        assert result["kind"] == "PRODUCER" and result["name"].endswith(".call")
        command_id = tool["attributes"]["noetl.command_id"]
        assert trace.find("engine.call_result", "noetl-api", **{"noetl.command_id": command_id}), (
            f"the engine's fold of {command_id}'s result is not in the trace: {trace.names()}")
        return
    raise AssertionError(f"no tool run of step {step!r} under {issuer['name']}: {trace.names()}")


def test_one_trace_from_submit_to_playbook_completed(runner: Runner, spans_dir: Path) -> None:
    out = runner.run(PLAYBOOK)
    assert out.status == "COMPLETED", out
    eid = out.execution_id
    trace = trace_of(spans_dir, eid)
    assert_one_trace_per_execution(spans_dir, eid, trace)

    submit = trace.one(SUBMIT, "noetl-api")
    assert submit["kind"] == "SERVER" and submit["parent_span_id"] is None  # the client sent no traceparent
    assert submit["attributes"]["rpc.grpc.status_code"] == 0
    # the nudge: handed to the api's own engine when it holds the shard, else published
    hand = trace.child(submit, "hand noetl.events.", "noetl-api")
    assert hand["name"].endswith(".submit")
    if hand["attributes"].get("noetl.handed") is False:
        nudge = trace.child(submit, "publish noetl.events.", "noetl-api")
        assert nudge["name"].endswith(".submit") and nudge["kind"] == "PRODUCER"
    else:
        assert not trace.children(submit, "publish noetl.events.", "noetl-api"), "handed and published"
    # the engine (whichever api replica owns the shard) starts the execution under the submit span
    # (a sweep racing the nudge folds "submitted" twice: the second fold issues nothing)
    started = next(s for s in trace.find("engine.submitted", "noetl-api", **{"noetl.execution_id": eid})
                   if s["attributes"]["noetl.commands"] > 0)
    assert started["parent_span_id"] == submit["span_id"]
    assert_command_chain(trace, started, eid, "start")
    # the next step follows the worker's result: handed to it (ARCHITECTURE.md "Handoff"), in
    # the same trace: fold -> publish noetl.handoff.* -> the worker's consumer span -> tool run
    assert_handoff_chain(trace, eid, "shout")
    # the results are folded under the stored context, and the terminal event is a span of its own
    folds = trace.find("engine.call_result", "noetl-api", **{"noetl.execution_id": eid})
    assert len(folds) == 3 and all(f["parent_span_id"] == submit["span_id"] for f in folds), trace.names()
    done = trace.one("playbook.completed", "noetl-api", **{"noetl.execution_id": eid})
    assert done["parent_span_id"] == submit["span_id"] and done["status"] == "UNSET"
    # three processes wrote this trace at least: an api, the engine's api (maybe the same), a worker
    pids = {(s["service"], s["pid"]) for s in trace.spans}
    assert {svc for svc, _ in pids} >= {"noetl-api", "noetl-worker"}
    print(f"\nexecution {eid}: trace {trace.trace_id}, {len(trace.spans)} spans from {sorted(pids)}")


def test_a_client_traceparent_is_continued(runner: Runner, spans_dir: Path) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    resp = runner.api.executions.SubmitExecution(
        execution_pb2.SubmitExecutionRequest(playbook_yaml=PLAYBOOK.read_text()),
        metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")], timeout=30)
    assert runner.wait(resp.execution_id).status == "COMPLETED"
    trace = trace_of(spans_dir, resp.execution_id)
    assert trace.trace_id == trace_id
    assert trace.one(SUBMIT, "noetl-api")["parent_span_id"] == parent_id
    assert_one_trace_per_execution(spans_dir, resp.execution_id, trace)


def test_the_trace_survives_an_engine_takeover(runner: Runner, db: Db, spans_dir: Path) -> None:
    """SIGKILL the api owning the execution's shard mid-execution: the replica that takes
    the shard over reads the stored context and continues the same trace."""
    state = runner.state
    eid = runner.submit(chain("traced-takeover", 4, 0.7)).execution_id
    shard = db.shard_of(eid)
    until_sync(lambda: db.value("SELECT count(*) FROM noetl.event WHERE execution_id = %s"
                                " AND event_type = 'step.enter'", (eid,)) >= 2, timeout=30, what="the second step")
    before = owner(db, "api", shard)
    victim = process_of(state, before.instance)
    state.kill("api", victim.index)
    try:
        after = until_sync(lambda: moved(db, "api", shard, before), timeout=20, what=f"a new owner of shard {shard}")
        out = runner.wait(eid, 60)
        assert out.status == "COMPLETED", out.error
        trace = trace_of(spans_dir, eid)
        assert_one_trace_per_execution(spans_dir, eid, trace)
        submit = trace.one(SUBMIT, "noetl-api")
        new_engine = process_of(state, after.instance).pid
        engine = [s for s in trace.find("engine.call_result", "noetl-api", **{"noetl.execution_id": eid})
                  if s["pid"] == new_engine]
        assert engine and all(s["parent_span_id"] == submit["span_id"] for s in engine), trace.names()
        assert trace.one("playbook.completed", "noetl-api")["pid"] == new_engine
        # the new owner's commands reach the workers in the same trace
        assert any(s["service"] == "noetl-worker" and s["name"].startswith("tool.run")
                   and s["attributes"]["noetl.step"] == "s4" for s in trace.spans), trace.names()
    finally:
        state.restart("api", victim.index)
