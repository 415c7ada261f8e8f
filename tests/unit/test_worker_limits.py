"""Hostile python tasks against the worker's limits (issue 11): a task that allocates past
NOETL_WORKER_PYTHON_MEMORY_MB fails with MEMORY_LIMIT and its interpreter is replaced; a
result past NOETL_LIMIT_RESULT_BYTES fails with RESULT_TOO_LARGE, measured by the child,
and refused by the worker from the reply's length header alone when the child lies.
The worker process's own memory stays flat throughout (its peak RSS is measured)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from waiting import until

from noetl_common.errors import ConfigError
from noetl_dsl.templates import RenderContext
from noetl_proto.v1 import messages_pb2
from noetl_store import MemoryResultStore, ResultTooLarge, encode_json, envelope_from_proto
from noetl_worker.runner import StoreFailure, execute_command, persist_result
from noetl_worker.tools import PythonPool, Tools
from noetl_worker.tools.python import FRAME_SLACK

MEMORY_MB = 256
RESULT_BYTES = 32 * 1024 * 1024
MIB = 1024 * 1024


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@contextmanager
def peak_rss_growth() -> Iterator[dict[str, float]]:
    """The growth (MiB) of this process's peak RSS over the block: the peak is reset first
    (``/proc/self/clear_refs``), so an earlier peak cannot hide one (where the reset is not
    allowed, the RSS after the block is compared instead)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        field = "VmHWM"
    except OSError:
        field = "VmRSS"
    before = status_kb("VmRSS")
    out: dict[str, float] = {}
    yield out
    out["mib"] = (status_kb(field) - before) / 1024


@pytest.fixture(scope="module")
async def pool() -> AsyncIterator[PythonPool]:
    async with PythonPool(1, memory_mb=MEMORY_MB, result_bytes=RESULT_BYTES) as p:
        yield p


@pytest.fixture(scope="module")
async def roomy() -> AsyncIterator[PythonPool]:
    """The default memory limit: room to build a 100 MB value (and its encoding)."""
    async with PythonPool(1, memory_mb=1024, result_bytes=RESULT_BYTES) as p:
        yield p


def child_pid(pool: PythonPool) -> int:
    (child,) = pool._children
    return child.pid


# ---------------------------------------------------------------- memory


async def test_an_idle_interpreter_fits_well_under_the_default_limit(pool: PythonPool) -> None:
    assert pool.idle_vm_size is not None
    assert pool.idle_vm_size < 64 * MIB  # measured ~23 MiB; the default limit is 1024 MiB
    limits = (await pool.run("import resource\nreturn resource.getrlimit(resource.RLIMIT_AS)", {})).data
    assert limits == [MEMORY_MB * MIB, MEMORY_MB * MIB]
    env = (await pool.run("import os\nreturn os.environ.get('MALLOC_ARENA_MAX')", {})).data
    assert env == "2"


async def test_task_code_cannot_lift_the_limit(pool: PythonPool) -> None:
    out = await pool.run("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", {})
    assert out.error is not None and (out.error.exception_type, out.error.kind) == ("ValueError", "schema")


@pytest.mark.parametrize("code", [
    f"x = bytearray(2 * {MEMORY_MB} * 1024 * 1024)\nreturn len(x)",
    "chunks = []\nwhile True:\n    chunks.append(b'x' * (4 * 1024 * 1024))",
], ids=["one-allocation", "growing"])
async def test_allocating_past_the_limit_is_memory_limit_and_the_child_is_replaced(
        pool: PythonPool, code: str) -> None:
    first = child_pid(pool)
    with peak_rss_growth() as growth:
        out = await pool.run(code, {}, timeout_sec=60)
    assert out.status == "error" and out.error is not None
    assert (out.error.code, out.error.exception_type, out.error.kind, out.error.retryable) == (
        "MEMORY_LIMIT", "MemoryError", "limit", False)
    assert out.error.message == f"python task exceeded its memory limit NOETL_WORKER_PYTHON_MEMORY_MB={MEMORY_MB}"
    assert growth["mib"] < 32  # the worker's own memory did not follow the child's
    assert (await pool.run("return 'next'", {}, timeout_sec=10)).data == "next"
    assert child_pid(pool) != first


async def test_a_reply_too_big_to_build_in_the_child_is_memory_limit(pool: PythonPool) -> None:
    """The value fits, its encoding does not: the reply prepared at start-up is sent."""
    async with PythonPool(1, memory_mb=MEMORY_MB) as unlimited_results:
        out = await unlimited_results.run("return 'x' * (120 * 1024 * 1024)", {}, timeout_sec=60)
        assert out.error is not None and out.error.code == "MEMORY_LIMIT"
        assert (await unlimited_results.run("return 1", {}, timeout_sec=10)).data == 1


async def test_threads_run_under_the_limit(pool: PythonPool) -> None:
    """glibc reserves 64 MiB of address space per malloc arena (one per thread, up to 8 per
    core); MALLOC_ARENA_MAX=2 keeps 32 threads well inside 256 MiB."""
    code = ("import threading\nout = []\n"
            "def work():\n    out.append(len(b''.join(bytes(1000) for _ in range(1000))))\n"
            "threads = [threading.Thread(target=work) for _ in range(32)]\n"
            "[t.start() for t in threads]\n[t.join() for t in threads]\nreturn sum(out)")
    out = await pool.run(code, {}, timeout_sec=30)
    assert out.status == "ok", out.error
    assert out.data == 32_000_000


async def test_a_limit_below_an_idle_interpreter_fails_the_start_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="NOETL_WORKER_PYTHON_MEMORY_MB=24"):
        await PythonPool(1, memory_mb=24).start()


async def test_no_limit_when_zero() -> None:
    async with PythonPool(1, memory_mb=0, env={"PATH": os.environ.get("PATH", "")}) as unlimited:
        out = await unlimited.run("import os, resource\n"
                                  "return [resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY,"
                                  " os.environ.get('MALLOC_ARENA_MAX')]", {})
        assert out.data == [True, None]


def test_a_platform_without_rlimit_as_runs_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from noetl_worker.sandbox import limit_memory

    def refuse(*args: Any) -> None:
        raise ValueError("not supported")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert limit_memory(1024) == (0, "ValueError: not supported")
    assert limit_memory(0) == (0, "")


async def test_a_child_killed_from_outside_mid_task_is_sandbox_exited(pool: PythonPool, tmp_path: Path) -> None:
    """What the kernel's OOM killer does (SIGKILL): reported, replaced, the next task runs."""
    started = tmp_path / "started"
    task = asyncio.ensure_future(pool.run(
        f"import pathlib, time\npathlib.Path({str(started)!r}).write_text('1')\ntime.sleep(30)", {}))

    def begun() -> bool:
        assert not task.done(), f"the task ended before it began: {task.result()}"
        return started.exists()

    await until(begun, timeout=10, what="the task to start in its child", interval=0.01)
    os.kill(child_pid(pool), signal.SIGKILL)
    out = await task
    assert out.error is not None and out.error.code == "SANDBOX_EXITED"
    assert "was killed by signal SIGKILL" in out.error.message
    assert (await pool.run("return 'alive'", {}, timeout_sec=10)).data == "alive"


# ---------------------------------------------------------------- result size


async def test_a_result_over_the_limit_is_refused_by_the_child(roomy: PythonPool) -> None:
    pid = child_pid(roomy)
    with peak_rss_growth() as growth:
        start = time.perf_counter()
        with pytest.raises(ResultTooLarge) as caught:
            await roomy.run("return 'x' * (100 * 1024 * 1024)", {}, timeout_sec=60)
        elapsed = time.perf_counter() - start
    size = 100 * MIB + 2  # the quotes
    assert (caught.value.size, caught.value.limit, caught.value.exact) == (size, RESULT_BYTES, True)
    assert str(caught.value) == f"result is {size} bytes; limit NOETL_LIMIT_RESULT_BYTES={RESULT_BYTES}"
    assert growth["mib"] < 32 and elapsed < 10
    assert child_pid(roomy) == pid  # nothing wrong with the interpreter: it stays


async def test_the_limit_is_the_encoded_size_the_store_sees() -> None:
    async with PythonPool(1, result_bytes=1024) as small:
        at_limit = "é" * 511  # 2 bytes each in UTF-8, plus 2 quotes: exactly 1024 bytes
        assert len(encode_json(at_limit)) == 1024
        assert (await small.run(f"return {at_limit!r}", {})).data == at_limit
        with pytest.raises(ResultTooLarge) as caught:
            await small.run(f"return {at_limit + 'e'!r}", {})
        assert caught.value.size == 1025


TAMPER = """
import __main__
def huge(reply, limit=0):
    return [b'{"status":"ok","result":"', b'x' * (100 * 1024 * 1024), b'"}']
__main__.encode_reply = huge
return 'armed'
"""


async def test_a_child_that_skips_its_own_check_is_refused_from_the_frame_header(roomy: PythonPool) -> None:
    """Task code can rewrite its interpreter; the worker reads 4 bytes of the 100 MB reply,
    kills the child and starts another."""
    assert (await roomy.run(TAMPER, {})).data == "armed"
    pid = child_pid(roomy)
    with peak_rss_growth() as growth:
        start = time.perf_counter()
        with pytest.raises(ResultTooLarge) as caught:
            await roomy.run("return 1", {}, timeout_sec=60)
        elapsed = time.perf_counter() - start
    assert caught.value.exact is False and caught.value.size >= 100 * MIB - FRAME_SLACK
    assert "at least" in str(caught.value)
    assert growth["mib"] < 32 and elapsed < 10
    assert (await roomy.run("return 'fresh'", {}, timeout_sec=10)).data == "fresh"
    assert child_pid(roomy) != pid


async def test_error_replies_stay_small(pool: PythonPool) -> None:
    out = await pool.run("raise ValueError('m' * 10_000_000)", {})
    assert out.error is not None and (out.error.exception_type, out.error.kind) == ("ValueError", "schema")
    assert len(out.error.message) < 20_000 and "characters cut" in out.error.message
    assert len(out.error.details["traceback"]) < 70_000


async def test_tools_name_the_task_and_the_error_is_not_retryable(roomy: PythonPool) -> None:
    tools = Tools(python=roomy)
    out = await tools.run_task({"kind": "python", "name": "big", "code": "return 'y' * (40 * 1024 * 1024)"},
                               RenderContext({"_task": "big"}), timeout_sec=60)
    assert out.error is not None
    size = 40 * MIB + 2
    assert (out.error.code, out.error.exception_type, out.error.kind, out.error.retryable) == (
        "RESULT_TOO_LARGE", "ResultTooLarge", "limit", False)
    assert out.error.message == f"result of task 'big' is {size} bytes; limit NOETL_LIMIT_RESULT_BYTES={RESULT_BYTES}"
    assert out.error.details == {"size_bytes": size, "size_exact": True, "limit_bytes": RESULT_BYTES,
                                 "setting": "NOETL_LIMIT_RESULT_BYTES"}


# ---------------------------------------------------------------- the store's check and the runner


def command(spec: dict[str, Any]) -> messages_pb2.Command:
    ctx = {"execution_id": 321, "workload": {}, "ctx": {}, "steps": {}, "known_steps": [], "event": {}, "iter": None}
    return messages_pb2.Command(command_id="321:step:1", execution_id=321, shard_id=1, step="step", attempt=1,
                                kind="noop", spec_json=json.dumps(spec), context_json=json.dumps(ctx))


async def test_the_store_refuses_a_value_over_its_limit_and_writes_nothing() -> None:
    store = MemoryResultStore(max_bytes=1024)
    at_limit = "x" * 1022
    ref = await store.put(at_limit, execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
    assert await store.get(ref.ref_id) == at_limit
    with pytest.raises(ResultTooLarge, match=r"^result of task 't' is 1025 bytes; limit "
                                             r"NOETL_LIMIT_RESULT_BYTES=1024$"):
        await store.put(at_limit + "x", execution_id=1, step="s", command_id="c", task="t", parent_ref_id=None)
    assert len(store) == 1


async def test_persist_result_lets_result_too_large_through_not_as_a_store_failure() -> None:
    store = MemoryResultStore(max_bytes=1024)
    with pytest.raises(ResultTooLarge) as caught:
        await persist_result(store, "x" * 2000, command=command({}), task="t", parent_ref_id=None)
    assert not isinstance(caught.value, StoreFailure)


async def test_a_result_the_store_refuses_fails_the_command_with_result_too_large() -> None:
    """Tools that cannot measure their value first (here noop) meet the store's exact check."""
    store = MemoryResultStore(max_bytes=4096)
    spec = {"step": "step", "tool": [{"name": "small", "kind": "noop", "input": {"n": 1}},
                                     {"name": "echo", "kind": "noop", "input": {"blob": "z" * 5000}}]}
    env = envelope_from_proto((await execute_command(command(spec), store, Tools())).envelope)
    assert env["status"] == "error" and env["reference"] is None
    assert env["error"]["code"] == "RESULT_TOO_LARGE" and env["error"]["retryable"] is False
    assert env["error"]["message"] == ("result of task 'echo' is 5011 bytes; limit "
                                       "NOETL_LIMIT_RESULT_BYTES=4096")
    assert env["parent_ref"] is not None and await store.get(env["parent_ref"]["ref_id"]) == {"n": 1}
    assert len(store) == 1


async def test_an_input_too_large_for_the_child_is_memory_limit(pool: PythonPool) -> None:
    """The request frame itself does not fit in the child (300 MB of input under 256 MiB)."""
    out = await pool.run("return len(blob)", {"blob": "b" * (300 * 1024 * 1024)}, timeout_sec=60)
    assert out.error is not None and out.error.code == "MEMORY_LIMIT"
    assert (await pool.run("return 'after'", {}, timeout_sec=10)).data == "after"
