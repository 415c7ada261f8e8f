"""Tools the worker runs: python (warm sandbox pool), http, postgres, noop, workbook."""

from .dispatch import Tools, python_code, resolve_workbook_task
from .http import HttpTool
from .outcome import ErrorDetail, ToolOutcome
from .postgres import Credentials, PoolRegistry, PostgresTool, dsn_from
from .python import PythonPool

__all__ = [
    "Credentials",
    "ErrorDetail",
    "HttpTool",
    "PoolRegistry",
    "PostgresTool",
    "PythonPool",
    "ToolOutcome",
    "Tools",
    "dsn_from",
    "python_code",
    "resolve_workbook_task",
]
