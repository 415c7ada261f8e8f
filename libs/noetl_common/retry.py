"""Which failures are the infrastructure's, and how the runtime retries them: one
classifier per dependency, and one retry loop.

A *transient* failure is one the same call can get past by waiting: a dependency that is
down, restarting, unreachable, overloaded or timing out (Postgres, NATS, a peer's gRPC
server, an S3 store), a connection reset, a serialization failure or deadlock. Everything
else is *permanent* for the call that raised it: bad input, a missing row, a lost race, a
lease that is no longer ours, a bug. Transient failures are the runtime's to absorb:
callers retry them with capped, jittered exponential backoff for a bounded time and never
turn them into a user-visible task error while that time lasts; permanent failures are
never retried blindly.

    dependency  transient                                  permanent
    ----------  ---------                                  ---------
    gRPC        UNAVAILABLE, DEADLINE_EXCEEDED             every other status
                (``grpc_transient``, from grpcretry.py)
    Postgres    psycopg OperationalError (connection       IntegrityError (UniqueViolation,
                lost or refused, AdminShutdown,              ForeignKeyViolation, ...),
                CannotConnectNow, SerializationFailure,      DataError, ProgrammingError,
                DeadlockDetected, LockNotAvailable,          every other psycopg error
                QueryCanceled), psycopg_pool PoolTimeout
                (``postgres_transient``)
    NATS        every nats error (connection closed or     what waiting cannot fix:
                draining, no servers, timeouts, no           ``NATS_PERMANENT`` (authorization,
                responders, JetStream API errors: a          max payload, a bad subject, ...)
                stream or consumer the api has not made
                yet) (``nats_transient``)
    S3          obstore's (and, for the bucket's HEAD /    401/403, 404, other 4xx,
                PUT, httpx's) timeouts, connect and          an unsupported URL, a
                request errors, a connection cut             missing credential
                mid-answer; HTTP 429 and 5xx
                (``s3_transient``, ``s3_status_transient``)
    any         OSError, TimeoutError

A translated error (``NoetlError``) is transient when it is ``Unavailable``, or when the
dependency error it was raised from (``__cause__``) is; ``ConfigError`` never is.
``is_transient`` is the union: what every caller that does not know which dependency
failed asks.

``retrying()`` is the one retry loop of the project's infrastructure calls (tenacity
underneath): ``async for attempt in retrying(...): with attempt: await call()``;
``retry_transient`` runs a call under it; ``retry_keyed`` runs a submission under it only
when the request carries an idempotency key (grpcretry.py says which calls those are).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import psycopg
from nats import errors as nats_errors
from psycopg_pool import PoolTimeout
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    wait_exponential,
    wait_random,
)
from tenacity.stop import stop_base

from .errors import ConfigError, NoetlError, Unavailable
from .grpcretry import grpc_transient, has_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

# NATS client errors that waiting cannot fix: wrong credentials or permissions, a message
# over the server's max payload, a malformed subject or header, misuse of the client.
NATS_PERMANENT: tuple[type[Exception], ...] = (
    nats_errors.AuthorizationError, nats_errors.InvalidUserCredentialsError, nats_errors.MaxPayloadError,
    nats_errors.BadSubjectError, nats_errors.BadHeaderError, nats_errors.BadSubscriptionError,
    nats_errors.BadTimeoutError, nats_errors.InvalidCallbackTypeError, nats_errors.SecureConnRequiredError,
    nats_errors.SecureConnWantedError, nats_errors.NotJSMessageError, nats_errors.MsgAlreadyAckdError,
)


def postgres_transient(exc: BaseException) -> bool:
    """psycopg's OperationalError (the server went away, refused, restarts, shut the
    session down, or the transaction lost a serialization race or a deadlock: all
    OperationalError subclasses in psycopg 3) and a pool that had no connection in time."""
    return isinstance(exc, psycopg.OperationalError | PoolTimeout)


def nats_transient(exc: BaseException) -> bool:
    """Every nats-py error but ``NATS_PERMANENT``: the client reconnects by itself, and a
    JetStream API error (no such stream, a consumer the server refuses while an older one
    exists) passes once the api has set things up."""
    return isinstance(exc, nats_errors.Error) and not isinstance(exc, NATS_PERMANENT)


def s3_status_transient(status: int) -> bool:
    """An S3 answer that a later call can get past: throttled (429) or a server error (5xx)."""
    return status == 429 or status >= 500


# obstore's errors carry the HTTP status, or the kind of transport failure, only in their
# message: object_store's Display text and a `Debug source:` dump of the error chain.
_OBSTORE_STATUS = re.compile(r"\bstatus(?: code)?:? (\d{3})\b")
_OBSTORE_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
# object_store's HttpErrorKind values that a later call can get past: the connection could
# not be made or was lost, the request timed out or was cut, the body arrived cut short.
OBSTORE_TRANSIENT_KINDS = frozenset({"Connect", "Request", "Timeout", "Interrupted", "Decode"})


def obstore_failure(exc: BaseException) -> tuple[int | None, str | None]:
    """(HTTP status, transport failure kind) of an obstore error, each None when its
    message has none; (None, None) for anything else."""
    if not type(exc).__module__.startswith("obstore") and not isinstance(exc, FileNotFoundError):
        return None, None
    text = str(exc)
    status = _OBSTORE_STATUS.search(text)
    kind = _OBSTORE_KIND.search(text)
    return (int(status.group(1)) if status else None), (kind.group(1) if kind else None)


def s3_transient(exc: BaseException) -> bool:
    """The S3 client's transport: an obstore error with a transient status (429, 5xx) or
    transport failure (connect, request, timeout, a cut answer), or an httpx timeout,
    network error or connection closed mid-answer (the bucket's HEAD / PUT); not a
    malformed request, an unsupported URL or missing credentials."""
    if isinstance(exc, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
        return True
    status, kind = obstore_failure(exc)
    if status is not None:
        return s3_status_transient(status)
    return kind in OBSTORE_TRANSIENT_KINDS


CLASSIFIERS: dict[str, Callable[[BaseException], bool]] = {
    "grpc": grpc_transient,
    "postgres": postgres_transient,
    "nats": nats_transient,
    "s3": s3_transient,
}


def is_transient(exc: BaseException) -> bool:
    """True when waiting and calling again can succeed (see the module docstring)."""
    if isinstance(exc, Unavailable):
        return True
    if isinstance(exc, ConfigError):
        return False  # wrong settings or credentials (even when a NATS error caused it)
    if isinstance(exc, NoetlError):
        # A translated error keeps its cause: a NoetlError wrapping a transient
        # dependency error (e.g. a store error around a connection reset) is transient.
        cause = exc.__cause__
        return cause is not None and cause is not exc and _transient_dependency_error(cause)
    return _transient_dependency_error(exc)


def _transient_dependency_error(exc: BaseException) -> bool:
    if isinstance(exc, Unavailable) or any(transient(exc) for transient in CLASSIFIERS.values()):
        return True
    return isinstance(exc, OSError | TimeoutError | asyncio.TimeoutError)


class _stop_when(stop_base):
    """Stop retrying when ``predicate()`` says so (the work was cancelled, the service stops)."""

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._predicate()


def retrying(what: str, *, deadline_sec: float | None, initial: float = 0.05, cap: float = 2.0,
             give_up: Callable[[], bool] | None = None, attempts: int | None = None,
             transient: Callable[[BaseException], bool] = is_transient) -> AsyncRetrying:
    """A tenacity loop that retries transient failures of ``what`` with jittered exponential
    backoff (``initial`` doubling up to ``cap`` seconds) until ``deadline_sec`` has passed
    (None: forever), ``attempts`` calls were made (None: no limit) or ``give_up()`` is true;
    the last failure is then re-raised as it was. Permanent failures are re-raised at once.
    Each retry is logged with what failed."""

    def log(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning("%s failed (attempt %d: %s); retrying in %.2fs", what, state.attempt_number,
                       exc, wait)

    stop: stop_base = stop_never if deadline_sec is None else stop_after_delay(deadline_sec)
    if attempts is not None:
        stop = stop | stop_after_attempt(attempts)
    if give_up is not None:
        stop = stop | _stop_when(give_up)
    return AsyncRetrying(retry=retry_if_exception(transient), stop=stop,
                         wait=wait_exponential(multiplier=initial, max=cap) + wait_random(0, initial),
                         before_sleep=log, reraise=True)


async def retry_transient(what: str, call: Callable[[], Awaitable[T]], *, deadline_sec: float | None,
                          give_up: Callable[[], bool] | None = None, initial: float = 0.05,
                          cap: float = 2.0, attempts: int | None = None,
                          transient: Callable[[BaseException], bool] = is_transient) -> T:
    """``await call()``; when it fails transiently, again under ``retrying(...)`` (at most
    ``attempts`` calls in all when given). Returns its result or raises its last failure.
    The first attempt runs bare: building a retry loop costs ~0.1 ms, paid only when
    something failed (measured on the worker's hot path, where every command stores a
    result and reads earlier ones)."""
    try:
        return await call()
    except Exception as exc:
        if not transient(exc) or (give_up is not None and give_up()) or (attempts is not None and attempts <= 1):
            raise
        logger.warning("%s failed (%s); retrying", what, exc)
    async for attempt in retrying(what, deadline_sec=deadline_sec, give_up=give_up, initial=initial, cap=cap,
                                  attempts=None if attempts is None else attempts - 1, transient=transient):
        with attempt:
            return await call()
    raise AssertionError("unreachable")  # pragma: no cover


async def retry_keyed(what: str, request: Any, call: Callable[[], Awaitable[T]], *, attempts: int,
                      initial: float = 0.1, cap: float = 2.0,
                      transient: Callable[[BaseException], bool] = is_transient) -> T:
    """A submission (SubmitExecution, RerunExecution: ``grpcretry.KEYED``) of ``request``:
    ``await call()``, and when it fails transiently, again with the same request, at most
    ``attempts`` calls, only if ``request`` carries an idempotency key (the api answers a
    repeated key with the execution the first call made). Without a key: one call; gRPC's
    channel policy cannot look at the key, so it never repeats these methods."""
    if not has_key(request):
        return await call()
    return await retry_transient(what, call, deadline_sec=None, attempts=attempts, initial=initial, cap=cap,
                                 transient=transient)


__all__ = ["CLASSIFIERS", "NATS_PERMANENT", "OBSTORE_TRANSIENT_KINDS", "grpc_transient", "is_transient",
           "nats_transient", "obstore_failure", "postgres_transient", "retry_keyed", "retry_transient", "retrying",
           "s3_status_transient", "s3_transient"]
