"""Backpressure: when saturated, SubmitExecution answers RESOURCE_EXHAUSTED with a retry
hint instead of queueing without bound; capacity freed is capacity admitted again."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import Runner, start_stack
from waiting import until_sync

from noetl_cli import devstack

pytestmark = pytest.mark.e2e

SLEEPER = ("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: sleeper, path: tests/backpressure}\n"
           "workflow:\n  - step: start\n    tool: {kind: python, code: \"import time\\ntime.sleep(3)\"}\n")


@pytest.fixture(scope="module")
def small() -> Iterator[Runner]:
    home = Path(tempfile.mkdtemp(prefix="noetl-bp-"))
    os.chmod(home, 0o755)
    state = start_stack(home, env={"NOETL_EXECUTION_MAX_ACTIVE": "2"})
    runner = Runner(state)
    try:
        yield runner
    finally:
        runner.api.close()
        devstack.down(home)
        shutil.rmtree(home, ignore_errors=True)


def test_saturated_submit_is_refused_with_a_retry_hint(small: Runner) -> None:
    first = small.submit(SLEEPER)
    second = small.submit(SLEEPER)

    def one_refused() -> grpc.RpcError | None:
        try:
            small.submit(SLEEPER)
        except grpc.RpcError as exc:
            return exc
        return None

    # the admission view refreshes every second: submissions are admitted until it does
    refused = until_sync(one_refused, timeout=10, interval=0.2,
                         what="a submission refused (no third concurrent execution past the limit of 2)")
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "saturated" in refused.details() and "retry after" in refused.details()  # type: ignore[attr-defined]
    metadata = dict(refused.initial_metadata() or ())  # type: ignore[attr-defined]
    assert float(metadata["retry-after"]) > 0
    assert small.wait(first.execution_id, 30).status == "COMPLETED"
    assert small.wait(second.execution_id, 30).status == "COMPLETED"
    # capacity is back: a new submission is admitted once the view refreshes

    def admitted() -> Any:
        try:
            return small.submit(SLEEPER.replace("sleep(3)", "sleep(0)"))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            return None

    sub = until_sync(admitted, timeout=10, what="a submission admitted after the load drained", interval=0.2)
    assert small.wait(sub.execution_id, 30).status == "COMPLETED"
