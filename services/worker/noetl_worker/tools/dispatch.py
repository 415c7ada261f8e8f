"""Runs one task: renders its fields, dispatches on ``kind``, enforces the timeout.

Rendering: the task's effective input is render(step input) merged with render(task
input) (the task's keys win). The other fields render with the scope plus the input
keys: ``render`` for structured values (url, params, headers, auth, ...),
``render_text`` for SQL and python ``code`` (as upstream renders the whole tool config:
code holding ``{{``/``{%`` is a template; one without is left as it is). ``script:``
(``scripts.py``) replaces ``code`` / ``command`` / ``query`` with text from inline, a file
under ``NOETL_WORKER_SCRIPT_DIR`` or http(s). A template error fails the
task with ``TEMPLATE_ERROR`` and the template's message. The python ``context`` global
(the render scope) is sent to the sandbox only when the code mentions it.

``kind: workbook`` runs ``workbook[name]`` (a task mapping, or an entry with a ``tool``)
with its own input defaults overridden by the caller's rendered input. ``kind: playbook``
runs a sub-playbook (``playbook.py``) with the rendered input as its payload; it needs the
caller's ``CallInfo`` (idempotency key, cancel signal).

A tool that finds its result larger than ``NOETL_LIMIT_RESULT_BYTES`` (python's reply,
an http body, postgres rows) raises ``ResultTooLarge`` as soon as it knows, before holding
the whole value; it becomes the task's ``RESULT_TOO_LARGE`` error naming the task here.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from noetl_common.errors import ToolError
from noetl_dsl.templates import RenderContext, TemplateError, render, render_text
from noetl_store import ResultTooLarge

from ..metrics import TASK_SECONDS
from .call import CallInfo
from .duckdb import SQL_FIELDS as DUCKDB_SQL_FIELDS
from .duckdb import DuckdbTool
from .http import HttpTool
from .outcome import INVALID_TASK, TEMPLATE_ERROR, TIMEOUT, TOOL_ERROR, ErrorDetail, ToolOutcome
from .playbook import PlaybookTool
from .postgres import PostgresTool
from .python import PythonPool
from .scripts import ScriptError, resolve_script

if TYPE_CHECKING:
    from ..cursor_drivers import CursorDrivers

logger = logging.getLogger(__name__)

PLAYBOOK_FIELDS = ("path", "version", "return_step")
HTTP_FIELDS = ("method", "url", "endpoint", "params", "headers", "json", "body", "payload", "data",
               "timeout", "follow_redirects", "auth", "credential")
DUCKDB_FIELDS = ("database", "db_path", "params", "auth", "credential", "credentials")
MAX_WORKBOOK_DEPTH = 8
# Python code that mentions one of these may read the `context` global.
SCOPE_WORDS = ("context", "globals", "vars(", "eval", "exec")
# Postgres cancels a statement at the task timeout itself; give it a moment to report.
SQL_TIMEOUT_GRACE_SEC = 1.0


def python_code(task: Mapping[str, Any]) -> str | None:
    """The task's code: ``code``, or base64 text in ``code_b64`` / ``code_base64``."""
    code = task.get("code")
    if isinstance(code, str):
        return code
    for key in ("code_b64", "code_base64"):
        raw = task.get(key)
        if isinstance(raw, str) and raw:
            try:
                return base64.b64decode(raw, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError) as exc:
                raise ValueError(f"`{key}` is not base64 UTF-8 text: {exc}") from exc
    return None


def resolve_workbook_task(workbook: Mapping[str, Any] | None, name: Any) -> dict[str, Any]:
    """The task mapping of ``workbook[name]``; ValueError when it does not exist."""
    entry = (workbook or {}).get(str(name)) if name else None
    if not isinstance(entry, Mapping):
        raise ValueError(f"workbook task {name!r} not found")
    tool = entry.get("tool")
    if "kind" not in entry and tool is not None:
        if isinstance(tool, list):
            if len(tool) != 1:
                raise ValueError(f"workbook task {name!r}: a pipeline cannot be called as one task")
            tool = tool[0]
        if not isinstance(tool, Mapping):
            raise ValueError(f"workbook task {name!r} has no tool")
        return dict(tool)
    return dict(entry)


class Tools:
    """The tools this worker runs. Missing tools answer ``INVALID_TASK``. ``cursors`` are
    the cursor drivers the slots of cursor loops claim rows with (``noetl_worker.cursor``)."""

    def __init__(self, *, python: PythonPool | None = None, http: HttpTool | None = None,
                 postgres: PostgresTool | None = None, playbook: PlaybookTool | None = None,
                 cursors: CursorDrivers | None = None, duckdb: DuckdbTool | None = None,
                 script_dir: str | None = None) -> None:
        """``script_dir``: the root file scripts are read from (NOETL_WORKER_SCRIPT_DIR;
        None: file scripts refused)."""
        self.script_dir = script_dir or None
        self.python = python
        self.duckdb = duckdb
        self.http = http
        self.postgres = postgres
        self.playbook = playbook
        self.cursors = cursors

    async def close(self) -> None:
        if self.python is not None:
            await self.python.close()
        if self.http is not None:
            await self.http.close()
        if self.playbook is not None:
            await self.playbook.close()
        if self.cursors is not None:
            await self.cursors.close()
        if self.postgres is not None:
            await self.postgres.pools.close()

    async def _script(self, task: Mapping[str, Any], fields: RenderContext, call: CallInfo | None) -> str:
        """The text of the task's ``script:`` (``scripts.py``); a ToolError when it cannot be had."""
        return await _load_script(self, task, fields, call)

    async def run_task(self, task: Mapping[str, Any], scope: RenderContext, *,
                       step_input: Mapping[str, Any] | None = None,
                       workbook: Mapping[str, Any] | None = None,
                       timeout_sec: float | None = None, call: CallInfo | None = None) -> ToolOutcome:
        """Render and run one task; never raises for task failures (only cancellation)."""
        try:
            inputs = dict(render(step_input or {}, scope) or {})
            # a python task's `args` are globals of its code like its `input` (upstream's
            # python tool binds both); `input` wins on a name both give
            fields = ("args", "input") if str(task.get("kind") or "").lower() == "python" else ("input",)
            for field in fields:
                own = render(task.get(field) or {}, scope)
                if not isinstance(own, Mapping):
                    raise ValueError(f"task {field} must be a mapping, got {type(own).__name__}")
                inputs.update(own)
        except TemplateError as exc:
            return ToolOutcome.failure(TEMPLATE_ERROR, str(exc), kind="TemplateError")
        except (TypeError, ValueError) as exc:
            return ToolOutcome.failure(INVALID_TASK, str(exc), kind=type(exc).__name__)
        return await self._run(task, scope, inputs, workbook, timeout_sec or None, 0, call)

    async def _run(self, task: Mapping[str, Any], scope: RenderContext, inputs: dict[str, Any],
                   workbook: Mapping[str, Any] | None, timeout_sec: float | None, depth: int,
                   call: CallInfo | None) -> ToolOutcome:
        kind = str(task.get("kind") or "").lower()
        start = time.perf_counter()
        try:
            return await self._dispatch(kind, task, scope, inputs, workbook, timeout_sec, depth, call)
        except ToolError as exc:
            return ToolOutcome("error", None, ErrorDetail.from_exception(exc))
        except ResultTooLarge as exc:
            name = str(scope.get("_task") or task.get("name") or kind)
            return ToolOutcome("error", None, ErrorDetail.from_exception(exc.for_task(name)))
        except TemplateError as exc:
            return ToolOutcome.failure(TEMPLATE_ERROR, str(exc), kind="TemplateError")
        except (TypeError, ValueError) as exc:
            return ToolOutcome.failure(INVALID_TASK, str(exc), kind=type(exc).__name__)
        except TimeoutError:
            return ToolOutcome.failure(TIMEOUT, f"task exceeded its timeout of {timeout_sec or 0:g} s",
                                       kind="TimeoutError", retryable=True)
        except Exception as exc:
            logger.exception("%s task crashed", kind)
            return ToolOutcome.failure(TOOL_ERROR, f"{type(exc).__name__}: {exc}", kind=type(exc).__name__)
        finally:
            if kind != "workbook":
                TASK_SECONDS.labels(kind or "unknown").observe(time.perf_counter() - start)

    async def _dispatch(self, kind: str, task: Mapping[str, Any], scope: RenderContext,
                        inputs: dict[str, Any], workbook: Mapping[str, Any] | None,
                        timeout_sec: float | None, depth: int, call: CallInfo | None) -> ToolOutcome:
        if kind == "noop":
            return ToolOutcome.success(inputs)
        if kind == "workbook":
            if depth >= MAX_WORKBOOK_DEPTH:
                raise ValueError(f"workbook calls nested deeper than {MAX_WORKBOOK_DEPTH}")
            target = resolve_workbook_task(workbook, task.get("name"))
            defaults = render(target.get("input") or {}, scope)
            merged = {**(defaults if isinstance(defaults, Mapping) else {}), **inputs}
            return await self._run(target, scope, merged, workbook, timeout_sec, depth + 1, call)

        fields = RenderContext({**scope, **inputs}, known=scope.known)
        if kind == "python":
            if self.python is None:
                return _unsupported(kind)
            code = await self._script(task, fields, call) if task.get("script") is not None else python_code(task)
            if code is None:
                raise ValueError("python task has no `code`")
            # As upstream renders the whole tool config: code holding a template is rendered.
            code = render_text(code, fields)
            libs = task.get("libs") or {}
            if not isinstance(libs, Mapping):
                raise ValueError("python `libs` must be a mapping of alias -> module")
            # The render scope can be large (workload, resolved results): ship it to the
            # child only when the code can name it.
            context = scope if any(word in code for word in SCOPE_WORDS) else {}
            runner = call.python_lane if call is not None and call.python_lane is not None else self.python
            return await runner.run(code, inputs, libs, timeout_sec, context=context)
        if kind == "http":
            if self.http is None:
                return _unsupported(kind)
            rendered = render({k: task[k] for k in HTTP_FIELDS if k in task}, fields)
            secrets = call.secrets if call is not None else None
            return await asyncio.wait_for(self.http.run(rendered, timeout_sec=timeout_sec, secrets=secrets),
                                          timeout_sec)
        if kind == "postgres":
            if self.postgres is None:
                return _unsupported(kind)
            if task.get("script") is not None:
                source: Any = await self._script(task, fields, call)
            else:
                source = task.get("command") if task.get("command") is not None else task.get("query")
            sql = render_text(str(source or ""), fields)
            auth = render(task.get("auth") if task.get("auth") is not None else task.get("credential"), fields)
            limit = timeout_sec + SQL_TIMEOUT_GRACE_SEC if timeout_sec else None
            secrets = call.secrets if call is not None else None
            return await asyncio.wait_for(self.postgres.run(sql, auth, timeout_sec=timeout_sec, secrets=secrets),
                                          limit)
        if kind == "duckdb":
            if self.duckdb is None:
                return _unsupported(kind)
            rendered = {k: (render_text(task[k], fields) if isinstance(task[k], str) else render(task[k], fields))
                        for k in (*DUCKDB_SQL_FIELDS, *DUCKDB_FIELDS) if k in task}
            if task.get("script") is not None:
                rendered["query"] = render_text(await self._script(task, fields, call), fields)
            secrets = call.secrets if call is not None else None
            return await self.duckdb.run(rendered, timeout_sec=timeout_sec, secrets=secrets)
        if kind == "playbook":
            if self.playbook is None:
                return _unsupported(kind)
            rendered = render({k: task[k] for k in PLAYBOOK_FIELDS if k in task}, fields)
            # The tool bounds its own wait: on a timeout it cancels the child first.
            return await self.playbook.run(rendered, inputs, call=call, timeout_sec=timeout_sec)
        return _unsupported(kind)


async def _load_script(tools: Tools, task: Mapping[str, Any], fields: RenderContext, call: CallInfo | None) -> str:
    try:
        return await resolve_script(render(task["script"], fields), root=tools.script_dir,
                                    playbook_path=call.playbook_path if call is not None else "")
    except ScriptError as exc:
        raise ToolError(str(exc), code=TOOL_ERROR if exc.retryable else INVALID_TASK, kind="ScriptError",
                        retryable=exc.retryable) from exc


def _unsupported(kind: str) -> ToolOutcome:
    what = f"tool kind {kind!r}" if kind else "a task without `kind`"
    return ToolOutcome.failure(INVALID_TASK, f"{what} is not supported by this worker", kind="ValueError")
