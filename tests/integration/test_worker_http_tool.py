"""The http tool against a tiny local HTTP server (http.server in a thread, port 0)."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from noetl_dsl.templates import RenderContext
from noetl_store import ResultTooLarge
from noetl_worker.tools import HttpTool, Tools

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
SENT: dict[str, int] = {}  # bytes of body each /big?tag= response managed to write
DONE: dict[str, threading.Event] = {}  # set when that response's handler is done writing


def done(tag: str) -> threading.Event:
    return DONE.setdefault(tag, threading.Event())
GZIP_BOMB = gzip.compress(bytes(64 * MIB), compresslevel=9)  # ~64 KB on the wire, 64 MiB decoded


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Test", "yes")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/json":
            self._send(200, json.dumps({"query": query, "auth": self.headers.get("Authorization")}).encode(),
                       "application/json")
        elif url.path == "/text":
            self._send(200, b"plain words", "text/plain")
        elif url.path == "/json-as-text":
            self._send(200, b'{"n": 1}', "text/plain")
        elif url.path.startswith("/status/"):
            code = int(url.path.rsplit("/", 1)[1])
            self._send(code, json.dumps({"error": code}).encode(), "application/json")
        elif url.path == "/big":  # 100 MiB, declared (Content-Length) or not (close-delimited)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            if query.get("declare") == "1":
                self.send_header("Content-Length", str(100 * MIB))
            self.end_headers()
            tag, chunk = query.get("tag", ""), b"x" * (64 * 1024)
            SENT[tag] = 0
            try:
                for _ in range(1600):
                    self.wfile.write(chunk)
                    SENT[tag] += len(chunk)
            except OSError:  # the client hung up
                pass
            finally:
                done(tag).set()
        elif url.path == "/gzip":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(GZIP_BOMB)))
            self.end_headers()
            self.wfile.write(GZIP_BOMB)
        elif url.path == "/slow":
            time.sleep(float(query.get("s", "2")))  # a slow server, not a wait: the client's timeout is tested
            self._send(200, b"{}", "application/json")
        else:
            self._send(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode()
        self._send(201, json.dumps({"received": raw, "ctype": self.headers.get("Content-Type")}).encode(),
                   "application/json")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
async def http() -> AsyncIterator[HttpTool]:
    tool = HttpTool()
    yield tool
    await tool.close()


async def test_get_json_with_params_and_headers(server: str, http: HttpTool) -> None:
    out = await http.run({"url": f"{server}/json", "params": {"cursor": "", "limit": 10, "flag": True},
                          "headers": {"Authorization": "Bearer t"}})
    assert out.status == "ok" and out.http == {"status": 200}
    assert out.data["status_code"] == 200
    assert out.data["headers"]["x-test"] == "yes"
    assert out.data["body"] == {"query": {"limit": "10", "flag": "true"}, "auth": "Bearer t"}


async def test_text_and_json_without_json_content_type(server: str, http: HttpTool) -> None:
    assert (await http.run({"url": f"{server}/text"})).data["body"] == "plain words"
    assert (await http.run({"url": f"{server}/json-as-text"})).data["body"] == {"n": 1}


async def test_post_bodies(server: str, http: HttpTool) -> None:
    out = await http.run({"method": "post", "url": f"{server}/echo", "json": {"a": 1}})
    assert out.status == "ok" and out.data["status_code"] == 201
    assert json.loads(out.data["body"]["received"]) == {"a": 1}
    out = await http.run({"method": "POST", "url": f"{server}/echo", "data": {"k": "v"}})
    assert out.data["body"] == {"received": "k=v", "ctype": "application/x-www-form-urlencoded"}
    out = await http.run({"method": "POST", "url": f"{server}/echo", "body": "raw text"})
    assert out.data["body"]["received"] == "raw text"


@pytest.mark.parametrize(("code", "retryable"), [(404, False), (400, False), (408, True), (429, True),
                                                 (500, True), (503, True)])
async def test_error_statuses(server: str, http: HttpTool, code: int, retryable: bool) -> None:
    out = await http.run({"url": f"{server}/status/{code}"})
    assert out.status == "error" and out.error is not None
    assert out.error.retryable is retryable
    assert out.http == {"status": code}
    assert out.data["body"] == {"error": code}
    assert f"HTTP {code}" in out.error.message


async def test_network_error_is_retryable(http: HttpTool) -> None:
    out = await http.run({"url": "http://127.0.0.1:1/nothing"})
    assert out.status == "error" and out.error is not None
    assert out.error.code == "NETWORK_ERROR" and out.error.retryable and out.http is None


async def test_timeout(server: str, http: HttpTool) -> None:
    out = await http.run({"url": f"{server}/slow", "params": {"s": 2}}, timeout_sec=0.3)
    assert out.error is not None and out.error.code == "TIMEOUT" and out.error.retryable


async def test_missing_url(http: HttpTool) -> None:
    out = await http.run({"method": "GET"})
    assert out.error is not None and out.error.code == "INVALID_TASK"


async def test_rendered_through_tools_with_policy_shape(server: str, http: HttpTool) -> None:
    """test_pagination_cursor shape: url and params are templates over workload and ctx."""
    tools = Tools(http=http)
    scope = RenderContext({"api_url": server, "ctx": {"cursor": "abc", "limit": 10}})
    task = {"kind": "http", "method": "GET", "url": "{{ api_url }}/json",
            "params": {"cursor": "{{ ctx.cursor }}", "limit": "{{ ctx.limit }}"}}
    out = await tools.run_task(task, scope)
    assert out.status == "ok", out.error
    assert out.to_output()["data"]["body"]["query"] == {"cursor": "abc", "limit": "10"}
    assert out.to_output()["http"] == {"status": 200}


# ---------------------------------------------------------------- result size limit (NOETL_LIMIT_RESULT_BYTES)


def status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def reset_peak_rss() -> tuple[int, str]:
    """Reset this process's peak RSS (``/proc/self/clear_refs``): (the RSS now in KiB, the
    field to read afterwards: the peak, or the RSS where the reset is not allowed)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return status_kb("VmRSS"), "VmRSS"
    return status_kb("VmRSS"), "VmHWM"


@pytest.mark.parametrize("declare", ["1", "0"], ids=["content-length", "close-delimited"])
async def test_a_body_past_the_limit_is_not_read(server: str, declare: str) -> None:
    """100 MiB offered, 4 MiB allowed: refused from Content-Length, or the read stops at
    the limit and the connection is dropped (the server could not write the rest)."""
    tool = HttpTool(max_body_bytes=4 * MIB)
    tag = f"declare-{declare}"
    before, field = reset_peak_rss()
    with pytest.raises(ResultTooLarge) as caught:
        await tool.run({"url": f"{server}/big", "params": {"declare": declare, "tag": tag}}, timeout_sec=30)
    assert caught.value.limit == 4 * MIB and caught.value.size > 4 * MIB and not caught.value.exact
    assert (status_kb(field) - before) / 1024 < 32  # MiB: the 100 MiB were never held
    assert await asyncio.to_thread(done(tag).wait, 10)  # the handler saw the hang-up
    assert SENT[tag] < 40 * MIB
    assert (await tool.run({"url": f"{server}/json"})).status == "ok"  # the client is fine
    await tool.close()


async def test_a_compressed_body_is_limited_decoded(server: str) -> None:
    tool = HttpTool(max_body_bytes=4 * MIB)
    assert len(GZIP_BOMB) < MIB
    with pytest.raises(ResultTooLarge):
        await tool.run({"url": f"{server}/gzip"})
    await tool.close()


async def test_too_large_through_tools_names_the_task(server: str) -> None:
    tool = HttpTool(max_body_bytes=4 * MIB)
    out = await Tools(http=tool).run_task({"kind": "http", "name": "fetch_all", "url": f"{server}/big",
                                           "params": {"declare": "1", "tag": "tools"}}, RenderContext({}))
    assert out.error is not None
    assert (out.error.code, out.error.retryable) == ("RESULT_TOO_LARGE", False)
    assert out.error.message == (f"result of task 'fetch_all' is at least {100 * MIB} bytes; "
                                 f"limit NOETL_LIMIT_RESULT_BYTES={4 * MIB}")
    await tool.close()
