"""Hostile input never takes a role down (issue 11, acceptance): each bad input gets a
clear error naming the limit it broke (or runs within its limits), a canary execution
submitted meanwhile completes, and no role grows beyond its documented memory bound
(docs/DEPLOY.md "Memory"). The roles run as processes (one stack for the module).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from chaos import HEADER, Db, stack_for
from harness import Runner
from waiting import until_sync

from noetl_client import values
from noetl_proto.v1 import execution_pb2

pytestmark = pytest.mark.e2e

SUBPLAYBOOK_DEPTH = 3
# Peak resident memory of each role process over the whole module (VmHWM), in MiB: the
# bounds docs/DEPLOY.md "Memory" documents for hostile input at the default limits.
MEMORY_BOUND_MIB = {"api": 768, "worker": 768}
MEMORY_BOUND_OTHERS_MIB = 256


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    with stack_for("hostile", {}, {"NOETL_LIMIT_SUBPLAYBOOK_DEPTH": str(SUBPLAYBOOK_DEPTH)}) as r:
        yield r


CANARY = HEADER.format(name="hostile_canary") + """workflow:
  - step: start
    tool: {kind: python, code: "result = 41 + 1"}
"""


def canary(runner: Runner) -> int:
    return runner.submit(CANARY).execution_id


def canary_completes(runner: Runner, eid: int) -> None:
    out = runner.wait(eid, 60)
    assert out.status == "COMPLETED" and out.result("start") == 42, (out.status, out.error)


def refused(runner: Runner, text: str, payload: dict[str, Any] | None = None, *, raw_payload: bytes = b"",
            code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    """Submit and expect a refusal with ``code``; returns its message. ``raw_payload``: the
    payload field's bytes as a hostile client sends them (no encoder refuses them first)."""
    request = execution_pb2.SubmitExecutionRequest(playbook_yaml=text, payload=values.to_struct(payload or {}))
    with pytest.raises(grpc.RpcError) as info:
        if raw_payload:
            raw = request.SerializeToString() + _field(9, raw_payload)
            runner.api.channel.unary_unary("/noetl.v1.ExecutionService/SubmitExecution",
                                           request_serializer=lambda b: b)(raw, timeout=60)
        else:
            runner.api.executions.SubmitExecution(request, timeout=60)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    return str(info.value.details())


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    out, n = bytearray([number << 3 | 2]), len(payload)
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out) + payload


def nested_struct(depth: int) -> bytes:
    """The bytes of a Struct nesting ``depth`` objects ({"a": {"a": ...}}), built on the
    wire: no encoder (and no Python recursion) in the way."""
    inner = b""
    for _ in range(depth - 1):
        value = _field(5, inner)  # Value.struct_value
        inner = _field(1, _field(1, b"a") + _field(2, value))  # Struct.fields entry {key, value}
    return inner


def catalog_has(db: Db, path: str) -> bool:
    return bool(db.value("SELECT count(*) FROM noetl.catalog WHERE path = %s", (path,)))


# ---------------------------------------------------------------- payloads


def test_an_oversized_payload_is_refused_naming_the_limit(runner: Runner, db: Db) -> None:
    c = canary(runner)
    message = refused(runner, CANARY, {"blob": "x" * (10 * 1024 * 1024)})
    assert "NOETL_LIMIT_PAYLOAD_BYTES=4194304" in message and "payload is" in message, message
    canary_completes(runner, c)


def test_deeply_nested_payloads_are_refused_by_the_decoder(runner: Runner) -> None:
    """protobuf's decoder stops at 100 message levels (about 32 JSON levels of a Struct,
    below NOETL_LIMIT_NESTING_DEPTH's default): the api says so, as INVALID_ARGUMENT."""
    c = canary(runner)
    for depth in (10_000, 900, 40):
        message = refused(runner, CANARY, raw_payload=nested_struct(depth))
        assert "could not be decoded" in message and "nests deeper" in message, message
    canary_completes(runner, c)


LARGE = HEADER.format(name="hostile_large_payload") + """workload:
  blob: ""
  keys: []
workflow:
  - step: each
    loop:
      in: "{{ keys }}"
      iterator: k
      spec: {mode: parallel, max_in_flight: 16}
    tool:
      kind: python
      input: {k: "{{ k }}", n: "{{ blob | length }}"}
      code: "result = [k, n]"
"""


def test_a_large_payload_within_the_limits_runs_by_reference(runner: Runner, db: Db) -> None:
    """3 MB of workload, 64 iterations: claims carry its reference, not 64 copies of it."""
    blob = "y" * (3 * 1024 * 1024)
    sub = runner.submit(LARGE, {"blob": blob, "keys": list(range(64))})
    out = runner.wait(sub.execution_id, 120)
    assert out.status == "COMPLETED", out.error
    assert out.result("each")["results"] == [[k, len(blob)] for k in range(64)]
    ref = db.value("SELECT workload_ref_id FROM noetl.execution_request WHERE execution_id = %s",
                   (sub.execution_id,))
    assert ref, "the workload was not stored by reference"


# ---------------------------------------------------------------- playbooks


def test_oversized_playbooks_are_refused_and_register_nothing(runner: Runner, db: Db) -> None:
    c = canary(runner)
    big = HEADER.format(name="hostile_big") + "workload:\n  pad: \"" + "z" * (2 * 1024 * 1024) + "\"\n" + \
        "workflow:\n  - step: start\n    tool: {kind: noop}\n"
    message = refused(runner, big)
    assert "NOETL_LIMIT_PLAYBOOK_BYTES=1048576" in message, message
    huge = big.replace("z" * (2 * 1024 * 1024), "z" * (20 * 1024 * 1024))
    message = refused(runner, huge, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "larger than max" in message, message
    assert not catalog_has(db, "tests/failover/hostile_big")
    canary_completes(runner, c)


BILLION_LAUGHS = HEADER.format(name="hostile_laughs") + """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
workflow:
  - step: start
    tool: {kind: noop}
"""


def test_a_billion_laughs_document_is_refused_fast(runner: Runner, db: Db) -> None:
    c = canary(runner)
    started = time.monotonic()
    message = refused(runner, BILLION_LAUGHS)
    assert time.monotonic() - started < 5
    assert "NOETL_LIMIT_YAML_NODES" in message, message
    assert not catalog_has(db, "tests/failover/hostile_laughs")
    canary_completes(runner, c)


def wide(name: str, steps: int) -> str:
    """``steps`` steps; ``start`` jumps near the end (the first arc whose `when` holds),
    so three of them run."""
    lines = [HEADER.format(name=name) + "workflow:",
             "  - step: start", "    tool: {kind: noop}",
             "    next:", "      spec: {mode: exclusive}", "      arcs:",
             f"        - {{step: s{steps - 2}, when: \"{{{{ true }}}}\"}}", "        - {step: s1}"]
    for i in range(1, steps - 1):
        nxt = f"s{i + 1}" if i < steps - 2 else "end"
        lines += [f"  - step: s{i}", "    tool: {kind: noop}", f"    next: {{arcs: [{{step: {nxt}}}]}}"]
    lines += ["  - step: end", "    tool: {kind: python, code: \"result = 'done'\"}"]
    return "\n".join(lines) + "\n"


def test_a_10000_step_playbook_runs_and_one_more_step_is_refused(runner: Runner) -> None:
    c = canary(runner)
    out = runner.run(wide("hostile_wide", 10_000), timeout=120)
    assert out.status == "COMPLETED", out.error
    assert set(out.steps) == {"start", "s9998", "end"} and out.result("end") == "done"
    message = refused(runner, wide("hostile_wider", 10_001))
    assert "NOETL_LIMIT_PLAYBOOK_STEPS=10000" in message, message
    canary_completes(runner, c)


# ---------------------------------------------------------------- what tasks do


def one_step(name: str, code: str = "", inputs: dict[str, str] | None = None) -> str:
    body = HEADER.format(name=name) + "workflow:\n  - step: start\n    tool:\n      kind: python\n"
    if inputs:
        body += "      input:\n" + "".join(f"        {k}: \"{v}\"\n" for k, v in inputs.items())
    return body + f"      code: \"{code or 'result = 1'}\"\n"


def test_templates_that_explode_fail_their_step_fast(runner: Runner) -> None:
    c = canary(runner)
    for expr, setting in (("{{ 3**(3**16) }}", "NOETL_LIMIT_TEMPLATE_INT_BITS"),
                          ("{{ 'x' * 10**10 }}", "NOETL_LIMIT_TEMPLATE_VALUE_SIZE")):
        started = time.monotonic()
        out = runner.run(one_step("hostile_template", "result = v", {"v": expr}), timeout=60)
        assert out.status == "FAILED" and setting in out.error, (expr, out.error)
        assert time.monotonic() - started < 30
    canary_completes(runner, c)


def test_a_100mb_result_fails_its_task_naming_the_limit(runner: Runner) -> None:
    c = canary(runner)
    out = runner.run(one_step("hostile_result", "result = 'r' * (100 * 1024 * 1024)"), timeout=120)
    assert out.status == "FAILED", out.error
    assert "RESULT_TOO_LARGE" in out.steps["start"]["error"] or "NOETL_LIMIT_RESULT_BYTES" in out.error, out.steps
    canary_completes(runner, c)


MILLION = HEADER.format(name="hostile_million") + """workflow:
  - step: make
    tool: {kind: python, code: "result = list(range(1000000))"}
    next: {arcs: [{step: each}]}
  - step: each
    loop:
      in: "{{ make }}"
      iterator: n
      spec: {mode: parallel}
    tool: {kind: noop}
"""


def test_a_million_item_loop_is_refused_naming_the_limit(runner: Runner) -> None:
    c = canary(runner)
    out = runner.run(MILLION, timeout=120)
    assert out.status == "FAILED", out.error
    assert "has 1000000 items; limit NOETL_LIMIT_LOOP_ITEMS=500000" in out.error, out.error
    canary_completes(runner, c)


SELF = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: hostile_self, path: tests/hostile/self}
workflow:
  - step: start
    tool: {kind: playbook, path: tests/hostile/self}
"""


def test_a_playbook_calling_itself_stops_at_the_depth_limit(runner: Runner, db: Db) -> None:
    c = canary(runner)
    out = runner.run(SELF, timeout=120)
    assert out.status == "FAILED", out.error
    errors = " ".join(r["error"] or "" for r in db.all(
        "SELECT error FROM noetl.execution WHERE playbook_path = %s", ("tests/hostile/self",)))
    assert f"NOETL_LIMIT_SUBPLAYBOOK_DEPTH={SUBPLAYBOOK_DEPTH}" in errors, errors
    depth = db.value("SELECT max(depth) FROM noetl.execution_request r JOIN noetl.catalog c USING (catalog_id)"
                     " WHERE c.path = %s", ("tests/hostile/self",))
    assert depth == SUBPLAYBOOK_DEPTH
    canary_completes(runner, c)


# ---------------------------------------------------------------- memory, last


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def test_a_burst_of_calls_in_flight_together_is_served_none_cancelled(runner: Runner) -> None:
    """3,000 calls in flight at once on one connection. gRPC's own default holds 1,000
    calls the role has not taken up yet and cancels the others at random (CANCELLED, no
    reason: 409 of 3,000 here before NOETL_GRPC_MAX_PENDING_CALLS); every call is answered."""
    calls = [runner.api.executions.GetExecution.future(
        execution_pb2.GetExecutionRequest(execution_id=10**15 + i), timeout=120) for i in range(3000)]
    codes: dict[str, int] = {}
    for call in calls:
        try:
            call.result()
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name  # type: ignore[attr-defined]
        codes[code] = codes.get(code, 0) + 1
    assert codes == {"NOT_FOUND": 3000}
    canary_completes(runner, canary(runner))


def test_zz_every_role_stayed_within_its_memory_bound(runner: Runner) -> None:
    """Last in the module: the peak resident memory of every role process over all of the
    above (python task interpreters are children of the worker, bounded on their own by
    NOETL_WORKER_PYTHON_MEMORY_MB)."""
    peaks: dict[str, float] = {}
    for proc in runner.state.processes():
        assert proc.alive(), f"{proc.instance} died"
        peaks[proc.instance] = round(vm_hwm_mib(proc.pid), 1)
    over = {name: mib for name, mib in peaks.items()
            if mib > MEMORY_BOUND_MIB.get(name.rsplit("-", 1)[0], MEMORY_BOUND_OTHERS_MIB)}
    print(f"peak resident memory per role (MiB): {peaks}")
    assert not over, f"roles above their memory bound: {over} (all: {peaks})"
    until_sync(lambda: all(p.health() == "SERVING" for p in runner.state.processes()),
               timeout=30, what="every role SERVING")
