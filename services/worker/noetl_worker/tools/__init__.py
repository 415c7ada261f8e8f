"""Tools the worker runs: python (warm sandbox pool), http, postgres, duckdb (in the python
pool's children), noop, workbook, playbook (sub-playbooks)."""

from .call import CallInfo
from .credentials import CommandSecrets, Credentials, Holder, StoredCredential, api_fetch
from .dispatch import Tools, python_code, resolve_workbook_task
from .duckdb import DuckdbTool
from .http import HttpTool
from .outcome import ErrorDetail, ToolOutcome
from .playbook import PlaybookTool
from .postgres import PoolRegistry, PostgresTool, dsn_from, resolve_dsn
from .python import PythonPool

__all__ = [
    "CallInfo",
    "CommandSecrets",
    "Credentials",
    "DuckdbTool",
    "ErrorDetail",
    "Holder",
    "HttpTool",
    "PlaybookTool",
    "PoolRegistry",
    "PostgresTool",
    "PythonPool",
    "StoredCredential",
    "ToolOutcome",
    "Tools",
    "api_fetch",
    "dsn_from",
    "python_code",
    "resolve_dsn",
    "resolve_workbook_task",
]
