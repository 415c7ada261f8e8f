"""The child interpreter of the python tool's warm pool (``python -m noetl_worker.sandbox``).

Protocol: length-prefixed JSON frames (4-byte big-endian length, UTF-8 JSON) on the
original stdin/stdout, which are moved to private file descriptors at start-up: fd 0
then reads /dev/null and fd 1 writes to stderr, so nothing user code prints (or a C
library writes) can corrupt the protocol. ``print`` output is captured per task and
sent back with the reply.

    parent -> child  {"id", "code", "input", "context", "libs"}
    child -> parent  {"ready": true, "pid"} once, then per task
                     {"id", "status": "ok", "result", "stdout"} or
                     {"id", "status": "error", "error": {"kind", "message", "traceback"}, "stdout"}

Task semantics (NoETL's): fresh globals holding every input key, ``input_data`` (the
input, or its ``input_data`` value when it has one), ``context`` (the render scope) and
the modules named in ``libs``. The value is a top-level ``return X``, else the global
``result`` if the code assigned it, else what ``main(**kwargs)`` returns when the code
defines a callable ``main``.

This module imports only the standard library (plus the stdlib-only result codec) so a
replacement child starts in a few tens of milliseconds.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import io
import json
import os
import signal
import struct
import sys
import traceback
from collections import OrderedDict
from contextlib import redirect_stdout
from types import CodeType
from typing import Any, BinaryIO

from noetl_store._codec import json_default

HEADER = struct.Struct(">I")
MAX_STDOUT_CHARS = 256 * 1024
FILENAME = "<task>"
_MISSING = object()


class TaskReturn(BaseException):
    """Raised by a rewritten top-level ``return``; carries the value."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class _TopLevelReturn(ast.NodeTransformer):
    """Rewrites ``return X`` outside any function/class into ``raise __noetl_return__(X)``."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        value = node.value if node.value is not None else ast.Constant(value=None)
        call = ast.Call(func=ast.Name(id="__noetl_return__", ctx=ast.Load()), args=[value], keywords=[])
        return ast.copy_location(ast.Raise(exc=call, cause=None), node)


_COMPILED: OrderedDict[str, CodeType] = OrderedDict()


def compile_task(code: str) -> CodeType:
    """Parse, rewrite top-level returns, compile; compiled code is cached (loops rerun it)."""
    cached = _COMPILED.get(code)
    if cached is not None:
        _COMPILED.move_to_end(code)
        return cached
    tree = ast.parse(code, filename=FILENAME, mode="exec")
    tree = ast.fix_missing_locations(_TopLevelReturn().visit(tree))
    compiled = compile(tree, FILENAME, "exec")
    _COMPILED[code] = compiled
    if len(_COMPILED) > 256:
        _COMPILED.popitem(last=False)
    return compiled


def import_libs(libs: dict[str, Any]) -> dict[str, Any]:
    """``{alias: "pkg.mod"}`` or ``{alias: {"from": "pkg", "import": "name"}}``."""
    out: dict[str, Any] = {}
    for alias, spec in (libs or {}).items():
        if isinstance(spec, str):
            out[alias] = importlib.import_module(spec)
        elif isinstance(spec, dict) and spec.get("from"):
            module = importlib.import_module(str(spec["from"]))
            name = str(spec.get("import") or alias)
            try:
                out[alias] = getattr(module, name)
            except AttributeError:
                out[alias] = importlib.import_module(f"{spec['from']}.{name}")
        else:
            raise ImportError(f"libs.{alias}: expected a module path or {{from, import}}, got {spec!r}")
    return out


class _CappedText(io.StringIO):
    """A StringIO that stops storing after ``MAX_STDOUT_CHARS`` characters."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0
        self.truncated = False

    def write(self, s: str) -> int:
        room = MAX_STDOUT_CHARS - self.size
        if room <= 0:
            self.truncated = True
            return len(s)
        if len(s) > room:
            self.truncated = True
        kept = s[:room]
        self.size += len(kept)
        super().write(kept)
        return len(s)

    def text(self) -> str:
        return self.getvalue() + ("\n[output truncated]" if self.truncated else "")


def _call_main(fn: Any, inputs: dict[str, Any]) -> Any:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        kwargs = dict(inputs)
    else:
        names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                       inspect.Parameter.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in inputs.items() if k in names}
    value = fn(**kwargs)
    if inspect.isawaitable(value):
        import asyncio

        async def wait() -> Any:
            return await value

        value = asyncio.run(wait())
    return value


def run_task(code: str, inputs: dict[str, Any], context: dict[str, Any], libs: dict[str, Any]) -> Any:
    """Run one task in fresh globals and return its value (exceptions propagate)."""
    compiled = compile_task(code)
    scope: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins,
                             "__noetl_return__": TaskReturn, "context": context}
    scope["input_data"] = inputs["input_data"] if "input_data" in inputs else inputs
    scope.update(inputs)
    scope.update(import_libs(libs))
    before = scope.get("result", _MISSING)
    try:
        exec(compiled, scope)
    except TaskReturn as ret:
        return ret.value
    after = scope.get("result", _MISSING)
    if after is not _MISSING and after is not before:
        return after
    main = scope.get("main")
    if callable(main):
        return _call_main(main, inputs)
    return None


def _user_traceback(exc: BaseException) -> str:
    """The traceback without the sandbox's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else exc.__traceback__))


def handle(request: dict[str, Any]) -> dict[str, Any]:
    out = _CappedText()
    reply: dict[str, Any] = {"id": request.get("id")}
    try:
        with redirect_stdout(out):
            value = run_task(str(request.get("code") or ""), dict(request.get("input") or {}),
                             dict(request.get("context") or {}), dict(request.get("libs") or {}))
        reply.update(status="ok", result=value)
    except SystemExit as exc:
        reply.update(status="error", error={"kind": "SystemExit", "message": f"task called exit({exc.code!r})",
                                            "traceback": ""})
    except BaseException as exc:
        if isinstance(exc, SyntaxError):
            message = f"{exc.msg} (line {exc.lineno})"
        else:
            message = str(exc) or type(exc).__name__
        reply.update(status="error", error={"kind": type(exc).__name__, "message": message,
                                            "traceback": _user_traceback(exc)})
    reply["stdout"] = out.text()
    return reply


def encode_reply(reply: dict[str, Any]) -> bytes:
    try:
        return json.dumps(reply, default=json_default, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        failed = {"id": reply.get("id"), "status": "error", "stdout": reply.get("stdout", ""),
                  "error": {"kind": type(exc).__name__, "traceback": "",
                            "message": f"the task's value is not JSON serialisable: {exc}"}}
        return json.dumps(failed, default=str).encode()


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return payload


def _take_protocol_fds() -> tuple[BinaryIO, BinaryIO]:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull, encoding="utf-8")
    sys.stdout = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    return proto_in, proto_out


def main() -> int:
    # The worker owns this process's lifetime (it kills it on timeout, cancel and close;
    # EOF on the protocol pipe ends it): a SIGTERM/SIGINT sent to the worker's process
    # group must not kill a task the worker is letting finish during a graceful stop.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proto_in, proto_out = _take_protocol_fds()
    write_frame(proto_out, json.dumps({"ready": True, "pid": os.getpid()}).encode())
    while True:
        payload = read_frame(proto_in)
        if payload is None:
            return 0
        write_frame(proto_out, encode_reply(handle(json.loads(payload))))


if __name__ == "__main__":
    sys.exit(main())
