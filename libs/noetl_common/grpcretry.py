"""gRPC retries, decided once: the failures that are transient, the methods that may be
repeated, and the policy that repeats them. They are defined in the client package
(``noetl_client.retries``, the table in its docstring), which the runtime ships, so the
roles, the CLI and every Python client follow the same rules; this module re-exports
them and adds ``grpc_transient``, which also knows the runtime's ``Unavailable``.

This module imports only grpc, the client package and the standard library: the CLI's
blocking client uses it (docs/ARCHITECTURE.md "CLI start-up"); ``noetl_common.retry``
re-exports ``grpc_transient`` beside the other dependencies' classifiers.
"""

from __future__ import annotations

from noetl_client.retries import (
    BACKOFF_MULTIPLIER,
    IDEMPOTENT,
    INITIAL_BACKOFF_SEC,
    KEY_FIELD,
    KEYED,
    MAX_ATTEMPTS,
    MAX_BACKOFF_SEC,
    NOT_IDEMPOTENT,
    TRANSIENT_CODES,
    call_keyed,
    has_key,
    service_config,
    transient,
)

from .errors import Unavailable


def grpc_transient(exc: BaseException) -> bool:
    """True when calling again can succeed: an RpcError with a ``TRANSIENT_CODES`` status,
    or its translation (``grpcclient.translate``: Unavailable)."""
    return isinstance(exc, Unavailable) or transient(exc)


__all__ = ["BACKOFF_MULTIPLIER", "IDEMPOTENT", "INITIAL_BACKOFF_SEC", "KEYED", "KEY_FIELD", "MAX_ATTEMPTS",
           "MAX_BACKOFF_SEC", "NOT_IDEMPOTENT", "TRANSIENT_CODES", "call_keyed", "grpc_transient", "has_key",
           "service_config"]
