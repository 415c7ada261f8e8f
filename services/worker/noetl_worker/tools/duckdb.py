"""The duckdb tool: DuckDB SQL in a python sandbox child, Postgres attached through stored
credentials.

    - step: transform
      tool:
        kind: duckdb
        database: ":memory:"                # default; or a file under NOETL_WORKER_DUCKDB_DIR
        auth: pg_local                      # or credential:; or aliases {pg_db: {credential: pg_local}}
        query: |                            # or command / commands / sql
          ATTACH '' AS pg (TYPE postgres);  -- the task's one credential is the default secret
          SELECT count(*) AS n FROM pg.public.users;

Where it runs: in a child of the python pool (``duckdb_child.py``), never in the worker
process: DuckDB SQL can read and write files and open connections, so it gets the python
tool's isolation and limits (memory, timeout: the child is killed and replaced; result
size: the rows stop at ``NOETL_LIMIT_RESULT_BYTES``). Blocking DuckDB work never touches
the worker's event loop.

Credentials (``auth`` or ``credential``, as for postgres): a name, a mapping naming one
(``credential``/``key``/``name``), or an alias map ``{alias: {credential: name}}`` (or
``{alias: name}``; upstream's older ``credentials: {alias: {key: name}}`` too). Each is fetched from the api for the command (the step must name it:
``noetl_dsl.credrefs``), its secret values go to the command's redactor, and it becomes a
DuckDB secret named after its alias (the credential's name for a single one, which is also
the default postgres secret). Only postgres credentials are usable (cloud object stores are
not part of this runtime).

``database``: ``:memory:`` (the default), or a path relative to the worker's DuckDB
directory (``NOETL_WORKER_DUCKDB_DIR``); an absolute path must be inside it and ``..``
may not leave it. A file database lives on one worker: tasks of an execution that run on
other workers do not see it.

Errors: ``SQL_ERROR`` with DuckDB's message and error class as ``kind`` (a connection
error is retryable); a credential that cannot be had is ``CREDENTIAL_NOT_FOUND`` /
``CREDENTIAL_NOT_PERMITTED``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from noetl_common.errors import NoetlError
from noetl_dsl.credrefs import REF_KEYS, reference_of

from ..duckdb_child import CHILD_CODE
from .credentials import CommandSecrets, credential_failure
from .outcome import INVALID_TASK, SQL_ERROR, TOOL_ERROR, ToolOutcome
from .python import PythonPool

SQL_FIELDS = ("query", "command", "commands", "sql")
DEFAULT_THREADS = 2
# DuckDB's buffer manager gets this share of the child's address-space limit.
MEMORY_SHARE = 0.5
# DuckDB error classes worth a retry (a dropped connection of an attached database).
RETRYABLE_KINDS = frozenset({"ConnectionException", "HTTPException"})
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def sql_of(task: Mapping[str, Any]) -> str | None:
    """The task's SQL text: ``query``, ``command``, ``commands`` (a string or a list of
    statements) or ``sql``."""
    for key in SQL_FIELDS:
        value = task.get(key)
        if isinstance(value, list):
            value = ";\n".join(str(v).strip().rstrip(";") for v in value if str(v).strip())
        if isinstance(value, str) and value.strip():
            return value
    return None


def credential_aliases(auth: Any) -> dict[str, str] | None:
    """``{alias: credential name}`` of an alias map ``{alias: {credential: name}}`` /
    ``{alias: name}``; None when ``auth`` names a single credential (or nothing)."""
    if not isinstance(auth, Mapping) or reference_of(auth) is not None or not auth:
        return None
    out: dict[str, str] = {}
    for alias, value in auth.items():
        ref = value if isinstance(value, str) else reference_of(value) if isinstance(value, Mapping) else None
        if ref is None or not ref.strip():
            raise ValueError(f"auth alias {alias!r} names no credential (expected one of: {', '.join(REF_KEYS)})")
        out[str(alias)] = ref.strip()
    return out


def default_directory() -> str:
    """``<temp dir>/noetl-duckdb-<uid>`` (NOETL_WORKER_DUCKDB_DIR unset)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"noetl-duckdb-{uid}")


def database_path(database: Any, root: Path) -> str:
    """``:memory:`` or a path confined to ``root`` (ValueError otherwise)."""
    if database in (None, "", ":memory:", "memory"):
        return ":memory:"
    if not isinstance(database, str):
        raise ValueError(f"duckdb `database` must be a string, got {type(database).__name__}")
    path = Path(database)
    resolved = (path if path.is_absolute() else root / path).resolve()
    base = root.resolve()
    if resolved != base and base not in resolved.parents:
        raise ValueError(f"duckdb `database` {database!r} is outside the worker's DuckDB directory "
                         f"(NOETL_WORKER_DUCKDB_DIR={base})")
    return str(resolved)


class DuckdbTool:
    def __init__(self, python: PythonPool, directory: str | os.PathLike[str], *,
                 max_result_bytes: int = 0, memory_mb: int = 0, threads: int = DEFAULT_THREADS) -> None:
        """``directory``: where file databases and the extension directory live (created
        0700 on first use); ``memory_mb``: the python children's address-space limit (DuckDB
        gets ``MEMORY_SHARE`` of it)."""
        self.python = python
        self.directory = Path(directory)
        self.max_result_bytes = max(0, max_result_bytes)
        self.memory_limit_mb = int(memory_mb * MEMORY_SHARE) if memory_mb else 0
        self.threads = threads

    def _ensure_directory(self) -> None:
        """Create the directory 0700; refuse one another user owns or can write (it would
        choose the extensions DuckDB loads)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.directory.stat()
        if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
            raise PermissionError("owned by another user or writable by others; set NOETL_WORKER_DUCKDB_DIR")

    async def run(self, task: Mapping[str, Any], *, timeout_sec: float | None = None,
                  secrets: CommandSecrets | None = None) -> ToolOutcome:
        """``task``: the rendered fields (SQL_FIELDS, ``database``, ``params``, ``auth`` /
        ``credential``)."""
        sql = sql_of(task)
        if sql is None:
            return ToolOutcome.failure(INVALID_TASK, "duckdb task needs a `query` or `command`", kind="ValueError")
        params = task.get("params")
        if params is not None and not isinstance(params, list):
            return ToolOutcome.failure(INVALID_TASK, "duckdb `params` must be a list", kind="ValueError")
        auth = next((task[k] for k in ("auth", "credential", "credentials") if task.get(k) is not None), None)
        try:
            database = database_path(task.get("database", task.get("db_path")), self.directory)
            aliases = credential_aliases(auth)
            single = reference_of(auth) if aliases is None and auth not in (None, "") else None
            if aliases is None and auth not in (None, "") and single is None:
                raise ValueError("duckdb `auth` must name a stored credential (inline connections are not accepted)")
        except ValueError as exc:
            return ToolOutcome.failure(INVALID_TASK, str(exc), kind="ValueError")
        named = aliases if aliases is not None else ({single.strip(): single.strip()} if single else {})
        specs: list[dict[str, Any]] = []
        for alias, name in named.items():
            if not _IDENT.match(alias):
                return ToolOutcome.failure(INVALID_TASK, f"duckdb secret alias {alias!r} is not an identifier",
                                           kind="ValueError")
            try:
                if secrets is None:
                    raise _no_access(name)
                cred = await secrets.get(name)
            except NoetlError as exc:
                return credential_failure(exc, f"credential {name!r}")
            specs.append({"name": alias, "type": cred.kind, "fields": dict(cred.data)})
        try:
            self._ensure_directory()
            if database != ":memory:":
                Path(database).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            return ToolOutcome.failure(TOOL_ERROR, f"duckdb directory {self.directory}: {exc}", kind=type(exc).__name__)
        spec = {"sql": sql, "params": params, "database": database, "secrets": specs,
                "default_secret": single is not None, "ext_dir": str(self.directory / "extensions"),
                "result_bytes": self.max_result_bytes, "memory_limit_mb": self.memory_limit_mb,
                "threads": self.threads}
        outcome = await self.python.run(CHILD_CODE, {"input_data": spec}, timeout_sec=timeout_sec)
        return _sql_outcome(outcome)


def _no_access(name: str) -> NoetlError:
    from noetl_common.errors import NotFound

    return NotFound(f"credential {name!r} not found (this worker has no credential access)")


def _sql_outcome(outcome: ToolOutcome) -> ToolOutcome:
    """A failed child run as the duckdb task's error: DuckDB's message and error class, no
    python traceback (it is the tool's, not the task's)."""
    if outcome.ok or outcome.error is None or outcome.error.code != TOOL_ERROR:
        return outcome  # TIMEOUT, MEMORY_LIMIT, SANDBOX_EXITED stay what they are
    # the child's exception class (ErrorDetail keeps it in exception_type, kind being a category)
    kind = outcome.error.exception_type or outcome.error.kind or "Error"
    if kind in ("DuckdbSetupError", "ValueError"):
        return ToolOutcome.failure(INVALID_TASK, f"duckdb: {outcome.error.message}", kind=kind)
    return ToolOutcome.failure(SQL_ERROR, f"duckdb {kind}: {outcome.error.message}", kind=kind,
                               retryable=kind in RETRYABLE_KINDS)


__all__ = ["DuckdbTool", "credential_aliases", "database_path", "default_directory", "sql_of"]
