"""The python tool: a warm pool of child interpreters (``noetl_worker.sandbox``).

Starting an interpreter costs tens of milliseconds, so the pool keeps children warm:
it starts ``warm`` of them up front and grows by one, in the background, whenever a task
finds none idle, up to ``size`` (it never shrinks: the peak demand stays warm). Each runs
one task at a time, talking length-prefixed JSON over
its stdin/stdout pipes. A child that overruns its timeout, whose task is cancelled, or
that dies mid-task (or sends what is not a reply: task code can write to the protocol
pipe) is killed and replaced in the background; a child is also retired
after ``max_tasks_per_child`` tasks (module state leaks between tasks of a child).

    idle queue --get--> [request frame] --> child --> [reply frame] --put--> idle queue
                                   timeout / cancel / EOF: kill, reap, spawn a new one

Limits. ``memory_mb`` (``NOETL_WORKER_PYTHON_MEMORY_MB``) is each child's address-space
limit: the child sets ``RLIMIT_AS`` on itself from its command line (``--memory-mb``)
before it greets the pool, so no task code ever runs without it, and it reports the
address space it used before (its idle size). Not ``preexec_fn``: it runs Python between
fork and exec in this threaded process (gRPC, executors), which Python documents as
deadlock-prone, and it disables the posix_spawn/vfork path. Not ``prlimit`` on the pid
from here: Linux-only, and applied from outside at an arbitrary point of the start-up.
A task that allocates beyond it gets ``MemoryError``; its reply fails the task with
``MEMORY_LIMIT`` and the child is replaced (a MemoryError can leave an interpreter in a
bad state). The children run with ``MALLOC_ARENA_MAX=2`` (unless set): glibc reserves
64 MiB of address space per thread arena, which would make a threaded task hit the
limit without using the memory. An idle child uses ~18 MiB of address space; a limit
that leaves less than ``MIN_MEMORY_HEADROOM`` above that fails the pool's start.

``result_bytes`` (``NOETL_LIMIT_RESULT_BYTES``): the child encodes the value once, as the
result store will, and replies ``ResultTooLarge`` instead of sending a larger one; the
pool also refuses any reply frame above ``result_bytes + FRAME_SLACK`` from its length
header alone (a task can tamper with its own interpreter), killing the child instead of
reading the frame. Both raise ``noetl_store.ResultTooLarge`` (the dispatcher makes it the
task's ``RESULT_TOO_LARGE`` error).
"""

from __future__ import annotations

import asyncio
import collections
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
from noetl_store import ResultTooLarge, encode_json

from ..sandbox import MEMORY_ERROR, RESULT_TOO_LARGE
from .outcome import MEMORY_LIMIT, SANDBOX_EXITED, TIMEOUT, TOOL_ERROR, ToolOutcome

logger = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
SANDBOX_MODULE = "noetl_worker.sandbox"
STDOUT_IN_DETAILS = 4096
DRAIN_CHUNK = 64 * 1024  # reads of a dead child's leftover output
MEMORY_SETTING = "NOETL_WORKER_PYTHON_MEMORY_MB"
# What a reply frame may hold beyond the value: captured stdout (256 Ki characters, up to
# 12 bytes each once JSON-escaped), the capped error message and traceback, the keys.
FRAME_SLACK = 8 * 1024 * 1024
# Address space a child must have beyond its idle size for a memory limit to be usable.
MIN_MEMORY_HEADROOM = 32 * 1024 * 1024
# glibc malloc arenas per child when a memory limit is set (each reserves 64 MiB of address space).
MALLOC_ARENAS = "2"
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


class _FrameTooLarge(Exception):
    """The child announced a reply frame larger than the pool accepts (not read)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"reply frame of {size} bytes")
        self.size = size


class _Child:
    """One child interpreter and its protocol pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.tasks_run = 0
        # What task code writes to stderr (and C code to fd 1) goes through the worker's
        # logging, whose filter masks the secrets of running commands (noetl_common.redact).
        self.stderr_pump = asyncio.ensure_future(_pump_stderr(proc)) if proc.stderr is not None else None

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

    async def receive(self, max_size: int = 0) -> dict[str, Any]:
        """The next reply. A frame above ``max_size`` (> 0) raises ``_FrameTooLarge`` before
        its payload is read (the pipe's reader buffers at most its 64 KiB limit beyond it)."""
        assert self.proc.stdout is not None
        try:
            header = await self.proc.stdout.readexactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            if max_size and size > max_size:
                raise _FrameTooLarge(size)
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

    async def discard_output(self) -> None:
        """Read and drop what a dead child left in its pipe (at most the pipe's capacity), so
        the pipe reaches EOF and its transport closes (a refused frame was left unread)."""
        if self.proc.stdout is not None:
            with contextlib.suppress(Exception):
                while await self.proc.stdout.read(DRAIN_CHUNK):
                    pass


STDERR_LOGGER = logging.getLogger("noetl_worker.python.stderr")
STDERR_LINE = 64 * 1024  # a longer line is logged in pieces


async def _pump_stderr(proc: asyncio.subprocess.Process) -> None:
    """Log a child's stderr line by line until it closes."""
    assert proc.stderr is not None
    pending = b""
    with contextlib.suppress(Exception):
        while chunk := await proc.stderr.read(DRAIN_CHUNK):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            while len(pending) > STDERR_LINE:
                lines.append(pending[:STDERR_LINE])
                pending = pending[STDERR_LINE:]
            for line in lines:
                STDERR_LOGGER.info("python pid %s: %s", proc.pid, line.decode("utf-8", "replace").rstrip("\r"))
    if pending:
        STDERR_LOGGER.info("python pid %s: %s", proc.pid, pending.decode("utf-8", "replace"))


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
    """Up to ``size`` warm child interpreters running python tasks (``warm`` started up front).

    ``await pool.start()`` (or ``async with``) before ``run``; ``await pool.close()``
    kills the children."""

    def __init__(self, size: int, *, warm: int | None = None, executable: str | None = None,
                 max_tasks_per_child: int = 10_000, start_timeout: float = 30.0, env: Mapping[str, str] | None = None,
                 memory_mb: int = 0, result_bytes: int = 0) -> None:
        """``env``: the children's environment (default: this process's, without the
        runtime's secrets: ``hidden_env``), captured when the pool is built. ``memory_mb``:
        each child's address-space limit in MiB, ``result_bytes``: the largest value (encoded
        JSON) a task may return; 0 = no limit (module docstring)."""
        if size < 1:
            raise ConfigError("python pool size must be at least 1")
        self.size = size
        self.warm = max(1, min(size, size if warm is None else warm))
        self.executable = executable or sys.executable
        self.max_tasks_per_child = max_tasks_per_child
        self.start_timeout = start_timeout
        self.memory_mb = max(0, memory_mb)
        self.result_bytes = max(0, result_bytes)
        self.max_frame = self.result_bytes + FRAME_SLACK if self.result_bytes else 0
        self.env = dict(env) if env is not None else {
            k: v for k, v in os.environ.items() if not hidden_env(k)}
        if self.memory_mb:
            self.env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
        self.idle_vm_size: int | None = None  # address space of a child before any task (bytes)
        self._unlimited_warned = False
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._children: set[_Child] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self._started = False
        self._growing = 0  # children being started to grow the pool
        self.replacements = 0
        self.lanes = 0  # lanes holding a child (``PythonLane``)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        children = await asyncio.gather(*(self._spawn() for _ in range(self.warm)))
        for child in children:
            self._idle.put_nowait(child)
        logger.info("python pool started: %d children (up to %d on demand), memory limit %s, result limit %s, "
                    "idle child %s", self.warm, self.size, f"{self.memory_mb} MiB" if self.memory_mb else "none",
                    f"{self.result_bytes} bytes" if self.result_bytes else "none",
                    f"{self.idle_vm_size / 2**20:.1f} MiB address space" if self.idle_vm_size else "unmeasured")

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

    def _command(self) -> list[str]:
        args = [self.executable, "-m", SANDBOX_MODULE]
        if self.memory_mb:
            args += ["--memory-mb", str(self.memory_mb)]
        if self.result_bytes:
            args += ["--result-bytes", str(self.result_bytes)]
        return args

    async def _spawn(self) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            *self._command(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self.env)
        child = _Child(proc)
        self._children.add(child)
        limited = f" with {MEMORY_SETTING}={self.memory_mb}" if self.memory_mb else ""
        try:
            hello = await asyncio.wait_for(child.receive(max_size=FRAME_SLACK), timeout=self.start_timeout)
        except (TimeoutError, _ChildExited, _FrameTooLarge, ValueError) as exc:
            child.kill()
            self._children.discard(child)
            rc = await proc.wait()
            raise ConfigError(f"python sandbox did not start{limited} ({_exit_text(rc)})") from exc
        problem = "" if hello.get("ready") else f"it sent an unexpected greeting: {hello!r}"
        vm_size, limit = hello.get("vm_size"), hello.get("memory_limit")
        if not problem and self.memory_mb and not limit and not self._unlimited_warned:
            self._unlimited_warned = True
            logger.warning("%s=%d is not enforced: the python sandbox cannot limit its memory here (%s)",
                           MEMORY_SETTING, self.memory_mb, hello.get("memory_error") or "no RLIMIT_AS")
        if not problem and isinstance(vm_size, int) and isinstance(limit, int):
            self.idle_vm_size = vm_size
            if limit and limit - vm_size < MIN_MEMORY_HEADROOM:
                problem = (f"{MEMORY_SETTING}={self.memory_mb} leaves {(limit - vm_size) / 2**20:.0f} MiB beyond "
                           f"the {vm_size / 2**20:.0f} MiB of address space an idle interpreter uses; at least "
                           f"{MIN_MEMORY_HEADROOM // 2**20} MiB more are needed")
        if problem:
            child.kill()
            self._children.discard(child)
            await proc.wait()
            raise ConfigError(f"python sandbox cannot be used: {problem}")
        return child

    def _grow(self) -> None:
        """No child is idle: start one more in the background, unless ``size`` are alive
        or starting (the task waiting for a child takes whichever is idle first)."""
        if self._closed or len(self._children) + self._growing >= self.size:
            return
        self._growing += 1
        task = asyncio.ensure_future(self._add_child())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _add_child(self) -> None:
        try:
            child = await self._spawn()
        except (ConfigError, OSError) as exc:
            logger.error("cannot grow the python pool beyond %d children: %s", len(self._children), exc)
            return
        finally:
            self._growing -= 1
        if self._closed:
            child.kill()
            return
        self._idle.put_nowait(child)

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
        self._growing += 1  # the replacement holds the old child's place in ``size``
        try:
            await self._replace_child(old)
        finally:
            self._growing -= 1

    async def _replace_child(self, old: _Child) -> None:
        try:
            await asyncio.wait_for(old.proc.wait(), timeout=5)
        except TimeoutError:
            old.kill()
            await old.proc.wait()
        finally:
            self._children.discard(old)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(old.discard_output(), timeout=5)
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
        (None or 0 = none) bounds the run; on overrun the child is killed. Task failures
        are outcomes (``MEMORY_LIMIT`` past ``memory_mb``); a value larger than
        ``result_bytes`` raises ``ResultTooLarge``."""
        payload = await self._request(code, input, libs, context)
        if isinstance(payload, ToolOutcome):
            return payload
        child = await self._take()
        try:
            reply = await asyncio.wait_for(self._exchange(child, payload), timeout=timeout_sec or None)
        except _FrameTooLarge as exc:
            # Not read: the child is killed mid-write and replaced.
            self._retire(child, kill=True)
            raise self._frame_too_large(child, exc) from None
        except TimeoutError:
            self._retire(child, kill=True)
            return self._timed_out(child, timeout_sec)
        except asyncio.CancelledError:
            self._retire(child, kill=True)
            raise
        except _ChildExited:
            rc = await _exit_code(child)
            self._retire(child, kill=True)
            return self._exited(child, rc)
        except BaseException:
            self._retire(child, kill=True)
            raise
        if self._answered(child, reply):
            self._give_back(child)
        return self._settle(reply)

    def lane(self) -> PythonLane:
        """A child lent to a run of tasks that go one after another (``PythonLane``)."""
        return PythonLane(self)

    async def _request(self, code: str, input: Mapping[str, Any] | None, libs: Mapping[str, Any] | None,
                       context: Mapping[str, Any] | None) -> bytes | ToolOutcome:
        """A task's request frame payload (or its failure: input that is not JSON)."""
        if self._closed:
            raise RuntimeError("python pool is closed")
        if not self._started:
            await self.start()
        try:
            return encode_json({"code": code, "input": dict(input or {}), "context": dict(context or {}),
                                "libs": dict(libs or {})})
        except (TypeError, ValueError) as exc:
            return ToolOutcome.failure(TOOL_ERROR, f"task input is not JSON serialisable: {exc}",
                                       kind=type(exc).__name__)

    async def _take(self) -> _Child:
        """An idle child (the pool grows by one when none is)."""
        if self._idle.empty():
            self._grow()
        return await self._idle.get()

    def _give_back(self, child: _Child) -> None:
        """A child done with its tasks: idle again, or retired once it ran its share."""
        if self.max_tasks_per_child and child.tasks_run >= self.max_tasks_per_child:
            self._retire(child, kill=False)
        else:
            self._idle.put_nowait(child)

    def _answered(self, child: _Child, reply: Mapping[str, Any]) -> bool:
        """Count a task ``child`` answered; False when the reply says its interpreter ran out
        of memory (it may be left in a bad state: half-built objects, a failed import), in
        which case the child is killed and replaced."""
        child.tasks_run += 1
        if _error_kind(reply) == MEMORY_ERROR:
            self._retire(child, kill=True)
            return False
        return True

    def _settle(self, reply: Mapping[str, Any]) -> ToolOutcome:
        """A reply's outcome (``ResultTooLarge`` raised for a value over ``result_bytes``)."""
        kind = _error_kind(reply)
        if kind == MEMORY_ERROR:
            return self._memory_outcome(reply)
        error = reply.get("error")
        if kind == RESULT_TOO_LARGE and self.result_bytes and isinstance(error, Mapping):
            size = error.get("size")
            if isinstance(size, int) and size > self.result_bytes:
                raise ResultTooLarge(size, self.result_bytes)
            raise ResultTooLarge(self.result_bytes + 1, self.result_bytes, exact=False)
        return _outcome(reply)

    def _frame_too_large(self, child: _Child, exc: _FrameTooLarge) -> ResultTooLarge:
        logger.warning("python sandbox pid=%s sent a %d-byte reply (limit %d + slack); killed it",
                       child.pid, exc.size, self.result_bytes)
        return ResultTooLarge(max(self.result_bytes + 1, exc.size - FRAME_SLACK), self.result_bytes, exact=False)

    @staticmethod
    def _timed_out(child: _Child, timeout_sec: float | None) -> ToolOutcome:
        logger.warning("python task exceeded %ss; killed sandbox pid=%s", timeout_sec, child.pid)
        return ToolOutcome.failure(TIMEOUT, f"task exceeded its timeout of {timeout_sec:g} s",
                                   kind="TimeoutError", retryable=True)

    @staticmethod
    def _exited(child: _Child, rc: int | None) -> ToolOutcome:
        logger.warning("python sandbox pid=%s %s while running a task", child.pid, _exit_text(rc))
        return ToolOutcome.failure(SANDBOX_EXITED, f"python sandbox process {_exit_text(rc)} while running the task",
                                   kind="ChildProcessError", details={"exit_code": rc})

    async def _exchange(self, child: _Child, payload: bytes) -> dict[str, Any]:
        with contextlib.suppress(_ChildExited):
            # A child that stopped reading may have answered first (a request it could not
            # hold: its out-of-memory reply); with nothing to read, receive raises _ChildExited.
            await child.send(payload)
        return await child.receive(self.max_frame)

    def _memory_outcome(self, reply: Mapping[str, Any]) -> ToolOutcome:
        if not self.memory_mb:
            return _outcome(reply)  # a MemoryError without a limit of ours: the task's own error
        outcome = _outcome(reply)
        message = f"python task exceeded its memory limit {MEMORY_SETTING}={self.memory_mb}"
        details = outcome.error.details if outcome.error is not None else {}
        return ToolOutcome.failure(MEMORY_LIMIT, message, kind=MEMORY_ERROR, details=details, stdout=outcome.stdout)


class _Queued:
    """One request of a lane: its frame, its reply, whether the child has started it, and
    the child it was last written to."""

    __slots__ = ("begun", "child", "frame", "reply")

    def __init__(self, frame: bytes) -> None:
        self.frame = frame
        self.reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.begun = asyncio.Event()
        self.child: _Child | None = None


class PythonLane:
    """A child of the pool lent to tasks that run one after another in it (the python
    iterations of one batch of a parallel loop, ``noetl_worker.runner``), as an async
    context manager. Each request is written as soon as it is made, without waiting for
    the replies before it, and the replies are read back in order: the child reads its
    next request as soon as it has answered one, so k requests cost each side about one
    wake-up instead of k (``scripts/measure_python_pipelining.py``). The tasks still run one
    at a time, in the order they were made; only the worker's side of them overlaps.

    A request's timeout runs from when the child starts it: when the reply before it came
    back, or when it was written if that was later. When a task overruns it, is cancelled,
    ends its interpreter or sends a reply frame too large to read, the child is killed and
    replaced; the requests behind it, which the child had not started, are written again
    to another child. A reply that reports an interpreter out of memory does the same, and
    the task behind it, which that child may have started, runs again from the start in
    the new one (a task may run more than once anyway: a worker can die mid-command). A
    child that reaches ``max_tasks_per_child`` mid-lane finishes the lane first."""

    def __init__(self, pool: PythonPool) -> None:
        self.pool = pool
        self.child: _Child | None = None
        self.pending: collections.deque[_Queued] = collections.deque()  # written, not answered, in order
        self._reader: asyncio.Task[None] | None = None
        self._resends: set[asyncio.Task[None]] = set()
        self._taking = asyncio.Lock()
        self._counted = False  # among the pool's lanes holding a child (``PythonPool.lanes``)
        # what the pace of the lane's tasks is taken from (``pace_ms``)
        self.answered = 0
        self.task_ms = 0.0  # the children's own time on the tasks (their replies' ``ms``)
        self._lanes_seen = 0  # the pool's lanes at each reply, summed

    async def __aenter__(self) -> PythonLane:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def pace_ms(self, wall_ms: float) -> float:
        """The lane's time on its tasks as the sizing of later batches should see it, given
        its wall time: the children's own time on them, or the wall time over the lanes that
        shared the pool meanwhile, whichever is longer. The wall time alone is what lanes
        sharing the worker's cores make it: 16 lanes of trivial tasks stretch each one's
        about 16-fold, which made a loop's later batches small; a task that waits (a sleep,
        a request) shows its own time in the child and keeps batches small as it should."""
        if not self.answered:
            return wall_ms
        sharing = max(1.0, self._lanes_seen / self.answered)
        return max(self.task_ms, wall_ms / sharing)

    async def close(self) -> None:
        """Give the child back (killed if a request is still outstanding: a cancelled lane)."""
        if self._counted:
            self._counted = False
            self.pool.lanes -= 1
        for task in list(self._resends):
            task.cancel()
        await asyncio.gather(*self._resends, return_exceptions=True)
        child, self.child = self.child, None
        reader = self._stop_reader()
        if reader is not None:
            # done reading before the child is anyone else's (one reader at a time on its pipe)
            await asyncio.gather(reader, return_exceptions=True)
        outstanding = [q for q in self.pending if not q.reply.done()]
        for queued in outstanding:
            queued.reply.cancel()
        self.pending.clear()
        if child is not None:
            if outstanding:
                self.pool._retire(child, kill=True)
            else:
                self.pool._give_back(child)

    async def run(self, code: str, input: Mapping[str, Any] | None = None,
                  libs: Mapping[str, Any] | None = None, timeout_sec: float | None = None, *,
                  context: Mapping[str, Any] | None = None) -> ToolOutcome:
        """As ``PythonPool.run``, in this lane's child, behind the requests made before."""
        payload = await self.pool._request(code, input, libs, context)
        if isinstance(payload, ToolOutcome):
            return payload
        queued = _Queued(HEADER.pack(len(payload)) + payload)
        child: _Child | None = None
        try:
            await self._write(queued)
            await queued.begun.wait()
            # the child it was written to (the lane's may be gone already: after a quick
            # out-of-memory reply the reader restarts the lane before this owner resumes)
            child = queued.child
            reply = await asyncio.wait_for(asyncio.shield(queued.reply), timeout=timeout_sec or None)
        except TimeoutError:
            self._restart(queued, child)
            assert child is not None
            return self.pool._timed_out(child, timeout_sec)
        except _FrameTooLarge as exc:
            self._restart(queued, child)
            assert child is not None
            raise self.pool._frame_too_large(child, exc) from None
        except _ChildExited:
            assert child is not None
            rc = await _exit_code(child)  # before the restart reaps it (its exit code is the report)
            self._restart(queued, child)
            return self.pool._exited(child, rc)
        except BaseException:
            self._restart(queued, child)
            raise
        assert child is not None
        child.tasks_run += 1  # (after an out-of-memory reply the reader has restarted the lane)
        return self.pool._settle(reply)

    async def acquire(self) -> None:
        """Take the lane's child now (the first request would): a batch's clock starts when
        its tasks have a child to run in, not while it waits for one."""
        async with self._taking:
            await self._child()

    async def _child(self) -> _Child:
        """The lane's child (taken from the pool if it has none); under ``_taking``."""
        if self.child is None:
            self.child = await self.pool._take()
            self._reader = asyncio.ensure_future(self._read(self.child))
            if not self._counted:
                self._counted = True
                self.pool.lanes += 1
        return self.child

    async def _write(self, queued: _Queued) -> None:
        async with self._taking:
            child = await self._child()
            queued.child = child
            self.pending.append(queued)
            if len(self.pending) == 1:
                queued.begun.set()
            assert child.proc.stdin is not None
            child.proc.stdin.write(queued.frame)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await child.proc.stdin.drain()  # a dead child: its reader fails the request at its head

    async def _read(self, child: _Child) -> None:
        """Answer the requests in order from ``child``'s replies; when it fails, fail the
        request at the head (whose owner restarts the lane)."""
        while True:
            try:
                reply = await child.receive(self.pool.max_frame)
            except (_ChildExited, _FrameTooLarge, ValueError) as exc:
                if self.pending and not self.pending[0].reply.done():
                    self.pending[0].reply.set_exception(exc)  # its owner restarts the lane
                elif self.pending:
                    self._restart(self.pending[0], child)  # nobody waits for the head any more
                elif self.child is child:
                    # it died with nothing asked of it: the next request takes another child
                    self.child, self._reader = None, None
                    self.pool._retire(child, kill=True)
                return
            if not self.pending:
                return  # nothing to answer (a child replies once per request)
            head = self.pending.popleft()
            if not head.reply.done():
                head.reply.set_result(reply)
            self.answered += 1
            self._lanes_seen += self.pool.lanes
            ms = reply.get("ms")
            if isinstance(ms, int | float) and 0 <= ms < 1e9:
                self.task_ms += ms
            if _error_kind(reply) == MEMORY_ERROR:
                # no reply of this interpreter is taken after it ran out of memory: the
                # tasks behind run again in another (the next may have started here)
                self._restart(head, child)
                return
            if self.pending:
                self.pending[0].begun.set()

    def _restart(self, failed: _Queued, child: _Child | None) -> None:
        """``failed`` is over (its outcome is its owner's): kill the child it ran in, if
        still the lane's, and write the requests behind it to another in the background
        (a cancelled owner does not wait for that)."""
        if not failed.reply.done():
            failed.reply.cancel()
        if child is not None and child is not self.child:
            return  # restarted already (the child was killed for another request)
        old, self.child = self.child, None
        self._stop_reader()
        if old is not None:
            self.pool._retire(old, kill=True)
        rest = [q for q in self.pending if not q.reply.done()]
        self.pending.clear()
        if rest:
            task = asyncio.ensure_future(self._resend(rest))
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)

    async def _resend(self, rest: list[_Queued]) -> None:
        for queued in rest:
            if not queued.reply.done():
                queued.begun.clear()
                await self._write(queued)

    def _stop_reader(self) -> asyncio.Task[None] | None:
        """Cancel the reader (the current one: unless it is the caller); returns it."""
        reader, self._reader = self._reader, None
        if reader is None or reader is asyncio.current_task():
            return None
        reader.cancel()
        return reader


# How long a child whose protocol pipe ended (or sent what is not a reply: task code can
# write to it) gets to exit on its own before it is killed.
EXIT_WAIT_SEC = 2.0


async def _exit_code(child: _Child) -> int | None:
    """The exit code of a child that stopped answering: its own when it exits within
    EXIT_WAIT_SEC, else the kill's (one still running, e.g. after a forged reply)."""
    try:
        return await asyncio.wait_for(asyncio.shield(child.proc.wait()), timeout=EXIT_WAIT_SEC)
    except TimeoutError:
        child.kill()
        return await child.proc.wait()


def _error_kind(reply: Mapping[str, Any]) -> str:
    error = reply.get("error") if reply.get("status") != "ok" else None
    return str(error.get("kind") or "") if isinstance(error, Mapping) else ""


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
