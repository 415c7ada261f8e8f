"""Retention through all seven processes: a stack whose compactor is enabled with a
horizon of a few seconds.

* ``GetTrace`` (and ``noetl-rt trace``) returns a step's lineage, newest first; after
  compaction it returns the same chain from the manifest, the execution's events are
  gone, and ``GetExecution`` still answers from the read models.
* A synthetic finished execution in an old day's partition (written as the runtime writes
  one: events, read models, result references) is compacted and its emptied partition is
  dropped: it disappears from ``pg_class``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from harness import Runner, rpc_code, start_stack
from waiting import until_sync

from noetl_cli import devstack
from noetl_common.db import make_pool, partition_name
from noetl_compactor.synthetic import write_executions
from noetl_proto.v1 import execution_pb2

pytestmark = pytest.mark.e2e

RETENTION_SEC = 12.0
SHARDS = 4

PIPELINE = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: lineage, path: tests/compaction/lineage}
workflow:
  - step: pipe
    tool:
      - {name: fetch, kind: python, code: "result = {'rows': [1, 2, 3]}"}
      - {name: double, kind: python, input: {rows: "{{ fetch.rows }}"}, code: "result = {'rows': [r * 2 for r in rows]}"}
      - {name: total, kind: python, input: {rows: "{{ double.rows }}"}, code: "result = {'sum': sum(rows)}"}
    next: {arcs: [{step: after}]}
  - step: after
    tool: {kind: python, input: {s: "{{ pipe.sum }}"}, code: "result = {'seen': s}"}
"""


@pytest.fixture(scope="module")
def retention_stack() -> Iterator[Runner]:
    home = Path(tempfile.mkdtemp(prefix="noetl-compact-"))
    os.chmod(home, 0o755)
    state = start_stack(home, env={
        "NOETL_COMPACTOR_ENABLED": "true", "NOETL_RETENTION_DAYS": str(RETENTION_SEC / 86_400),
        "NOETL_COMPACTOR_INTERVAL_SEC": "1", "NOETL_SHARD_COUNT": str(SHARDS),
    })
    runner = Runner(state)
    try:
        yield runner
    finally:
        runner.api.close()
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)


def get_trace(runner: Runner, execution_id: int, step: str) -> execution_pb2.GetTraceResponse:
    return runner.api.executions.GetTrace(execution_pb2.GetTraceRequest(execution_id=execution_id, step=step),
                                          timeout=10)


def entries(resp: execution_pb2.GetTraceResponse) -> list[tuple[object, ...]]:
    return [(e.ref_id, e.parent_ref_id, e.tier, e.uri, e.size_bytes, e.task, e.command_id, e.step, e.sha256,
             e.created_at.ToDatetime()) for e in resp.entries]


def manifest_exists(runner: Runner, execution_id: int) -> bool:
    return bool(runner.sql("SELECT 1 FROM noetl.manifest WHERE execution_id = %s", (execution_id,)))


def test_trace_is_the_same_before_and_after_compaction(retention_stack: Runner) -> None:
    runner = retention_stack
    out = runner.run(PIPELINE, timeout=60)
    assert out.status == "COMPLETED", out.error
    assert out.result("after") == {"seen": 12}

    before = get_trace(runner, out.execution_id, "pipe")
    assert not before.from_manifest
    assert [e.task for e in before.entries] == ["total", "double", "fetch"]
    chain = before.entries
    assert chain[0].parent_ref_id == chain[1].ref_id and chain[1].parent_ref_id == chain[2].ref_id
    assert chain[2].parent_ref_id == 0 and all(e.tier == "db" and e.size_bytes > 0 for e in chain)
    assert chain[0].ref_id == out_ref(runner, out.execution_id, "pipe")
    cli = runner.cli("trace", str(out.execution_id), "pipe", "--json")
    assert cli.returncode == 0, cli.stderr
    printed = json.loads(cli.stdout)
    assert printed["from_manifest"] is False and [e["task"] for e in printed["entries"]] == ["total", "double", "fetch"]

    for step, message in (("nope", "step 'nope'"),):
        with pytest.raises(grpc.RpcError) as missing:
            get_trace(runner, out.execution_id, step)
        assert rpc_code(missing.value) == grpc.StatusCode.NOT_FOUND and message in missing.value.details()  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as unknown:
        get_trace(runner, 12345, "pipe")
    assert rpc_code(unknown.value) == grpc.StatusCode.NOT_FOUND

    until_sync(lambda: manifest_exists(runner, out.execution_id), timeout=90, what="the execution to be compacted")
    assert runner.sql("SELECT count(*) FROM noetl.event WHERE execution_id = %s", (out.execution_id,))[0][0] == 0
    assert runner.events(out.execution_id) == []
    after = get_trace(runner, out.execution_id, "pipe")
    assert after.from_manifest and entries(after) == entries(before)
    cli = runner.cli("trace", str(out.execution_id), "pipe")
    assert cli.returncode == 0 and "from the execution's manifest" in cli.stdout
    assert all(str(e.ref_id) in cli.stdout for e in before.entries)

    # the read models stay
    again = runner.wait(out.execution_id, timeout=5)
    assert again.status == "COMPLETED" and again.result("after") == {"seen": 12}
    assert again.result("pipe") == {"sum": 12}
    (count, depth, terminal), = runner.sql(
        "SELECT event_count, chain_depth, terminal_ref_id FROM noetl.manifest WHERE execution_id = %s",
        (out.execution_id,))
    assert count > 0 and terminal == max(out_ref(runner, out.execution_id, s) for s in ("pipe", "after"))
    assert depth == (3 if terminal == chain[0].ref_id else 1)


def out_ref(runner: Runner, execution_id: int, step: str) -> int:
    return int(runner.sql("SELECT result_ref_id FROM noetl.execution_step WHERE execution_id = %s AND step = %s",
                          (execution_id, step))[0][0])


RERUN = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: rerun_compacted, path: tests/compaction/rerun}
workload: {dir: /nonexistent}
workflow:
  - step: first
    tool: {kind: python, code: "import uuid\\nresult = {'token': uuid.uuid4().hex}"}
    next: {arcs: [{step: second}]}
  - step: second
    tool:
      kind: python
      input: {dir: "{{ workload.dir }}", token: "{{ first.token }}"}
      code: |
        import os
        if not os.path.exists(dir + "/marker"):
            raise RuntimeError("marker missing")
        result = {"token": token}
"""


def test_a_compacted_execution_reruns_from_what_retention_keeps(retention_stack: Runner, tmp_path: Path) -> None:
    """Retention deletes events only: the engine state, loop tables and result references a
    rerun starts from stay, so a compacted original reruns, and its kept result resolves."""
    runner = retention_stack
    tmp_path.chmod(0o777)
    out = runner.run(RERUN, {"dir": str(tmp_path)}, timeout=60)
    assert out.status == "FAILED" and "marker missing" in out.error
    token = out.result("first")["token"]
    until_sync(lambda: manifest_exists(runner, out.execution_id), timeout=90, what="the execution to be compacted")
    assert runner.events(out.execution_id) == []
    (tmp_path / "marker").write_text("fixed")
    resp = runner.api.executions.RerunExecution(execution_pb2.RerunExecutionRequest(
        execution_id=out.execution_id), timeout=30)
    again = runner.wait(resp.execution_id, timeout=60)
    assert again.status == "COMPLETED", again.error
    assert again.result("second") == {"token": token} and again.result("first") == {"token": token}
    kept = get_trace(runner, resp.execution_id, "first")
    assert [e.ref_id for e in kept.entries] == [out_ref(runner, out.execution_id, "first")]


def test_an_emptied_old_partition_is_dropped(retention_stack: Runner) -> None:
    runner = retention_stack
    day = datetime.now(UTC).date() - timedelta(days=10)
    name = partition_name(day)

    async def write() -> list[int]:
        pool = make_pool(runner.state.postgres_dsn, min_size=1, max_size=1, name="test-synthetic")
        await pool.open(wait=True, timeout=30)
        try:
            made = await write_executions(pool, day=day, count=3, events_per_execution=8, chain=2,
                                          shard_count=SHARDS)
        finally:
            await pool.close()
        return [m.execution_id for m in made]

    ids = asyncio.run(write())
    assert runner.sql("SELECT count(*) FROM noetl.event WHERE execution_id = ANY(%s)", (ids,))[0][0] == 24
    until_sync(lambda: not runner.sql("SELECT 1 FROM pg_class WHERE relname = %s", (name,)), timeout=90,
               what=f"partition {name} to be dropped")
    assert all(manifest_exists(runner, i) for i in ids)
    trace = get_trace(runner, ids[0], "step_2")
    assert trace.from_manifest and len(trace.entries) == 2

    samples: dict[str, float] = {}
    for proc in runner.state.processes("compactor"):
        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(("noetl_compactor_", )) and not line.startswith("#"):
                    key, _, value = line.rpartition(" ")
                    samples[key] = samples.get(key, 0.0) + float(value)
    assert sum(v for k, v in samples.items() if k.startswith("noetl_compactor_executions_total")) >= 3
    assert any(k.startswith("noetl_compactor_batch_seconds_total") and v > 0 for k, v in samples.items())
    assert sum(v for k, v in samples.items() if k.startswith("noetl_compactor_partitions_dropped_total")) >= 1
