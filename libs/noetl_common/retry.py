"""Which failures are the infrastructure's, and how the runtime retries them: one classifier.

A *transient* failure is one the same call can get past by waiting: a dependency that is
down, restarting, unreachable, overloaded or timing out (Postgres, NATS, a peer's gRPC
server, an S3 store), a connection reset, a serialization failure or deadlock. Everything
else is *permanent* for the call that raised it: bad input, a missing row, a lost race, a
lease that is no longer ours, a bug. Transient failures are the runtime's to absorb:
callers retry them with capped, jittered exponential backoff for a bounded time and never
turn them into a user-visible task error while that time lasts; permanent failures are
never retried blindly.

    transient                                  permanent
    ---------                                  ---------
    Unavailable (translated psycopg            InvalidInput, NotFound, Conflict,
      OperationalError / PoolTimeout,          LeaseLost, ConfigError, ToolError,
      nats errors, gRPC UNAVAILABLE /          any other NoetlError, any other exception
      DEADLINE_EXCEEDED)
    raw psycopg OperationalError (includes
      AdminShutdown, CannotConnectNow,
      SerializationFailure, DeadlockDetected,
      LockNotAvailable), PoolTimeout
    nats connection/timeout errors, OSError,
    TimeoutError
    grpc.RpcError UNAVAILABLE, DEADLINE_EXCEEDED

``retrying()`` is the one retry loop of the project's infrastructure calls (tenacity
underneath): ``async for attempt in retrying(...): with attempt: await call()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import psycopg
from nats.errors import Error as NatsError
from psycopg_pool import PoolTimeout
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    stop_never,
    wait_exponential,
    wait_random,
)
from tenacity.stop import stop_base

from .errors import ConfigError, NoetlError, Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_GRPC = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


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
    if isinstance(exc, Unavailable):
        return True
    if isinstance(exc, psycopg.OperationalError | PoolTimeout):
        return True
    if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return True
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        return code in _TRANSIENT_GRPC
    if isinstance(exc, NatsError):
        return True  # connection closed / no servers / timeouts: the client reconnects by itself
    return isinstance(exc, OSError | TimeoutError | asyncio.TimeoutError)


class _stop_when(stop_base):
    """Stop retrying when ``predicate()`` says so (the work was cancelled, the service stops)."""

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._predicate()


def retrying(what: str, *, deadline_sec: float | None, initial: float = 0.05, cap: float = 2.0,
             give_up: Callable[[], bool] | None = None,
             transient: Callable[[BaseException], bool] = is_transient) -> AsyncRetrying:
    """A tenacity loop that retries transient failures of ``what`` with jittered exponential
    backoff (``initial`` doubling up to ``cap`` seconds) until ``deadline_sec`` has passed
    (None: forever) or ``give_up()`` is true; the last failure is then re-raised as it was.
    Permanent failures are re-raised at once. Each retry is logged with what failed."""

    def log(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning("%s failed (attempt %d: %s); retrying in %.2fs", what, state.attempt_number,
                       exc, wait)

    stop: stop_base = stop_never if deadline_sec is None else stop_after_delay(deadline_sec)
    if give_up is not None:
        stop = stop | _stop_when(give_up)
    return AsyncRetrying(retry=retry_if_exception(transient), stop=stop,
                         wait=wait_exponential(multiplier=initial, max=cap) + wait_random(0, initial),
                         before_sleep=log, reraise=True)


async def retry_transient(what: str, call: Callable[[], Awaitable[T]], *, deadline_sec: float | None,
                          give_up: Callable[[], bool] | None = None, initial: float = 0.05,
                          cap: float = 2.0, transient: Callable[[BaseException], bool] = is_transient) -> T:
    """``await call()``; when it fails transiently, again under ``retrying(...)``. Returns
    its result or raises its last failure. The first attempt runs bare: building a
    retry loop costs ~0.1 ms, paid only when something failed (measured on the worker's
    hot path, where every command stores a result and reads earlier ones)."""
    try:
        return await call()
    except Exception as exc:
        if not transient(exc) or (give_up is not None and give_up()):
            raise
        logger.warning("%s failed (%s); retrying", what, exc)
    async for attempt in retrying(what, deadline_sec=deadline_sec, give_up=give_up, initial=initial, cap=cap,
                                  transient=transient):
        with attempt:
            return await call()
    raise AssertionError("unreachable")  # pragma: no cover
