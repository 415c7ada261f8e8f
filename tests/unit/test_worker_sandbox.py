"""The python tool's warm pool: NoETL task semantics, isolation of the protocol pipe,
timeouts, cancellation and crashes (each kills the child and the pool recovers)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from waiting import until

from noetl_worker.sandbox import compile_task, run_task
from noetl_worker.tools import PythonPool, Tools
from noetl_worker.tools.dispatch import python_code


@pytest.fixture(scope="module")
async def pool() -> AsyncIterator[PythonPool]:
    async with PythonPool(2) as p:
        yield p


async def value(pool: PythonPool, code: str, inputs: dict | None = None, **kw: object) -> object:
    out = await pool.run(code, inputs or {}, **kw)  # type: ignore[arg-type]
    assert out.status == "ok", out.error
    return out.data


# ---------------------------------------------------------------- result precedence


async def test_result_variable(pool: PythonPool) -> None:
    assert await value(pool, 'result = {"status": "initialized"}') == {"status": "initialized"}


async def test_top_level_return(pool: PythonPool) -> None:
    assert await value(pool, 'return {"status": "completed"}') == {"status": "completed"}


async def test_top_level_return_inside_if_and_for(pool: PythonPool) -> None:
    code = "for i in range(10):\n    if i == x:\n        return i * 10\nreturn -1\n"
    assert await value(pool, code, {"x": 3}) == 30
    assert await value(pool, code, {"x": 42}) == -1


async def test_return_inside_try_is_not_swallowed_by_except_exception(pool: PythonPool) -> None:
    code = "try:\n    return 'early'\nexcept Exception:\n    result = 'caught'\n"
    assert await value(pool, code) == "early"


async def test_return_beats_result_and_nested_function_returns_are_untouched(pool: PythonPool) -> None:
    code = "def helper(v):\n    return v + 1\nresult = 'ignored'\nreturn helper(1)\n"
    assert await value(pool, code) == 2


async def test_result_beats_main(pool: PythonPool) -> None:
    assert await value(pool, "def main():\n    return 'main'\nresult = 'result'\n") == "result"


async def test_main_called_with_kwargs_from_input_by_signature(pool: PythonPool) -> None:
    code = "def main(a, b=5):\n    return {'sum': a + b}\n"
    assert await value(pool, code, {"a": 1, "unrelated": 9}) == {"sum": 6}


async def test_main_with_var_keyword_gets_all_inputs(pool: PythonPool) -> None:
    code = "def main(**kw):\n    return sorted(kw)\n"
    assert await value(pool, code, {"a": 1, "b": 2}) == ["a", "b"]


async def test_main_without_parameters(pool: PythonPool) -> None:
    assert await value(pool, 'def main():\n    return {"status": "ok"}\n') == {"status": "ok"}


async def test_async_main(pool: PythonPool) -> None:
    assert await value(pool, "async def main(x):\n    return x * 2\n", {"x": 21}) == 42


async def test_no_value_is_none_even_when_input_has_result_key(pool: PythonPool) -> None:
    assert await value(pool, "x = 1", {"result": "from input"}) is None


# ---------------------------------------------------------------- globals


async def test_input_keys_and_input_data(pool: PythonPool) -> None:
    code = "result = {'m': message, 'data': input_data}"
    assert await value(pool, code, {"message": "hi"}) == {"m": "hi", "data": {"message": "hi"}}


async def test_input_data_key_wins(pool: PythonPool) -> None:
    assert await value(pool, "result = input_data", {"input_data": [1, 2], "x": 1}) == [1, 2]


async def test_context_global(pool: PythonPool) -> None:
    out = await value(pool, "result = sorted(context)", context={"workload": {}, "ctx": {"a": 1}})
    assert out == ["ctx", "workload"]


async def test_fresh_globals_per_task(pool: PythonPool) -> None:
    for _ in range(3):  # both children, more than once
        await value(pool, "leak = 1\nresult = 0")
        assert await value(pool, "result = 'leak' in globals()") is False


async def test_libs_module_and_from_import(pool: PythonPool) -> None:
    code = "result = [mathmod.floor(2.5), dumps({'a': 1}), osp.join('a', 'b')]"
    libs = {"mathmod": "math", "dumps": {"from": "json", "import": "dumps"}, "osp": {"from": "os", "import": "path"}}
    assert await value(pool, code, libs=libs) == [2, '{"a": 1}', "a/b"]


async def test_dunder_name_for_logging(pool: PythonPool) -> None:
    code = "import logging\nresult = logging.getLogger(__name__).name"
    assert await value(pool, code) == "__main__"


async def test_values_use_the_result_codec(pool: PythonPool) -> None:
    code = ("import datetime, decimal, uuid\n"
            "return {'d': datetime.date(2024, 1, 2), 'i': decimal.Decimal('3'), 'f': decimal.Decimal('1.5'),"
            " 's': {1}, 't': (1, 2), 'u': uuid.UUID(int=1)}")
    assert await value(pool, code) == {"d": "2024-01-02", "i": 3, "f": 1.5, "s": [1], "t": [1, 2],
                                       "u": "00000000-0000-0000-0000-000000000001"}


async def test_unserialisable_value_is_an_error(pool: PythonPool) -> None:
    out = await pool.run("result = object()", {})
    assert out.status == "error" and out.error is not None
    assert "not JSON serialisable" in out.error.message


# ---------------------------------------------------------------- errors and output


async def test_exception_becomes_error_with_kind_and_traceback(pool: PythonPool) -> None:
    out = await pool.run("x = 1\nraise ValueError(f'bad {x}')", {})
    assert out.status == "error" and out.error is not None
    assert (out.error.code, out.error.exception_type, out.error.kind, out.error.message) == (
        "TOOL_ERROR", "ValueError", "schema", "bad 1")
    assert "line 2" in out.error.details["traceback"]
    assert "sandbox.py" not in out.error.details["traceback"]


async def test_syntax_error(pool: PythonPool) -> None:
    out = await pool.run("result = (", {})
    assert out.error is not None and out.error.exception_type == "SyntaxError"


async def test_sys_exit_is_an_error_and_child_survives(pool: PythonPool) -> None:
    out = await pool.run("import sys\nsys.exit(3)", {})
    assert out.error is not None and out.error.exception_type == "SystemExit"
    assert await value(pool, "return 1") == 1


async def test_print_is_captured_and_fd1_writes_do_not_break_the_protocol(pool: PythonPool) -> None:
    out = await pool.run("print('hello')\nimport os\nos.write(1, b'raw bytes on fd 1\\n')\nresult = 5", {})
    assert out.status == "ok" and out.data == 5
    assert out.stdout == "hello\n"
    assert await value(pool, "return 6") == 6


async def test_stdout_included_in_error_details(pool: PythonPool) -> None:
    out = await pool.run("print('before')\nraise RuntimeError('x')", {})
    assert out.error is not None and out.error.details["stdout"] == "before\n"


async def test_stdin_is_not_the_protocol_pipe(pool: PythonPool) -> None:
    assert await value(pool, "import sys\nresult = sys.stdin.read()") == ""


# ---------------------------------------------------------------- timeouts, cancellation, crashes


async def test_timeout_kills_the_child_and_the_pool_recovers() -> None:
    async with PythonPool(1) as pool:
        first_pid = next(iter(pool._children)).pid
        out = await pool.run("import time\ntime.sleep(30)", {}, timeout_sec=0.3)
        assert out.status == "error" and out.error is not None
        assert out.error.code == "TIMEOUT"
        assert out.error.message == "task exceeded its timeout of 0.3 s"
        start = time.perf_counter()
        assert (await pool.run("return 'next'", {}, timeout_sec=5)).data == "next"
        assert time.perf_counter() - start < 2.0
        assert next(iter(pool._children)).pid != first_pid
        start = time.perf_counter()
        assert (await pool.run("return 'warm'", {})).data == "warm"
        assert time.perf_counter() - start < 0.05  # warm: no interpreter start per task


async def test_cancellation_kills_the_child(tmp_path: Path) -> None:
    started = tmp_path / "started"
    async with PythonPool(1) as pool:
        task = asyncio.ensure_future(pool.run(
            f"import pathlib, time\npathlib.Path({str(started)!r}).write_text('1')\ntime.sleep(30)", {}))
        await until(started.exists, timeout=10, what="the task to start in its child", interval=0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await pool.run("return 'after cancel'", {}, timeout_sec=5)).data == "after cancel"
        assert pool.replacements == 1


async def test_child_crash_reports_exit_code_and_is_replaced() -> None:
    async with PythonPool(1) as pool:
        out = await pool.run("import os\nos._exit(7)", {})
        assert out.status == "error" and out.error is not None
        assert out.error.code == "SANDBOX_EXITED"
        assert "exited with code 7" in out.error.message
        assert (await pool.run("return 'alive'", {}, timeout_sec=5)).data == "alive"


async def test_children_are_recycled_after_max_tasks() -> None:
    async with PythonPool(1, max_tasks_per_child=2) as pool:
        pids = [await value(pool, "import os\nreturn os.getpid()") for _ in range(4)]
        assert pids[0] == pids[1] != pids[2] == pids[3]


async def test_pool_runs_tasks_in_parallel() -> None:
    async with PythonPool(3) as pool:
        start = time.perf_counter()
        outs = await asyncio.gather(*(pool.run("import time\ntime.sleep(0.3)\nreturn 1", {}) for _ in range(3)))
        assert [o.data for o in outs] == [1, 1, 1]
        assert time.perf_counter() - start < 0.85


async def test_pool_starts_warm_and_grows_on_demand_up_to_its_size() -> None:
    async with PythonPool(3, warm=1) as pool:
        assert pool.alive == 1
        assert await value(pool, "return 1") == 1
        assert pool.alive == 1  # a task that found an idle child grows nothing
        sleepy = "import os, time\ntime.sleep(0.4)\nreturn os.getpid()"
        outs = await asyncio.gather(*(pool.run(sleepy, {}) for _ in range(6)))
        assert all(o.ok for o in outs)
        assert pool.alive == 3  # grew while tasks waited, never beyond size
        assert len({o.data for o in outs}) == 3  # each of the three children ran tasks
        await asyncio.gather(*(pool.run(sleepy, {}) for _ in range(6)))
        assert pool.alive == 3


# ---------------------------------------------------------------- helpers


def test_compile_is_cached_and_rewrites_only_top_level_returns() -> None:
    code = "def f():\n    return 1\nreturn f() + 1\n"
    assert compile_task(code) is compile_task(code)
    assert run_task(code, {}, {}, {}) == 2


def test_code_b64() -> None:
    encoded = base64.b64encode(b"return 1").decode()
    assert python_code({"code_b64": encoded}) == "return 1"
    assert python_code({"code_base64": encoded}) == "return 1"
    with pytest.raises(ValueError, match="code_b64"):
        python_code({"code_b64": "!!!"})


async def test_tools_reject_python_without_code() -> None:
    from noetl_dsl.templates import RenderContext

    out = await Tools().run_task({"kind": "python"}, RenderContext({}))
    assert out.error is not None and out.error.code == "INVALID_TASK"


async def test_children_do_not_see_the_runtime_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {"NOETL_POSTGRES_DSN": "postgresql://secret", "NOETL_NATS_URL": "nats://u:pw@nats:4222",
               "NOETL_RESULT_S3_ACCESS_KEY": "AKIA", "NOETL_RESULT_S3_SECRET_KEY": "s3-secret",
               "NOETL_OTEL_ENDPOINT": "https://u:pw@collector:4318",
               "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer x",
               "NOETL_FUTURE_PASSWORD": "pw", "NOETL_SOME_TOKEN": "t"}
    visible = {"NOETL_WORKER_MODE": "pool", "NOETL_WORKER_CONCURRENCY": "8", "NOETL_RESULT_TIER": "db",
               "NOETL_OTEL_EXPORTER": "none", "HOME_KEYBOARD": "kept: not a NOETL_* name"}
    for name, v in {**secrets, **visible}.items():
        monkeypatch.setenv(name, v)
    async with PythonPool(1) as pool:
        names = sorted({**secrets, **visible})
        code = f"import os\nresult = {{n: os.getenv(n) for n in {names!r}}}"
        assert await value(pool, code) == {**dict.fromkeys(secrets), **visible}


async def test_children_survive_sigterm_to_the_process_group(tmp_path: Path) -> None:
    """A graceful stop SIGTERMs the worker's group; running tasks must be allowed to finish."""
    import os
    import signal

    started = tmp_path / "started"
    async with PythonPool(1) as pool:
        pid = next(iter(pool._children)).pid
        task = asyncio.ensure_future(pool.run(
            f"import pathlib, time\npathlib.Path({str(started)!r}).write_text('1')\ntime.sleep(0.4)\nreturn 'done'",
            {}))
        await until(started.exists, timeout=10, what="the task to start in its child", interval=0.01)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        out = await task
        assert out.status == "ok" and out.data == "done"


def test_a_sandbox_child_imports_the_standard_library_and_the_codec_only() -> None:
    """Every child the pool starts (and replaces, every ``max_tasks_per_child`` tasks) pays
    its imports: the result codec must not pull in ``noetl_store`` and its metrics."""
    probe = ("import sys, noetl_worker.sandbox\n"
             "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names)))")
    loaded = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                timeout=60).stdout.split())
    ours = {m for m in loaded if not m.startswith("_")}  # `_`: import hooks of the environment (editable installs)
    assert ours == {"noetl_common", "noetl_common.codec", "noetl_worker", "noetl_worker.sandbox"}
