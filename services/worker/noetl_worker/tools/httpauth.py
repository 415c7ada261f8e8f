"""The http tool's ``auth`` (or ``credential``): request headers from a stored credential.

    auth: api_token                                  the credential's kind decides
    auth: {credential: api_token}                    the same (``key`` / ``name`` too)
    auth: {type: bearer, credential: api_token}      Authorization: Bearer <token>
    auth: {type: basic, credential: svc_login}       Authorization: Basic base64(user:password)
    auth: {type: header, credential: k, header: X-Api-Key}     X-Api-Key: <value>
    auth: {type: api_key, credential: k}             X-API-Key: <value> (``header`` overrides)

By kind (when no ``type`` is given): ``http_bearer`` -> bearer (``token``, or
``access_token``); ``http_basic`` -> basic (``username``, ``password``); ``generic`` ->
a header when it has ``header`` and ``value``, else bearer when it has ``token``. A
``postgres`` credential is refused. The auth headers replace task headers of the same
name. Secrets are never taken inline from the task: an ``auth`` mapping holding
``token``/``password``/``value`` but no credential name is refused (store it with
``noetl-rt credential add``), so they do not travel in playbooks and payloads.
Messages name the credential and the missing field, never a value.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from noetl_common.redact import is_secret_key
from noetl_dsl.credrefs import REF_KEYS

TYPES = ("bearer", "basic", "header", "api_key")
_TYPE_ALIASES = {"bearer": "bearer", "token": "bearer", "basic": "basic", "header": "header",
                 "api_key": "api_key", "apikey": "api_key"}
DEFAULT_API_KEY_HEADER = "X-API-Key"


@dataclass(frozen=True, slots=True)
class AuthSpec:
    credential: str
    type: str | None = None
    header: str | None = None


def parse_auth(value: Any) -> AuthSpec:
    """The (rendered) ``auth`` of an http task; ValueError naming what is wrong."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("http `auth` is empty")
        return AuthSpec(value.strip())
    if not isinstance(value, Mapping):
        raise ValueError(f"http `auth` must be a credential name or a mapping, got {type(value).__name__}")
    name = next((value[k] for k in REF_KEYS if isinstance(value.get(k), str) and value[k].strip()), None)
    if name is None:
        inline = sorted(str(k) for k in value if isinstance(k, str) and (is_secret_key(k) or k == "value"))
        if inline:
            raise ValueError(f"http `auth` must name a stored credential (`credential: NAME`); inline secrets"
                             f" ({', '.join(inline)}) are not accepted: store them with `noetl-rt credential add`")
        raise ValueError("http `auth` must name a stored credential (`credential: NAME`)")
    raw_type = value.get("type")
    kind = None
    if raw_type is not None:
        kind = _TYPE_ALIASES.get(str(raw_type).strip().lower())
        if kind is None:
            raise ValueError(f"http `auth.type` {raw_type!r} is not one of: {', '.join(TYPES)}")
    header = value.get("header") or value.get("header_name")
    return AuthSpec(name.strip(), kind, str(header) if header else None)


def _field(data: Mapping[str, Any], *names: str) -> str | None:
    for name in names:
        value = data.get(name)
        if value not in (None, ""):
            return str(value)
    return None


def auth_headers(spec: AuthSpec, kind: str, data: Mapping[str, Any]) -> dict[str, str]:
    """The headers ``spec`` makes from a stored credential of ``kind``; ValueError naming
    the credential and what it lacks."""
    what = f"credential {spec.credential!r} ({kind})"
    auth_type = spec.type
    if auth_type is None:
        if kind == "http_bearer":
            auth_type = "bearer"
        elif kind == "http_basic":
            auth_type = "basic"
        elif kind == "generic":
            auth_type = "header" if _field(data, "header", "header_name") and _field(data, "value") else "bearer"
        else:
            raise ValueError(f"{what} cannot authenticate an http request (kinds: http_bearer, http_basic, generic)")
    if auth_type == "bearer":
        token = _field(data, "token", "access_token", "value")
        if token is None:
            raise ValueError(f"{what} has no `token` for bearer auth")
        return {"Authorization": f"Bearer {token}"}
    if auth_type == "basic":
        user, password = _field(data, "username", "user"), data.get("password")
        if user is None or password is None:
            raise ValueError(f"{what} needs `username` and `password` for basic auth")
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {pair}"}
    header = spec.header or _field(data, "header", "header_name")
    if header is None:
        if auth_type != "api_key":
            raise ValueError(f"{what}: header auth needs a header name (`auth.header` or the credential's `header`)")
        header = DEFAULT_API_KEY_HEADER
    value = _field(data, "value", "api_key", "key", "token")
    if value is None:
        raise ValueError(f"{what} has no `value` for the {header} header")
    return {header: value}


def merge_headers(task_headers: Mapping[str, str] | None, auth: Mapping[str, str]) -> dict[str, str]:
    """Task headers with the auth headers replacing any of the same name (case-insensitive)."""
    names = {k.lower() for k in auth}
    merged = {k: v for k, v in (task_headers or {}).items() if k.lower() not in names}
    merged.update(auth)
    return merged


__all__ = ["TYPES", "AuthSpec", "auth_headers", "merge_headers", "parse_auth"]
