"""What a task produced: the ``output`` that task policies see.

    {"status": "ok" | "error", "data": <value>, "error": {code, message, kind, retryable,
     details} | null, "http": {"status": 200} | null}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from noetl_common.errors import ToolError
from noetl_store import ResultTooLarge

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

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "kind": self.kind,
                "retryable": self.retryable, "details": self.details}

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
