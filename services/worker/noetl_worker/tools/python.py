"""The python tool: a warm pool of child interpreters (``noetl_worker.sandbox``).

Starting an interpreter costs tens of milliseconds, so the pool starts ``size``
children up front; each runs one task at a time, talking length-prefixed JSON over
its stdin/stdout pipes. A child that overruns its timeout, whose task is cancelled, or
that dies mid-task is killed and replaced in the background; a child is also retired
after ``max_tasks_per_child`` tasks (module state leaks between tasks of a child).

    idle queue --get--> [request frame] --> child --> [reply frame] --put--> idle queue
                                   timeout / cancel / EOF: kill, reap, spawn a new one
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import struct
import sys
from collections.abc import Mapping
from typing import Any

from noetl_common.errors import ConfigError
from noetl_store import encode_json

from .outcome import SANDBOX_EXITED, TIMEOUT, TOOL_ERROR, ToolOutcome

logger = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
SANDBOX_MODULE = "noetl_worker.sandbox"
STDOUT_IN_DETAILS = 4096
# The runtime's own connection strings and secrets are not the task code's business: any
# NOETL_* name that looks secret-bearing (HIDDEN_ENV_MARKERS: NOETL_POSTGRES_DSN,
# NOETL_NATS_URL, NOETL_RESULT_S3_*_KEY, ...) and the names below (the OTLP collector's
# address and the exporter's standard header variables, which carry its credentials) are
# left out of the children's environment.
HIDDEN_ENV = ("NOETL_OTEL_ENDPOINT", "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
HIDDEN_ENV_MARKERS = ("DSN", "URL", "SECRET", "PASSWORD", "TOKEN", "KEY", "CREDENTIAL", "HEADERS")


def hidden_env(name: str) -> bool:
    """True for the variables task code must not see (HIDDEN_ENV, secret-looking NOETL_*)."""
    upper = name.upper()
    return upper in HIDDEN_ENV or (upper.startswith("NOETL_") and any(m in upper for m in HIDDEN_ENV_MARKERS))


class _ChildExited(Exception):
    """The child closed its protocol pipe (it exited)."""


class _Child:
    """One child interpreter and its protocol pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.tasks_run = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def send(self, payload: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(HEADER.pack(len(payload)) + payload)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _ChildExited() from exc

    async def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            header = await self.proc.stdout.readexactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            payload = await self.proc.stdout.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
            raise _ChildExited() from exc
        reply = json.loads(payload)
        if not isinstance(reply, dict):
            raise _ChildExited()
        return reply

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {name}"
    return f"exited with code {code}"


class PythonPool:
    """``size`` warm child interpreters running python tasks.

    ``await pool.start()`` (or ``async with``) before ``run``; ``await pool.close()``
    kills the children."""

    def __init__(self, size: int, *, executable: str | None = None, max_tasks_per_child: int = 1000,
                 start_timeout: float = 30.0, env: Mapping[str, str] | None = None) -> None:
        """``env``: the children's environment (default: this process's, without the
        runtime's secrets: ``hidden_env``), captured when the pool is built."""
        if size < 1:
            raise ConfigError("python pool size must be at least 1")
        self.size = size
        self.executable = executable or sys.executable
        self.max_tasks_per_child = max_tasks_per_child
        self.start_timeout = start_timeout
        self.env = dict(env) if env is not None else {
            k: v for k, v in os.environ.items() if not hidden_env(k)}
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._children: set[_Child] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self._started = False
        self.replacements = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        children = await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        for child in children:
            self._idle.put_nowait(child)
        logger.info("python pool started: %d children", self.size)

    async def close(self) -> None:
        """Kill every child (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for child in list(self._children):
            child.kill()
        for child in list(self._children):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(child.proc.wait(), timeout=5)
        self._children.clear()

    async def __aenter__(self) -> PythonPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def alive(self) -> int:
        return len(self._children)

    @property
    def idle(self) -> int:
        return self._idle.qsize()

    # ------------------------------------------------------------ children

    async def _spawn(self) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            self.executable, "-m", SANDBOX_MODULE,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=self.env)
        child = _Child(proc)
        self._children.add(child)
        try:
            hello = await asyncio.wait_for(child.receive(), timeout=self.start_timeout)
        except (TimeoutError, _ChildExited) as exc:
            child.kill()
            self._children.discard(child)
            rc = await proc.wait()
            raise ConfigError(f"python sandbox did not start ({_exit_text(rc)})") from exc
        if not hello.get("ready"):
            child.kill()
            self._children.discard(child)
            raise ConfigError(f"python sandbox sent an unexpected greeting: {hello!r}")
        return child

    def _retire(self, child: _Child, *, kill: bool) -> None:
        """Stop using ``child``; reap it and start its replacement in the background."""
        if kill:
            child.kill()
        elif child.proc.stdin is not None:
            child.proc.stdin.close()  # EOF: the child exits on its own
        task = asyncio.ensure_future(self._replace(child))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _replace(self, old: _Child) -> None:
        try:
            await asyncio.wait_for(old.proc.wait(), timeout=5)
        except TimeoutError:
            old.kill()
            await old.proc.wait()
        finally:
            self._children.discard(old)
        delay = 0.1
        while not self._closed:
            try:
                child = await self._spawn()
            except (ConfigError, OSError) as exc:
                logger.error("cannot start a python sandbox: %s; retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            if self._closed:
                child.kill()
                return
            self.replacements += 1
            self._idle.put_nowait(child)
            return

    # ------------------------------------------------------------ tasks

    async def run(self, code: str, input: Mapping[str, Any] | None = None,
                  libs: Mapping[str, Any] | None = None, timeout_sec: float | None = None, *,
                  context: Mapping[str, Any] | None = None) -> ToolOutcome:
        """Run ``code`` in a child. ``input`` keys become globals (plus ``input_data``),
        ``context`` is the render scope, ``libs`` maps aliases to modules. ``timeout_sec``
        (None or 0 = none) bounds the run; on overrun the child is killed."""
        if self._closed:
            raise RuntimeError("python pool is closed")
        if not self._started:
            await self.start()
        try:
            request = {"code": code, "input": dict(input or {}), "context": dict(context or {}),
                       "libs": dict(libs or {})}
            payload = encode_json(request)
        except (TypeError, ValueError) as exc:
            return ToolOutcome.failure(TOOL_ERROR, f"task input is not JSON serialisable: {exc}",
                                       kind=type(exc).__name__)
        child = await self._idle.get()
        try:
            reply = await asyncio.wait_for(self._exchange(child, payload), timeout=timeout_sec or None)
        except TimeoutError:
            logger.warning("python task exceeded %ss; killing sandbox pid=%s", timeout_sec, child.pid)
            self._retire(child, kill=True)
            return ToolOutcome.failure(TIMEOUT, f"task exceeded its timeout of {timeout_sec:g} s",
                                       kind="TimeoutError", retryable=True)
        except asyncio.CancelledError:
            self._retire(child, kill=True)
            raise
        except _ChildExited:
            rc = await child.proc.wait()
            self._retire(child, kill=True)
            logger.warning("python sandbox pid=%s %s while running a task", child.pid, _exit_text(rc))
            return ToolOutcome.failure(SANDBOX_EXITED,
                                       f"python sandbox process {_exit_text(rc)} while running the task",
                                       kind="ChildProcessError", details={"exit_code": rc})
        except BaseException:
            self._retire(child, kill=True)
            raise
        child.tasks_run += 1
        if self.max_tasks_per_child and child.tasks_run >= self.max_tasks_per_child:
            self._retire(child, kill=False)
        else:
            self._idle.put_nowait(child)
        return _outcome(reply)

    @staticmethod
    async def _exchange(child: _Child, payload: bytes) -> dict[str, Any]:
        await child.send(payload)
        return await child.receive()


def _outcome(reply: Mapping[str, Any]) -> ToolOutcome:
    stdout = str(reply.get("stdout") or "")
    if reply.get("status") == "ok":
        return ToolOutcome.success(reply.get("result"), stdout=stdout)
    err = reply.get("error") or {}
    details: dict[str, Any] = {"traceback": str(err.get("traceback") or "")}
    if stdout:
        details["stdout"] = stdout[-STDOUT_IN_DETAILS:]
    return ToolOutcome.failure(TOOL_ERROR, str(err.get("message") or "python task failed"),
                               kind=str(err.get("kind") or "Exception"), details=details, stdout=stdout)
