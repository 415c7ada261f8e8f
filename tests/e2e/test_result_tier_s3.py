"""The object-store result tier through all seven processes: a stack whose workers write
results to a real S3-protocol server (SeaweedFS, SigV4 enforced, started by the test on
free loopback ports) and whose api and workers read them back.

* A 5 MB result completes; no event result is over 2 KB; the downstream step reads the
  whole value (its length and hash), and the value lives in S3, not in Postgres.
* Stopping the S3 server while a step persists yields ``call.error`` with
  REFERENCE_NOT_AVAILABLE and a FAILED step and execution: no hang, no lost result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Runner, start_stack, worker_busy
from waiting import until_sync

from noetl_cli import devstack
from noetl_cli.localstack import S3Server, start_s3
from noetl_client import values

pytestmark = pytest.mark.e2e

BUCKET = "noetl-e2e"
HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: {name}\n  path: tests/s3/{name}\n"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3(tmp_path_factory.mktemp("s3"), buckets=(BUCKET,))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_stack(s3: S3Server) -> Iterator[Runner]:
    home = Path(tempfile.mkdtemp(prefix="noetl-s3-"))
    os.chmod(home, 0o755)
    state = start_stack(home, env={
        "NOETL_RESULT_TIER": "s3", "NOETL_RESULT_S3_ENDPOINT": s3.endpoint, "NOETL_RESULT_S3_BUCKET": BUCKET,
        "NOETL_RESULT_S3_ACCESS_KEY": s3.access_key, "NOETL_RESULT_S3_SECRET_KEY": s3.secret_key,
        "NOETL_RESULT_S3_PREFIX": "e2e/", "NOETL_RESULT_TIMEOUT_SEC": "5",
        "NOETL_RESULT_S3_CONNECT_TIMEOUT_SEC": "1",
        # an outage of the store is waited out this long before a result is given up on
        "NOETL_WORKER_INFRA_RETRY_SEC": "8",
    })
    runner = Runner(state)
    try:
        yield runner
    finally:
        runner.api.close()
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)


BIG = HEADER.format(name="big") + """workflow:
  - step: big
    tool:
      kind: python
      code: |
        import hashlib
        data = "".join(chr(97 + (i * 7) % 26) for i in range(5_000_000))
        result = {"data": data, "length": len(data), "sha256": hashlib.sha256(data.encode()).hexdigest()}
    next: {arcs: [{step: check}]}
  - step: check
    tool:
      kind: python
      input: {data: "{{ big.data }}", declared: "{{ big.length }}"}
      code: |
        import hashlib
        result = {"length": len(data), "sha256": hashlib.sha256(data.encode()).hexdigest(), "declared": declared}
"""


def metric_samples(state: devstack.StackState, role: str, name: str) -> dict[str, float]:
    """{label text: value} of one metric family's samples, summed over the role's replicas."""
    out: dict[str, float] = {}
    for proc in state.processes(role):
        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name):
                    key, _, value = line.rpartition(" ")
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def test_a_five_megabyte_result_travels_by_reference(s3_stack: Runner, s3: S3Server) -> None:
    out = s3_stack.run(BIG, timeout=120)
    assert out.status == "COMPLETED", out.error
    big, check = out.result("big"), out.result("check")
    assert big["length"] == 5_000_000
    assert check == {"length": 5_000_000, "sha256": big["sha256"], "declared": 5_000_000}

    (largest_text, largest_column, count), = s3_stack.sql(
        "SELECT max(octet_length(result::text)), max(pg_column_size(result)), count(*) FROM noetl.event"
        " WHERE execution_id = %s", (out.execution_id,))
    assert count > 0 and largest_text <= 2048 and largest_column <= 2048, (largest_text, largest_column)

    rows = s3_stack.sql("SELECT ref_id, tier, uri, size_bytes, sha256 FROM noetl.result_ref"
                        " WHERE execution_id = %s AND step = 'big'", (out.execution_id,))
    assert len(rows) == 1
    ref_id, tier, uri, size, sha = rows[0]
    assert tier == "s3" and uri == f"s3://{BUCKET}/e2e/{out.execution_id}/{ref_id}.json" and size > 5_000_000
    assert s3_stack.sql("SELECT count(*) FROM noetl.result_payload WHERE ref_id = %s", (ref_id,))[0][0] == 0
    accepted = [values.from_struct(e.result) for e in s3_stack.events(out.execution_id)
                if e.event_type == "call.done" and e.step == "big"]
    assert accepted[0]["reference"] == {"ref_id": ref_id, "type": "s3", "uri": uri}

    import asyncio

    from noetl_store import S3Client, S3Config, decode_json

    async def fetch() -> Any:
        client = S3Client(S3Config(s3.endpoint, BUCKET, s3.access_key, s3.secret_key))
        try:
            return await client.get_object(uri.removeprefix(f"s3://{BUCKET}/"))
        finally:
            await client.close()

    data = asyncio.run(fetch())
    assert len(data) == size and hashlib.sha256(data).hexdigest() == sha
    assert decode_json(data)["sha256"] == big["sha256"]

    # the envelope sizes and the reads by tier are exported
    sizes = metric_samples(s3_stack.state, "worker", "noetl_event_result_bytes_count")
    assert sum(sizes.values()) >= 2
    resolved = metric_samples(s3_stack.state, "worker", "noetl_reference_resolve_seconds_count")
    assert any('tier="s3"' in k and v > 0 for k, v in resolved.items()), resolved


SLOW = HEADER.format(name="slow") + """workflow:
  - step: slow
    tool:
      kind: python
      code: |
        import time
        time.sleep(4)
        result = {"rows": list(range(1000))}
"""


def test_an_s3_outage_while_persisting_is_reference_not_available(s3_stack: Runner, s3: S3Server) -> None:
    """Last in the module: it takes the S3 server down, for longer than the worker waits
    out an outage (NOETL_WORKER_INFRA_RETRY_SEC=8): only then is the result given up on."""
    sub = s3_stack.submit(SLOW)
    until_sync(lambda: worker_busy(s3_stack.state) >= 1, timeout=30, what="the slow step to be running")
    s3.kill()
    out = s3_stack.wait(sub.execution_id, timeout=60)
    assert out.status == "FAILED"
    assert out.steps["slow"]["status"] == "FAILED"
    assert "REFERENCE_NOT_AVAILABLE" in out.steps["slow"]["error"] or "S3" in out.steps["slow"]["error"]
    errors = [values.from_struct(e.result) for e in s3_stack.events(sub.execution_id)
              if e.event_type == "call.error" and e.step == "slow"]
    assert len(errors) == 1
    assert errors[0]["status"] == "error" and errors[0]["reference"] is None
    assert errors[0]["error"]["code"] == "REFERENCE_NOT_AVAILABLE"
    assert "cannot reach the S3 server" in errors[0]["error"]["message"]
    assert not [e for e in s3_stack.events(sub.execution_id) if e.event_type == "call.done"]
    assert s3_stack.sql("SELECT count(*) FROM noetl.result_ref WHERE execution_id = %s",
                        (sub.execution_id,))[0][0] == 0
