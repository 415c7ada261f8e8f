"""``script:`` sources (inline, a file under NOETL_WORKER_SCRIPT_DIR beside the playbook's
catalog path, http) and python ``code`` rendered as a template, run through the worker's
tools with real python sandbox children and a real local HTTP server."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from noetl_dsl.templates import RenderContext
from noetl_worker.tools import CallInfo, DuckdbTool, PythonPool, Tools
from noetl_worker.tools.scripts import ScriptError, file_script_path, resolve_script

pytestmark = pytest.mark.integration


class _Scripts(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/hello.py":
            body = b"result = {'from': 'http', 'auth': AUTH}\n"
            self.send_response(200)
        else:
            body = b"nope"
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripts)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
async def python() -> AsyncIterator[PythonPool]:
    async with PythonPool(1, memory_mb=1024) as pool:
        yield pool


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    (tmp_path / "fixtures" / "scripts").mkdir(parents=True)
    (tmp_path / "fixtures" / "scripts" / "hello.py").write_text("result = {'who': name, 'from': 'file'}\n")
    (tmp_path / "fixtures" / "scripts" / "count.sql").write_text("SELECT count(*) AS n FROM range({{ n }})")
    (tmp_path / "shared.py").write_text("result = 'root'\n")
    (tmp_path.parent / "outside.py").write_text("result = 'stolen'\n")
    (tmp_path / "fixtures" / "link.py").symlink_to(tmp_path.parent / "outside.py")
    return tmp_path


def call(playbook_path: str) -> CallInfo:
    return CallInfo(1, "1:s:1", "s", "k", playbook_path=playbook_path)


async def test_file_scripts_resolve_beside_the_catalog_path_then_at_the_root(root: Path) -> None:
    assert await resolve_script({"path": "scripts/hello.py", "source": {"type": "file"}}, root=root,
                                playbook_path="fixtures/my_playbook") == "result = {'who': name, 'from': 'file'}\n"
    assert await resolve_script({"path": "shared.py", "source": "file"}, root=root,
                                playbook_path="fixtures/my_playbook") == "result = 'root'\n"
    assert file_script_path(str(root / "shared.py"), root) == (root / "shared.py").resolve()
    # upstream's fixtures spell the file as `uri` (python_file_example: `./fixtures/...`)
    for uri in ("./fixtures/scripts/hello.py", "file://fixtures/scripts/hello.py"):
        assert await resolve_script({"uri": uri, "source": {"type": "file"}}, root=root,
                                    playbook_path="tests/python_file") == "result = {'who': name, 'from': 'file'}\n"
    assert await resolve_script({"uri": "file://shared.py"}, root=root) == "result = 'root'\n"


@pytest.mark.parametrize("path", ["../outside.py", "link.py", "/etc/passwd", "scripts/../../../outside.py"])
async def test_file_scripts_never_leave_the_root(root: Path, path: str) -> None:
    with pytest.raises(ScriptError, match="outside the worker's script directory"):
        await resolve_script({"path": path, "source": {"type": "file"}}, root=root, playbook_path="fixtures/p")


async def test_file_scripts_are_refused_without_a_root_and_other_sources_named(root: Path) -> None:
    with pytest.raises(ScriptError, match="NOETL_WORKER_SCRIPT_DIR"):
        await resolve_script({"path": "shared.py", "source": {"type": "file"}}, root=None)
    with pytest.raises(ScriptError, match="'gcs' is not supported"):
        await resolve_script({"path": "x.py", "source": {"type": "gcs", "bucket": "b"}}, root=root)
    with pytest.raises(ScriptError, match="not found"):
        await resolve_script({"path": "missing.py", "source": {"type": "file"}}, root=root)
    assert await resolve_script("result = 1", root=None) == "result = 1"
    assert await resolve_script({"source": {"type": "inline"}, "content": "x = 2"}, root=None) == "x = 2"


async def test_http_scripts(http_base: str) -> None:
    text = await resolve_script({"source": {"type": "http", "endpoint": f"{http_base}/hello.py"}}, root=None)
    assert "from': 'http'" in text
    assert await resolve_script({"uri": f"{http_base}/hello.py"}, root=None) == text
    with pytest.raises(ScriptError, match="HTTP 404"):
        await resolve_script({"uri": f"{http_base}/missing.py"}, root=None)


async def test_a_python_task_runs_its_file_script(python: PythonPool, root: Path) -> None:
    tools = Tools(python=python, script_dir=str(root))
    task = {"kind": "python", "input": {"name": "{{ who }}"}, "script": {"path": "scripts/hello.py",
                                                                          "source": {"type": "file"}}}
    out = await tools.run_task(task, RenderContext({"who": "ada"}), call=call("fixtures/my_playbook"))
    assert out.status == "ok", out.error
    assert out.data == {"who": "ada", "from": "file"}
    refused = await tools.run_task({**task, "script": {"path": "../outside.py", "source": {"type": "file"}}},
                                   RenderContext({"who": "ada"}), call=call("fixtures/my_playbook"))
    assert refused.error is not None and refused.error.code == "INVALID_TASK"
    assert "outside the worker's script directory" in refused.error.message


async def test_a_python_task_runs_an_http_script(python: PythonPool, http_base: str) -> None:
    tools = Tools(python=python)
    task = {"kind": "python", "input": {"AUTH": "none"}, "script": {"source": {"type": "http",
                                                                                "endpoint": "{{ base }}/hello.py"}}}
    out = await tools.run_task(task, RenderContext({"base": http_base}))
    assert out.status == "ok", out.error
    assert out.data == {"from": "http", "auth": "none"}


async def test_python_code_holding_a_template_is_rendered(python: PythonPool) -> None:
    tools = Tools(python=python)
    code = "# limit {{ limit }}\nresult = {'limit': {{ limit }}, 'name': '{{ user.name }}', 'plain': f'{x}'}"
    out = await tools.run_task({"kind": "python", "input": {"x": 1}, "code": code},
                               RenderContext({"limit": 5, "user": {"name": "ada"}}))
    assert out.status == "ok", out.error
    assert out.data == {"limit": 5, "name": "ada", "plain": "1"}
    # Code without a template runs as written (f-string braces untouched).
    out = await tools.run_task({"kind": "python", "code": "d = {'a': 1}\nresult = f'{d}'"}, RenderContext({}))
    assert out.data == "{'a': 1}"
    bad = await tools.run_task({"kind": "python", "code": "result = {{ nope }}"}, RenderContext({}))
    assert bad.error is not None and bad.error.code == "TEMPLATE_ERROR"


async def test_a_duckdb_task_runs_its_file_script_rendered(python: PythonPool, root: Path, tmp_path: Path) -> None:
    tools = Tools(python=python, script_dir=str(root), duckdb=DuckdbTool(python, tmp_path / "duck"))
    task = {"kind": "duckdb", "script": {"path": "scripts/count.sql", "source": {"type": "file"}}}
    out = await tools.run_task(task, RenderContext({"n": 4}), call=call("fixtures/p"))
    assert out.status == "ok", out.error
    assert out.data["rows"] == [{"n": 4}]


async def test_python_args_are_globals_and_main_arguments_like_input(python: PythonPool) -> None:
    """Upstream's python tool binds a task's ``args`` as it binds ``input`` (its
    variable_lifecycle example: ``def main(email, retry_count)`` with ``args:``)."""
    tools = Tools(python=python)
    task = {"kind": "python", "args": {"email": "{{ who }}@example.com", "n": 2}, "input": {"n": 3},
            "code": "def main(email, n):\n    return {'domain': email.split('@')[1], 'n': n, 'g': email}"}
    out = await tools.run_task(task, RenderContext({"who": "ada"}))
    assert out.status == "ok", out.error
    assert out.data == {"domain": "example.com", "n": 3, "g": "ada@example.com"}  # input wins over args
    bad = await tools.run_task({**task, "args": ["not", "a", "mapping"]}, RenderContext({"who": "ada"}))
    assert bad.error is not None and bad.error.code == "INVALID_TASK" and "task args must be a mapping" in bad.error.message
