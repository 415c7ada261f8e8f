"""``script:``: where a python task's code or a postgres / duckdb task's SQL comes from,
when it is not inline in the task (NoETL's script attribute; it wins over ``code`` /
``command``).

    script: "print('inline')"                                  # inline text
    script: {source: {type: inline}, content: "..."}           # inline, spelled out
    script: {path: scripts/load.sql, source: {type: file}}     # a file (below)
    script: {uri: ./scripts/load.sql, source: {type: file}}    # the same (``uri``, ``file://``)
    script: {source: {type: http, endpoint: "https://...", headers: {...}, timeout: 30}}
    script: {uri: "https://..."}                               # http(s), short form

Files. A playbook is submitted as text, so "relative to the playbook" means relative to
its catalog path under one allowed root on the worker, ``NOETL_WORKER_SCRIPT_DIR``
(unset: file scripts are refused, so no playbook can make a worker read its own files).
A relative ``path`` is looked up as ``<root>/<directory of the catalog path>/<path>``,
then ``<root>/<path>``; an absolute one must be inside the root. The resolved file
(symlinks followed) must stay inside the root: ``..`` or a link out of it is refused.

HTTP(S): fetched by the worker (GET, or ``method``), with the source's ``headers``, within
``timeout`` (default 30 s) and the size limit; a non-2xx answer fails the task. The http
tool can already call any URL a playbook names, so this reaches nothing new.

Every script is at most ``MAX_SCRIPT_BYTES``; gcs / s3 sources are not part of this
runtime (refused naming the type). Problems raise ``ScriptError`` (the task's
``INVALID_TASK``, or retryable for an http failure that may pass).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import httpx

MAX_SCRIPT_BYTES = 1024 * 1024
HTTP_TIMEOUT_SEC = 30.0
SOURCE_TYPES = ("inline", "file", "http", "https")


class ScriptError(Exception):
    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def _source(script: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    source = script.get("source")
    if isinstance(source, str):
        source = {"type": source}
    if source is None:
        source = {}
    if not isinstance(source, Mapping):
        raise ScriptError(f"script.source must be a mapping, got {type(source).__name__}")
    kind = str(source.get("type") or script.get("type") or "").lower()
    if not kind:
        uri = str(script.get("uri") or source.get("endpoint") or "")
        if uri.startswith(("http://", "https://")):
            kind = "http"
        elif script.get("content") is not None or script.get("code") is not None:
            kind = "inline"
        elif script.get("path") or uri.startswith("file://"):
            kind = "file"
    return kind, source


def file_script_path(path: str, root: Path, playbook_path: str = "") -> Path:
    """The file a ``path`` names under ``root`` (module docstring); ScriptError otherwise."""
    base = root.resolve()
    candidates: list[Path] = []
    if Path(path).is_absolute():
        candidates.append(Path(path))
    else:
        parent = PurePosixPath(playbook_path).parent if playbook_path else PurePosixPath(".")
        candidates += [base / str(parent) / path, base / path]
    for candidate in candidates:
        resolved = candidate.resolve()
        if resolved != base and base not in resolved.parents:
            raise ScriptError(f"script path {path!r} is outside the worker's script directory "
                              f"(NOETL_WORKER_SCRIPT_DIR={base})")
        if resolved.is_file():
            return resolved
    raise ScriptError(f"script file {path!r} not found under NOETL_WORKER_SCRIPT_DIR={base}"
                      + (f" (looked in {PurePosixPath(playbook_path).parent}/ too)" if playbook_path else ""))


async def fetch_http(url: str, source: Mapping[str, Any], max_bytes: int = MAX_SCRIPT_BYTES,
                     client: httpx.AsyncClient | None = None) -> str:
    method = str(source.get("method") or "GET").upper()
    headers = source.get("headers") or {}
    if not isinstance(headers, Mapping):
        raise ScriptError("script.source.headers must be a mapping")
    timeout = float(source.get("timeout") or HTTP_TIMEOUT_SEC)
    own = client is None
    http = client or httpx.AsyncClient(follow_redirects=True)
    try:
        async with http.stream(method, url, headers={str(k): str(v) for k, v in headers.items()},
                               timeout=timeout) as resp:
            if resp.status_code // 100 != 2:
                raise ScriptError(f"script {url}: HTTP {resp.status_code}", retryable=resp.status_code >= 500)
            body = b""
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ScriptError(f"script {url} is larger than {max_bytes} bytes")
            return body.decode(resp.encoding or "utf-8")
    except httpx.HTTPError as exc:
        raise ScriptError(f"script {url}: {type(exc).__name__}: {exc}", retryable=True) from exc
    finally:
        if own:
            await http.aclose()


def _read_file(path: str, root: Path, playbook_path: str, max_bytes: int, encoding: str) -> str:
    file = file_script_path(path, root, playbook_path)
    if file.stat().st_size > max_bytes:
        raise ScriptError(f"script file {path!r} is larger than {max_bytes} bytes")
    return file.read_text(encoding=encoding)


async def resolve_script(script: Any, *, root: str | Path | None, playbook_path: str = "",
                         max_bytes: int = MAX_SCRIPT_BYTES) -> str:
    """The text ``script`` (rendered already) designates (module docstring)."""
    if isinstance(script, str):
        return script
    if not isinstance(script, Mapping):
        raise ScriptError(f"script must be text or a mapping, got {type(script).__name__}")
    kind, source = _source(script)
    if kind == "inline":
        text = script.get("content", script.get("code", source.get("content")))
        if not isinstance(text, str):
            raise ScriptError("an inline script needs `content`")
        return text
    if kind == "file":
        path = script.get("path") or source.get("path") or script.get("uri") or source.get("uri")
        if isinstance(path, str) and path.startswith("file://"):
            path = path[len("file://"):]
        if not isinstance(path, str) or not path.strip():
            raise ScriptError("a file script needs `path` (or `uri`)")
        if not root:
            raise ScriptError("file scripts are not enabled on this worker (set NOETL_WORKER_SCRIPT_DIR to the "
                              "directory they may be read from)")
        return await asyncio.to_thread(_read_file, path.strip(), Path(root), playbook_path, max_bytes,
                                       str(script.get("encoding") or "utf-8"))
    if kind in ("http", "https"):
        url = source.get("endpoint") or script.get("uri") or source.get("url") or script.get("path")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ScriptError("an http script needs `source.endpoint` (or `uri`): an http(s) URL")
        return await fetch_http(url, source, max_bytes)
    raise ScriptError(f"script source type {kind or '(none)'!r} is not supported by this runtime "
                      f"(supported: {', '.join(SOURCE_TYPES)})")


__all__ = ["MAX_SCRIPT_BYTES", "ScriptError", "file_script_path", "resolve_script"]
