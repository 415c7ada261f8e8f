"""The http tool: one shared ``httpx.AsyncClient`` per worker.

Task fields (already rendered): ``method`` (GET), ``url`` (or ``endpoint``),
``params``, ``headers``, a body from ``json``, ``body`` / ``payload`` (mapping or list:
JSON; text: sent as is) or ``data`` (mapping: form-encoded; text: sent as is),
``timeout`` (seconds), ``follow_redirects``, ``auth`` (or ``credential``): a stored
credential that becomes request headers (bearer, basic, a header: ``httpauth.py``).

Value: ``{"status_code", "headers", "body", "data"}`` with the body parsed as JSON when
the content type says JSON or the text parses, else text. ``data`` is the same body
(upstream NoETL playbooks read ``{{ step.data }}``, others ``{{ step.body }}``). Status < 400 is ok; otherwise an
error, retryable for 408, 429 and 5xx. Network errors are retryable errors.
``output.http`` is ``{"status": code}``.

The body is streamed and never held beyond ``max_body_bytes`` (``NOETL_LIMIT_RESULT_BYTES``;
decoded bytes, so a compressed body cannot expand past it): a larger declared
``Content-Length`` is refused before reading, a body that grows past it stops the read
and closes the connection. Either raises ``noetl_store.ResultTooLarge`` (the task's
``RESULT_TOO_LARGE``). The value holds the body twice (``body`` and ``data``), so the
result store's exact check refuses bodies above about half the limit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from noetl_common.errors import NoetlError
from noetl_store import check_result_size

from .credentials import CommandSecrets, credential_failure
from .httpauth import auth_headers, merge_headers, parse_auth
from .outcome import CREDENTIAL_NOT_FOUND, HTTP_ERROR, INVALID_TASK, TIMEOUT, ToolOutcome

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SEC = 30.0
NETWORK_ERROR = "NETWORK_ERROR"


def _retryable_status(code: int) -> bool:
    return code in (408, 429) or code >= 500


async def _read_body(response: httpx.Response, limit: int) -> bytes:
    """The (decoded) body; ``ResultTooLarge`` as soon as it is known to exceed ``limit`` (> 0)."""
    declared = response.headers.get("content-length")
    if limit and declared and declared.isdigit():
        check_result_size(int(declared), limit, exact=False)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        check_result_size(size, limit, exact=False)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_body(response: httpx.Response, content: bytes) -> Any:
    """JSON when the body parses as JSON (whatever the content type claims), else text."""
    text = content.decode(response.encoding or "utf-8", errors="replace")
    if not text.strip():
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _str_map(value: Any, field: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"http `{field}` must be a mapping, got {type(value).__name__}")
    return {str(k): v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict | list) else str(v)
            for k, v in value.items() if v is not None}


def _params(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"http `params` must be a mapping, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if v is None:
            continue
        if isinstance(v, bool):
            out[str(k)] = "true" if v else "false"
        elif isinstance(v, dict):
            out[str(k)] = json.dumps(v)
        else:
            out[str(k)] = v
    return out


def _body(task: Mapping[str, Any]) -> dict[str, Any]:
    if task.get("json") is not None:
        return {"json": task["json"]}
    for key in ("body", "payload"):
        value = task.get(key)
        if value is None:
            continue
        if isinstance(value, str | bytes):
            return {"content": value}
        return {"json": value}
    data = task.get("data")
    if data is None:
        return {}
    if isinstance(data, str | bytes):
        return {"content": data}
    if isinstance(data, Mapping):
        return {"data": {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}}
    return {"json": data}


async def _auth_headers(auth: Any, secrets: CommandSecrets | None) -> dict[str, str] | ToolOutcome:
    """The headers of a task's ``auth``, or the task's failure."""
    try:
        spec = parse_auth(auth)
    except ValueError as exc:
        return ToolOutcome.failure(INVALID_TASK, str(exc), kind="ValueError")
    what = f"credential {spec.credential!r}"
    if secrets is None:
        return ToolOutcome.failure(CREDENTIAL_NOT_FOUND, f"{what} not found (this worker has no credential access)",
                                   kind="NotFound")
    try:
        cred = await secrets.get(spec.credential)
    except NoetlError as exc:
        return credential_failure(exc, what)
    try:
        headers = auth_headers(spec, cred.kind, cred.data)
    except ValueError as exc:
        return ToolOutcome.failure(INVALID_TASK, str(exc), kind="ValueError")
    for value in headers.values():  # what was built from the secret is scrubbed too
        secrets.add(value)
        secrets.add(value.partition(" ")[2])
    return headers


class HttpTool:
    """Runs http tasks on one shared client (``close()`` closes it if the tool made it)."""

    def __init__(self, client: httpx.AsyncClient | None = None, *,
                 default_timeout: float = DEFAULT_TIMEOUT_SEC, max_body_bytes: int = 0) -> None:
        """``max_body_bytes``: the largest body read (0 = no limit; module docstring)."""
        self._own = client is None
        self.client = client or httpx.AsyncClient(
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.default_timeout = default_timeout
        self.max_body_bytes = max(0, max_body_bytes)

    async def close(self) -> None:
        if self._own:
            await self.client.aclose()

    async def run(self, task: Mapping[str, Any], *, timeout_sec: float | None = None,
                  secrets: CommandSecrets | None = None) -> ToolOutcome:
        method = str(task.get("method") or "GET").upper()
        url = task.get("url") or task.get("endpoint")
        if not url or not isinstance(url, str):
            return ToolOutcome.failure(INVALID_TASK, "http task needs a `url`", kind="ValueError")
        try:
            request_timeout = float(task.get("timeout") or timeout_sec or self.default_timeout)
            if timeout_sec:
                request_timeout = min(request_timeout, timeout_sec)
            kwargs: dict[str, Any] = {"params": _params(task.get("params")),
                                      "headers": _str_map(task.get("headers"), "headers"), **_body(task)}
        except (TypeError, ValueError) as exc:
            return ToolOutcome.failure(INVALID_TASK, str(exc), kind=type(exc).__name__)
        auth = task.get("auth") if task.get("auth") is not None else task.get("credential")
        if auth is not None:
            headers = await _auth_headers(auth, secrets)
            if isinstance(headers, ToolOutcome):
                return headers
            kwargs["headers"] = merge_headers(kwargs["headers"], headers)
        try:
            async with self.client.stream(method, url, timeout=request_timeout,
                                          follow_redirects=bool(task.get("follow_redirects", False)),
                                          **kwargs) as response:
                content = await _read_body(response, self.max_body_bytes)
        except httpx.TimeoutException as exc:
            return ToolOutcome.failure(TIMEOUT, f"{method} {url}: timed out after {request_timeout:g} s",
                                       kind=type(exc).__name__, retryable=True)
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            return ToolOutcome.failure(INVALID_TASK, f"{method} {url}: {exc}", kind=type(exc).__name__)
        except httpx.HTTPError as exc:
            return ToolOutcome.failure(NETWORK_ERROR, f"{method} {url}: {type(exc).__name__}: {exc}",
                                       kind=type(exc).__name__, retryable=True)
        body = _parse_body(response, content)
        del content
        data = {"status_code": response.status_code, "headers": dict(response.headers.items()),
                "body": body, "data": body}
        http = {"status": response.status_code}
        if response.status_code < 400:
            return ToolOutcome.success(data, http=http)
        return ToolOutcome.failure(
            HTTP_ERROR, f"{method} {url}: HTTP {response.status_code} {response.reason_phrase}".rstrip(),
            kind="HTTPStatusError", retryable=_retryable_status(response.status_code),
            details={"status_code": response.status_code}, data=data, http=http)
