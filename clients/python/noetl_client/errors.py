"""The client's exceptions, one root; a failed call's ``grpc.RpcError`` becomes one of
them here, once (``translate``), chained with ``from``::

    ClientError                      anything this package raises on purpose
    ├── ConfigError                  bad configuration (no target, an unreadable CA file)
    ├── WaitTimeout                  ``wait`` gave up before the execution ended
    └── ApiError                     the api answered a call with an error status
        ├── InvalidArgument          INVALID_ARGUMENT: a rejected playbook or payload
        ├── NotFound                 NOT_FOUND: an unknown execution, path or step
        ├── Unauthenticated          UNAUTHENTICATED: no token, or an unknown one
        ├── PermissionDenied         PERMISSION_DENIED: the token's role may not do it
        ├── Conflict                 FAILED_PRECONDITION, ALREADY_EXISTS
        └── Unavailable              UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED:
                                     worth retrying later
"""

from __future__ import annotations

import grpc


class ClientError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(ClientError):
    """The client's configuration cannot work (no target, an unreadable CA file)."""


class WaitTimeout(ClientError):
    """The execution did not end within the time ``wait`` was given (it goes on)."""


class ApiError(ClientError):
    """The api answered with an error status: ``code`` (a ``grpc.StatusCode``) and its
    ``details`` (the server's message)."""

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(details or (code.name if code is not None else "error"))
        self.code = code
        self.details = details


class InvalidArgument(ApiError):
    pass


class NotFound(ApiError):
    pass


class Unauthenticated(ApiError):
    pass


class PermissionDenied(ApiError):
    pass


class Conflict(ApiError):
    pass


class Unavailable(ApiError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[ApiError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: Conflict,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Unavailable,
}


def translate(exc: grpc.RpcError) -> ApiError:
    """The ``ApiError`` of a failed call."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    return _BY_CODE.get(code, ApiError)(code, details)  # type: ignore[arg-type]


__all__ = ["ApiError", "ClientError", "ConfigError", "Conflict", "InvalidArgument", "NotFound", "PermissionDenied",
           "Unauthenticated", "Unavailable", "WaitTimeout", "translate"]
