"""The project's exception tree. Dependencies' errors are translated once, at the
edge that talks to them (psycopg in db.py, nats in natsio.py, grpc in grpcclient.py),
and chained with ``from``. Servicers map these to gRPC status codes in one place
(``grpcutil.STATUS_FOR``).

    NoetlError
    ├── InvalidInput          bad playbook, payload, argument      -> INVALID_ARGUMENT
    │   └── PlaybookInvalid   names the field path of the problem
    ├── NotFound              unknown execution, playbook, command -> NOT_FOUND
    ├── PermissionDenied      the caller's identity may not do this -> PERMISSION_DENIED
    │   └── NotQualified      a worker claimed a command of another pool / labels
    ├── Conflict              lost a race (claimed by another)     -> FAILED_PRECONDITION
    ├── Overloaded            backpressure, retry later            -> RESOURCE_EXHAUSTED
    ├── LeaseLost             a fenced write found the lease gone  -> ABORTED
    ├── ConfigError           a setting is missing or out of range (startup)
    ├── Unavailable           a dependency is down                 -> UNAVAILABLE
    ├── Unimplemented         the peer does not serve the method   -> UNIMPLEMENTED
    └── ToolError             a tool failed while running a task (worker side)
"""

from __future__ import annotations


class NoetlError(Exception):
    """Root of every error this project raises on purpose."""


class InvalidInput(NoetlError):
    """The caller sent something that can never work as sent."""


class PlaybookInvalid(InvalidInput):
    """A playbook failed validation. ``path`` is the field path, e.g. ``workflow[1].tool``."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        already = not path or message.startswith(path)
        super().__init__(message if already else f"{path}: {message}")


class NotFound(NoetlError):
    """The named thing does not exist."""


class PermissionDenied(NoetlError):
    """The caller is known but may not do this."""


class Conflict(NoetlError):
    """The operation lost a race or the target is in the wrong state."""


class NotQualified(PermissionDenied):
    """A worker claimed a command placed in another pool, or requiring labels or a tool
    kind it does not have (``noetl_common.pools``)."""


class Overloaded(NoetlError):
    """The system is saturated; ``retry_after`` seconds is a hint."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class LeaseLost(NoetlError):
    """A fenced write found that this process no longer holds the lease it used."""


class ConfigError(NoetlError):
    """A configuration value is missing or invalid."""


class Unavailable(NoetlError):
    """A dependency (Postgres, NATS, a peer service) cannot be reached."""


class Unimplemented(NoetlError):
    """The peer does not serve this method (an older version of it)."""


class ToolError(NoetlError):
    """A tool failed to run a task. ``code`` is machine-readable, ``retryable`` a hint."""

    def __init__(self, message: str, *, code: str = "TOOL_ERROR", kind: str = "", retryable: bool = False,
                 details: dict | None = None) -> None:
        self.code = code
        self.kind = kind
        self.retryable = retryable
        self.details = details or {}
        super().__init__(message)
