"""What a task produced: the ``output`` that task policies see.

    {"status": "ok" | "error", "data": <value>, "error": {code, message, kind, type,
     retryable, details[, exception_type, traceback, status_code, http_status, sqlstate]}
     | null, "http": {"status": 200} | null}

``error.kind`` (and ``error.type``, the same) is upstream's vocabulary (``errorkinds``:
``server_error``, ``rate_limit``, ``auth``, ``timeout``, ``connection``, ...), what
policies test; ``code`` is this runtime's own (``TIMEOUT``, ``HTTP_ERROR``,
``MEMORY_LIMIT``, ...); ``exception_type`` the Python exception class when there is one.
A caller may pass an exception class name as ``kind``: it becomes ``exception_type`` and
the kind is classified from the code, the class and the details.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from noetl_common.errors import ToolError
from noetl_store import ResultTooLarge

from . import errorkinds

Status = Literal["ok", "error"]

# Machine-readable error codes the worker produces.
TOOL_ERROR = "TOOL_ERROR"
TIMEOUT = "TIMEOUT"
TEMPLATE_ERROR = "TEMPLATE_ERROR"
INVALID_TASK = "INVALID_TASK"
SANDBOX_EXITED = "SANDBOX_EXITED"
# A python task allocated beyond NOETL_WORKER_PYTHON_MEMORY_MB (its interpreter is replaced).
MEMORY_LIMIT = "MEMORY_LIMIT"
# A task's result (encoded JSON) is larger than NOETL_LIMIT_RESULT_BYTES: the task's failure, never retried.
RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
HTTP_ERROR = "HTTP_ERROR"
SQL_ERROR = "SQL_ERROR"
CREDENTIAL_NOT_FOUND = "CREDENTIAL_NOT_FOUND"
# The api refused a credential the command's step does not name (never retried).
CREDENTIAL_NOT_PERMITTED = "CREDENTIAL_NOT_PERMITTED"
POLICY_FAIL = "POLICY_FAIL"
REFERENCE_NOT_AVAILABLE = "REFERENCE_NOT_AVAILABLE"
INVALID_COMMAND = "INVALID_COMMAND"
CURSOR_ERROR = "CURSOR_ERROR"
PLAYBOOK_FAILED = "PLAYBOOK_FAILED"


@dataclass(slots=True)
class ErrorDetail:
    code: str
    message: str
    kind: str = ""
    retryable: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    exception_type: str = ""

    def __post_init__(self) -> None:
        if self.kind not in errorkinds.KINDS:
            self.exception_type = self.exception_type or self.kind
            self.kind = errorkinds.classify(self.code, self.exception_type, self.details)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message, "kind": self.kind, "type": self.kind,
                               "retryable": self.retryable, "details": self.details}
        if self.exception_type:
            out["exception_type"] = self.exception_type
        traceback = self.details.get("traceback")
        if isinstance(traceback, str) and traceback:
            out["traceback"] = traceback
        status = self.details.get("status_code")
        if isinstance(status, int):
            out["status_code"] = out["http_status"] = status
        if self.details.get("sqlstate"):
            out["sqlstate"] = out["pg_code"] = self.details["sqlstate"]
        return out

    @classmethod
    def from_exception(cls, exc: BaseException, *, code: str = TOOL_ERROR) -> ErrorDetail:
        if isinstance(exc, ResultTooLarge):
            return cls(RESULT_TOO_LARGE, str(exc), "ResultTooLarge", False, exc.details())
        if isinstance(exc, ToolError):
            return cls(exc.code, str(exc), exc.kind or type(exc).__name__, exc.retryable, dict(exc.details))
        return cls(code, str(exc) or type(exc).__name__, type(exc).__name__)


@dataclass(slots=True)
class ToolOutcome:
    status: Status
    data: Any = None
    error: ErrorDetail | None = None
    http: dict[str, Any] | None = None
    # Captured print output of a python task (logged, not part of the output).
    stdout: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_output(self) -> dict[str, Any]:
        return {"status": self.status, "data": self.data,
                "error": self.error.to_dict() if self.error is not None else None,
                "http": self.http}

    @classmethod
    def success(cls, data: Any, *, http: Mapping[str, Any] | None = None, stdout: str = "") -> ToolOutcome:
        return cls("ok", data, None, dict(http) if http is not None else None, stdout)

    @classmethod
    def failure(cls, code: str, message: str, *, kind: str = "", retryable: bool = False,
                details: Mapping[str, Any] | None = None, data: Any = None,
                http: Mapping[str, Any] | None = None, stdout: str = "") -> ToolOutcome:
        return cls("error", data, ErrorDetail(code, message, kind, retryable, dict(details or {})),
                   dict(http) if http is not None else None, stdout)
