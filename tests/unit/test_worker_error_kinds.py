"""Errors carry upstream's kinds (what policies test), our codes and the exception class."""

from __future__ import annotations

import pytest

from noetl_dsl.templates import RenderContext
from noetl_worker.pipeline import run_pipeline
from noetl_worker.tools import ToolOutcome
from noetl_worker.tools.outcome import ErrorDetail


@pytest.mark.parametrize(("status", "kind", "retryable"), [
    (429, "rate_limit", True), (401, "auth", False), (403, "auth", False), (404, "not_found", False),
    (400, "client_error", False), (500, "server_error", True), (503, "server_error", True),
])
def test_http_errors_by_status(status: int, kind: str, retryable: bool) -> None:
    err = ErrorDetail("HTTP_ERROR", f"GET x: HTTP {status}", "HTTPStatusError", retryable, {"status_code": status})
    out = err.to_dict()
    assert (out["kind"], out["type"], out["status_code"], out["http_status"]) == (kind, kind, status, status)
    assert (out["code"], out["exception_type"], out["retryable"]) == ("HTTP_ERROR", "HTTPStatusError", retryable)


@pytest.mark.parametrize(("code", "exception_type", "details", "kind"), [
    ("TIMEOUT", "ReadTimeout", {}, "timeout"),
    ("NETWORK_ERROR", "ConnectError", {}, "connection"),
    ("SQL_ERROR", "UniqueViolation", {"sqlstate": "23505"}, "db_constraint"),
    ("SQL_ERROR", "SerializationFailure", {"sqlstate": "40001"}, "db_deadlock"),
    ("TIMEOUT", "QueryCanceled", {"sqlstate": "57014"}, "db_timeout"),
    ("SQL_ERROR", "OperationalError", {}, "db_connection"),
    ("CREDENTIAL_NOT_FOUND", "NotFound", {}, "auth"),
    ("TEMPLATE_ERROR", "TemplateError", {}, "config"),
    ("MEMORY_LIMIT", "MemoryError", {}, "limit"),
    ("TOOL_ERROR", "KeyError", {}, "schema"),
    ("TOOL_ERROR", "ZeroDivisionError", {}, "unknown"),
])
def test_kinds_from_codes_sqlstates_and_exceptions(code: str, exception_type: str, details: dict[str, str],
                                                   kind: str) -> None:
    err = ErrorDetail(code, "m", exception_type, False, dict(details))
    assert (err.kind, err.exception_type, err.code) == (kind, exception_type, code)


def test_a_kind_given_as_a_kind_is_kept() -> None:
    err = ErrorDetail("HTTP_ERROR", "m", "rate_limit", True)
    assert (err.kind, err.exception_type) == ("rate_limit", "")


async def test_a_policy_retries_on_server_error_and_reads_the_status_code() -> None:
    """Upstream's rules: `output.error.kind == 'server_error'`, `output.error.status_code`."""
    failure = ToolOutcome.failure("HTTP_ERROR", "GET x: HTTP 503", kind="HTTPStatusError", retryable=True,
                                  details={"status_code": 503}, http={"status": 503})
    outcomes = [failure, ToolOutcome.success({"ok": 1})]
    seen: list[int] = []

    async def fetch(task: object, scope: RenderContext) -> ToolOutcome:
        return outcomes.pop(0)

    rules = [{"when": "{{ output.error.kind == 'server_error' and output.error.retryable "
                      "and output.error.status_code == 503 and output.http.status == 503 }}",
              "then": {"do": "retry", "attempts": 3, "delay": 0,
                       "set": {"ctx.last_status": "{{ output.error.status_code }}"}}}]

    async def no_sleep(seconds: float) -> None:
        seen.append(int(seconds))

    result = await run_pipeline([{"name": "fetch", "spec": {"policy": {"rules": rules}}}],
                                RenderContext({"ctx": {}, "iter": {}}), fetch, sleep=no_sleep)
    assert (result.status, result.data, result.runs) == ("ok", {"ok": 1}, 2)
    assert result.set_updates["ctx"] == {"last_status": 503}
