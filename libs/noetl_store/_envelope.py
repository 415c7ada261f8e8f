"""Result envelope v3: what an event says about a result.

    {status, reference: {ref_id, type, uri} | null, parent_ref: {ref_id} | null,
     context: {small scalars}, error?: {code, message, kind, retryable}}

``context`` carries only small top-level scalars of the value (what ``when`` templates
usually need) so the engine routes without resolving the reference; payloads never
travel in events (a CHECK on ``noetl.event.result`` rejects any other key). It never
carries secrets: keys whose name looks like a credential (``SECRET_KEY_PARTS``, matched
case-insensitively anywhere in the name) are left out, whatever their value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from noetl_common.redact import SECRET_KEY_PARTS, is_secret_key  # noqa: F401 (re-exported)

from ._store import Reference

MAX_CONTEXT_KEYS = 32
MAX_CONTEXT_STRING = 256
MAX_ERROR_MESSAGE = 4000

ERROR_FIELDS = ("code", "message", "kind", "type", "retryable", "exception_type", "traceback", "status_code")


def _small_scalar(value: Any) -> bool:
    if value is None or isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return len(value) <= MAX_CONTEXT_STRING
    return False


def context_of(value: Any) -> dict[str, Any]:
    """Small scalars of a value: a dict's top-level scalar fields (at most 32; strings up
    to 256 characters, longer ones are left out, not cut; credential-shaped keys never),
    or ``{"value": v}`` for a scalar value. Lists and nested values contribute nothing."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if len(out) >= MAX_CONTEXT_KEYS:
                break
            if isinstance(key, str) and _small_scalar(item) and not is_secret_key(key):
                out[key] = item
        return out
    if _small_scalar(value) and value is not None:
        return {"value": value}
    return {}


def error_info(code: str, message: str, *, kind: str = "", retryable: bool = False, exception_type: str = "",
               traceback: str = "", status_code: int = 0) -> dict[str, Any]:
    """The envelope's ``error`` object (messages are capped at 4000 characters, a
    traceback to its last 4000). ``kind`` is also readable as ``type`` (upstream reads
    both); ``exception_type``, ``traceback`` and ``status_code`` appear only when set."""
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[: MAX_ERROR_MESSAGE - 3] + "..."
    out: dict[str, Any] = {"code": code, "message": message, "kind": kind, "type": kind, "retryable": bool(retryable)}
    if exception_type:
        out["exception_type"] = exception_type
    if traceback:
        out["traceback"] = traceback if len(traceback) <= MAX_ERROR_MESSAGE else "..." + traceback[-MAX_ERROR_MESSAGE + 3:]
    if status_code:
        out["status_code"] = int(status_code)
    return out


def envelope(status: str, ref: Reference | None, parent_ref: Reference | int | None, value: Any,
             error: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build the v3 envelope. ``error`` is included only when given (an error result);
    unknown keys of ``error`` are dropped."""
    parent_id = parent_ref.ref_id if isinstance(parent_ref, Reference) else parent_ref
    env: dict[str, Any] = {
        "status": status,
        "reference": ref.to_json() if ref is not None else None,
        "parent_ref": {"ref_id": parent_id} if parent_id is not None else None,
        "context": context_of(value),
    }
    if error is not None:
        http_status = error.get("status_code")
        env["error"] = error_info(str(error.get("code") or "TOOL_ERROR"), str(error.get("message") or ""),
                                  kind=str(error.get("kind") or ""), retryable=bool(error.get("retryable")),
                                  exception_type=str(error.get("exception_type") or ""),
                                  traceback=str(error.get("traceback") or ""),
                                  status_code=http_status if isinstance(http_status, int) and not isinstance(http_status, bool) else 0)
    return env
