"""The child interpreter of the python tool's warm pool (``python -m noetl_worker.sandbox``).

Protocol: length-prefixed JSON frames (4-byte big-endian length, UTF-8 JSON) on the
original stdin/stdout, which are moved to private file descriptors at start-up: fd 0
then reads /dev/null and fd 1 writes to stderr, so nothing user code prints (or a C
library writes) can corrupt the protocol. ``print`` output is captured per task and
sent back with the reply.

    parent -> child  {"id", "code", "input", "context", "libs"}
    child -> parent  {"ready": true, "pid", "vm_size", "memory_limit", "memory_error"} once, then per task
                     {"id", "status": "ok", "result", "stdout", "ms"} or
                     {"id", "status": "error", "error": {"kind", "message", "traceback"[, "size"]}, "stdout", "ms"}
                     (``ms``: the task's own time in this process)

Limits (command-line options the pool passes, applied before any task code runs):
``--memory-mb N`` sets this process's address-space limit (``RLIMIT_AS``, soft and hard,
so task code cannot raise it): an allocation beyond it raises ``MemoryError`` in the task,
which is reported with kind ``MemoryError`` (the pool then replaces this process; if even
the report cannot be built, a reply prepared at start-up is sent). ``vm_size`` in the
greeting is the address space in use before the limit was set (bytes, Linux only);
``memory_error`` says why no limit could be set (a platform without ``RLIMIT_AS``).
``--result-bytes N``: a value whose encoded JSON is larger is not sent; the reply is an
error with kind ``ResultTooLarge`` and its ``size``. The value is encoded once, exactly as
the result store encodes it (``encode_value``), and spliced into the reply frame.
Error messages and tracebacks are capped so an error reply stays small.

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
import time
import traceback
from collections import OrderedDict
from contextlib import redirect_stdout
from types import CodeType
from typing import Any, BinaryIO

from noetl_common.codec import json_default

HEADER = struct.Struct(">I")
MAX_STDOUT_CHARS = 256 * 1024
MAX_MESSAGE_CHARS = 16 * 1024
MAX_TRACEBACK_CHARS = 64 * 1024
MEMORY_ERROR = "MemoryError"
RESULT_TOO_LARGE = "ResultTooLarge"
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


def _capped(text: str, limit: int, *, keep_tail: bool = False) -> str:
    if len(text) <= limit:
        return text
    cut = f"[{len(text) - limit} characters cut]"
    return cut + text[-limit:] if keep_tail else text[:limit] + cut


def handle(request: dict[str, Any]) -> dict[str, Any]:
    out = _CappedText()
    reply: dict[str, Any] = {"id": request.get("id")}
    started = time.monotonic()
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
        reply.update(status="error", error={
            "kind": type(exc).__name__, "message": _capped(message, MAX_MESSAGE_CHARS),
            "traceback": _capped(_user_traceback(exc), MAX_TRACEBACK_CHARS, keep_tail=True)})
    reply["stdout"] = out.text()
    reply["ms"] = round(1000 * (time.monotonic() - started), 3)  # the task's own time here (a lane's pace)
    return reply


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, default=json_default, separators=(",", ":"), allow_nan=False).encode()


def encode_value(value: Any) -> bytes:
    """A task's value as the result store will encode it (``noetl_store.encode_json``,
    except that non-finite floats are an error here, not null): its length is the size
    the result size limit is about."""
    return json.dumps(value, default=json_default, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _error_reply(reply: dict[str, Any], kind: str, message: str, **extra: Any) -> bytes:
    return json.dumps({"id": reply.get("id"), "status": "error", "stdout": reply.get("stdout", ""),
                       "error": {"kind": kind, "traceback": "", "message": message, **extra}},
                      default=str).encode()


def encode_reply(reply: dict[str, Any], result_bytes: int = 0) -> list[bytes]:
    """The reply frame's payload, in parts (an ok reply's value is encoded once and spliced
    in, not copied into one buffer). A value larger than ``result_bytes`` (> 0) is not sent:
    the reply says ``ResultTooLarge`` with its size."""
    try:
        if reply.get("status") != "ok":
            return [_dumps(reply)]
        value = encode_value(reply.get("result"))
        if result_bytes and len(value) > result_bytes:
            return [_error_reply(reply, RESULT_TOO_LARGE, f"the task's value is {len(value)} bytes",
                                 size=len(value))]
        head = _dumps({k: v for k, v in reply.items() if k != "result"})
        return [head[:-1], b',"result":', value, b"}"]
    except (TypeError, ValueError) as exc:
        return [_error_reply(reply, type(exc).__name__, f"the task's value is not JSON serialisable: {exc}")]


def write_frame(stream: BinaryIO, *parts: bytes) -> None:
    stream.write(HEADER.pack(sum(len(p) for p in parts)))
    for part in parts:
        stream.write(part)
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


def vm_size() -> int | None:
    """This process's address space in use, in bytes (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def limit_memory(megabytes: int) -> tuple[int, str]:
    """Set this process's address-space limit (soft and hard) to ``megabytes`` MiB, or the
    current hard limit when that is lower; 0 = leave it. Returns (the limit in bytes, or 0
    when none is set; why it could not be set, on a platform without ``RLIMIT_AS``)."""
    if megabytes <= 0:
        return 0, ""
    try:
        import resource

        limit = megabytes * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, AttributeError, ValueError, OSError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    return limit, ""


def parse_options(argv: list[str]) -> dict[str, int]:
    """``--memory-mb N`` and ``--result-bytes N`` (the pool's; no argparse: start-up time)."""
    options = {"memory-mb": 0, "result-bytes": 0}
    args = iter(argv)
    for arg in args:
        name = arg.removeprefix("--")
        if name not in options or not arg.startswith("--"):
            raise SystemExit(f"noetl_worker.sandbox: unknown option {arg!r}")
        options[name] = int(next(args, "0"))
    return options


def main(argv: list[str] | None = None) -> int:
    # The worker owns this process's lifetime (it kills it on timeout, cancel and close;
    # EOF on the protocol pipe ends it): a SIGTERM/SIGINT sent to the worker's process
    # group must not kill a task the worker is letting finish during a graceful stop.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    options = parse_options(sys.argv[1:] if argv is None else argv)
    result_bytes = options["result-bytes"]
    baseline = vm_size()
    memory_limit, memory_error = limit_memory(options["memory-mb"])
    # Prepared while memory is plentiful: the reply when a MemoryError leaves too little to build one.
    out_of_memory = _error_reply({}, MEMORY_ERROR, "out of memory (the reply could not be built)")
    proto_in, proto_out = _take_protocol_fds()
    write_frame(proto_out, json.dumps({"ready": True, "pid": os.getpid(), "vm_size": baseline,
                                       "memory_limit": memory_limit, "memory_error": memory_error}).encode())
    while True:
        try:
            payload = read_frame(proto_in)
        except MemoryError:  # a request too large to hold: the rest of its frame is unread
            write_frame(proto_out, out_of_memory)
            return 1
        if payload is None:
            return 0
        try:
            parts = encode_reply(handle(json.loads(payload)), result_bytes)
        except MemoryError:
            parts = [out_of_memory]
        del payload
        write_frame(proto_out, *parts)
        del parts


if __name__ == "__main__":
    sys.exit(main())
