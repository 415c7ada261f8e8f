"""Keeping secrets out of what the runtime writes down: by key name and by value.

By key name: a mapping key that looks like a credential's (``is_secret_key``:
``password``, ``token``, ``dsn``, ... anywhere in the key, case-insensitive) never has its
value copied into an event's context, and is masked in error details.

By value: a worker knows the secret values it resolved for a command (the stored
credentials it read for it, and what it built from them: a basic-auth header, a DSN's
password). A :class:`Redactor` per command holds them and scrubs them from every error
message, stdout excerpt, result and ``set`` update the command produces::

    redactor = Redactor()
    redactor.add_credential("postgres", {"dsn": "host=db password=s3cret"})
    redactor.text("connect failed: password=s3cret")   # 'connect failed: password=[REDACTED]'

A value is matched as it is, JSON-escaped (inside JSON text), as Python prints it inside a
repr, and percent-encoded (inside a URL or a DSN). Values shorter than ``MIN_SECRET_CHARS`` are not scrubbed (they would mask
half of every message; such a secret is no secret).

Log lines are scrubbed in the process's log handlers by :class:`LogFilter`, which applies
every redactor registered in an :class:`ActiveSecrets` (the worker registers each
command's redactor while the command runs): log records do not say which command
produced them, and a python task's stderr is not a command's either.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

MASK = "[REDACTED]"
MIN_SECRET_CHARS = 4

# A key containing any of these (case-insensitive) names a credential-like value.
SECRET_KEY_PARTS = (
    "password", "passwd", "pwd", "secret", "token", "api_key", "apikey", "api-key", "authorization", "auth",
    "credential", "private_key", "privatekey", "private-key", "dsn", "cookie", "session", "signature",
    "access_key", "accesskey", "conn_str", "connection_string",
)


def is_secret_key(key: str) -> bool:
    """True when ``key`` looks like the name of a credential (``SECRET_KEY_PARTS``)."""
    lowered = key.lower()
    return any(part in lowered for part in SECRET_KEY_PARTS)


def mask_secret_keys(value: Any) -> Any:
    """``value`` with the values of credential-shaped keys (nested too) replaced by MASK."""
    if isinstance(value, Mapping):
        return {k: MASK if isinstance(k, str) and is_secret_key(k) and v not in (None, "")
                else mask_secret_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mask_secret_keys(v) for v in value]
    return value


def _strings(value: Any, *, secret_only: bool, under_secret: bool = False) -> Iterable[str]:
    if isinstance(value, str):
        if under_secret or not secret_only:
            yield value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if under_secret:  # a numeric password is a secret too
            yield str(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, secret_only=secret_only,
                                under_secret=under_secret or (isinstance(k, str) and is_secret_key(k)))
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v, secret_only=secret_only, under_secret=under_secret)


def secret_values(kind: str, data: Mapping[str, Any]) -> set[str]:
    """The values of a stored credential that are secret: every string under a
    credential-shaped key (``password``, ``token``, ``dsn``, ...), the password inside a
    DSN, ``user:password`` and its base64 for http_basic; for ``generic`` (opaque) every
    string of the credential."""
    values = set(_strings(data, secret_only=kind != "generic"))
    for key in ("dsn", "conninfo", "url"):
        dsn = data.get(key)
        if isinstance(dsn, str):
            values |= dsn_passwords(dsn)
    if kind == "http_basic":
        user, password = data.get("username"), data.get("password")
        if password is not None:
            pair = f"{user or ''}:{password}"
            values |= {str(password), pair, base64.b64encode(pair.encode()).decode()}
    return values


def dsn_passwords(dsn: str) -> set[str]:
    """The password of a libpq connection string or URL (empty when it has none)."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        password = conninfo_to_dict(dsn).get("password")
    except Exception:  # not a DSN libpq understands: nothing to take from it
        return set()
    return {str(password)} if password else set()


class Redactor:
    """The secret values one command resolved, and scrubbing them (module docstring)."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._forms: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self._lock = threading.Lock()  # log records may be filtered on other threads
        for value in values:
            self.add(value)

    def __bool__(self) -> bool:
        return bool(self._forms)

    def __repr__(self) -> str:  # never the values
        return f"Redactor({len(self._forms)} forms)"

    def add(self, value: Any) -> None:
        if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS:
            return
        forms = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1], repr(value)[1:-1],
                 quote(value, safe=""), quote(value)}
        with self._lock:
            new = {f for f in forms if len(f) >= MIN_SECRET_CHARS} - self._forms
            if new:
                self._forms |= new
                self._pattern = None

    def add_credential(self, kind: str, data: Mapping[str, Any]) -> None:
        for value in secret_values(kind, data):
            self.add(value)

    def _compiled(self) -> re.Pattern[str] | None:
        with self._lock:
            if self._pattern is None and self._forms:
                # longest first: a secret that contains another is masked whole
                self._pattern = re.compile("|".join(re.escape(f) for f in sorted(self._forms, key=len, reverse=True)))
            return self._pattern

    def text(self, text: str) -> str:
        pattern = self._compiled()
        if pattern is None or not text:
            return text
        return pattern.sub(MASK, text)

    def value(self, value: Any) -> Any:
        """``value`` (JSON-like) with every secret masked in its strings and keys."""
        if not self._forms:
            return value
        return self._value(value)

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(k) if isinstance(k, str) else k: self._value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._value(v) for v in value]
        return value


class ActiveSecrets:
    """The redactors of the commands running in this process (registered while each runs)."""

    def __init__(self) -> None:
        self._redactors: dict[int, Redactor] = {}
        self._lock = threading.Lock()

    def register(self, redactor: Redactor) -> None:
        with self._lock:
            self._redactors[id(redactor)] = redactor

    def unregister(self, redactor: Redactor) -> None:
        with self._lock:
            self._redactors.pop(id(redactor), None)

    def __bool__(self) -> bool:
        with self._lock:
            return any(self._redactors.values())

    def text(self, text: str) -> str:
        with self._lock:
            redactors = [r for r in self._redactors.values() if r]
        for redactor in redactors:
            text = redactor.text(text)
        return text


class LogFilter(logging.Filter):
    """Scrubs the secrets of ``active`` from every record (message, arguments, exception
    text) a handler is about to write. Costs nothing while no command holds a secret."""

    def __init__(self, active: ActiveSecrets) -> None:
        super().__init__()
        self.active = active

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.active:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the formatter
            return True
        scrubbed = self.active.text(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.active.text(record.exc_text)
        if record.stack_info:
            record.stack_info = self.active.text(record.stack_info)
        return True


__all__ = ["MASK", "MIN_SECRET_CHARS", "SECRET_KEY_PARTS", "ActiveSecrets", "LogFilter", "Redactor",
           "dsn_passwords", "is_secret_key", "mask_secret_keys", "secret_values"]
