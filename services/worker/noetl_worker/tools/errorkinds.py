"""Error kinds as upstream NoETL's policies test them (``output.error.kind``, also readable
as ``output.error.type``): a small vocabulary of what went wrong, independent of the tool
and of the Python exception that carried it.

    connection, timeout                      the network / a deadline
    rate_limit, auth, not_found,             an HTTP status (429; 401/403; 404; other 4xx;
    client_error, server_error               5xx)
    schema, parse                            bad data (TypeError, ValueError, KeyError, ...;
                                             JSON that does not parse)
    db_connection, db_constraint,            a database error by SQLSTATE (08xxx; 23xxx;
    db_deadlock, db_timeout                  40001/40P01; 57014)
    config                                   the task itself is invalid (a template, a field)
    limit                                    a limit of this runtime (memory, result size)
    unknown                                  anything else

Our own error codes (``outcome.py``: ``TIMEOUT``, ``HTTP_ERROR``, ``RESULT_TOO_LARGE``, ...)
stay in ``code``; the Python exception class, when there is one, is ``exception_type``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONNECTION = "connection"
TIMEOUT = "timeout"
RATE_LIMIT = "rate_limit"
AUTH = "auth"
NOT_FOUND = "not_found"
CLIENT_ERROR = "client_error"
SERVER_ERROR = "server_error"
SCHEMA = "schema"
PARSE = "parse"
DB_CONNECTION = "db_connection"
DB_CONSTRAINT = "db_constraint"
DB_DEADLOCK = "db_deadlock"
DB_TIMEOUT = "db_timeout"
CONFIG = "config"
LIMIT = "limit"
UNKNOWN = "unknown"

KINDS = frozenset({CONNECTION, TIMEOUT, RATE_LIMIT, AUTH, NOT_FOUND, CLIENT_ERROR, SERVER_ERROR, SCHEMA,
                   PARSE, DB_CONNECTION, DB_CONSTRAINT, DB_DEADLOCK, DB_TIMEOUT, CONFIG, LIMIT, UNKNOWN})

# Our codes whose kind does not depend on the details.
_BY_CODE = {
    "TIMEOUT": TIMEOUT,
    "NETWORK_ERROR": CONNECTION,
    "CREDENTIAL_NOT_FOUND": AUTH,
    "CREDENTIAL_NOT_PERMITTED": AUTH,
    "TEMPLATE_ERROR": CONFIG,
    "INVALID_TASK": CONFIG,
    "INVALID_COMMAND": CONFIG,
    "MEMORY_LIMIT": LIMIT,
    "RESULT_TOO_LARGE": LIMIT,
}
_SCHEMA_EXCEPTIONS = frozenset({"TypeError", "ValueError", "ValidationError", "KeyError", "IndexError",
                                "AttributeError", "AssertionError", "UnicodeDecodeError"})
_PARSE_EXCEPTIONS = frozenset({"JSONDecodeError", "ParseError", "ExpatError", "YAMLError"})
_TIMEOUT_EXCEPTIONS = frozenset({"TimeoutError", "TimeoutExpired", "ReadTimeout", "ConnectTimeout",
                                 "PoolTimeout", "QueryCanceled"})
_CONNECTION_EXCEPTIONS = frozenset({"ConnectionError", "ConnectionRefusedError", "ConnectionResetError",
                                    "ConnectionAbortedError", "BrokenPipeError", "URLError", "ConnectError",
                                    "RemoteDisconnected", "gaierror"})


def http_kind(status: int) -> str:
    """The kind of an HTTP error status."""
    if status == 429:
        return RATE_LIMIT
    if status in (401, 403):
        return AUTH
    if status == 404:
        return NOT_FOUND
    if status == 408:
        return TIMEOUT
    if 400 <= status < 500:
        return CLIENT_ERROR
    if status >= 500:
        return SERVER_ERROR
    return UNKNOWN


def sql_kind(sqlstate: str) -> str | None:
    """The kind of a SQLSTATE, or None when it says nothing more than "an SQL error"."""
    if sqlstate in ("40001", "40P01"):
        return DB_DEADLOCK
    if sqlstate.startswith("23"):
        return DB_CONSTRAINT
    if sqlstate.startswith("08") or sqlstate in ("57P01", "57P02", "57P03"):
        return DB_CONNECTION
    if sqlstate == "57014":
        return DB_TIMEOUT
    if sqlstate.startswith("22"):
        return SCHEMA
    return None


def classify(code: str, exception_type: str, details: Mapping[str, Any]) -> str:
    """The kind of an error from our code, the exception class and the details
    (``status_code`` of an HTTP error, ``sqlstate`` of a database error)."""
    status = details.get("status_code")
    if isinstance(status, int) and not isinstance(status, bool) and status >= 400:
        return http_kind(status)
    sqlstate = details.get("sqlstate")
    if isinstance(sqlstate, str) and sqlstate and (kind := sql_kind(sqlstate)) is not None:
        return kind
    if code in _BY_CODE:
        return _BY_CODE[code]
    if exception_type in _TIMEOUT_EXCEPTIONS:
        return TIMEOUT
    if exception_type in _CONNECTION_EXCEPTIONS:
        return CONNECTION
    if exception_type == "OperationalError":  # DB-API: the database went away
        return DB_CONNECTION
    if exception_type in _PARSE_EXCEPTIONS:
        return PARSE
    if exception_type in _SCHEMA_EXCEPTIONS:
        return SCHEMA
    return UNKNOWN
