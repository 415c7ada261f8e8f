"""Waiting in tests: poll a condition until it holds, or fail naming what was awaited and
the last value (or exception) seen. The one poll helper of the test tree (unit,
integration, e2e and deploy tests import it by basename: tests/ is on sys.path through
tests/conftest.py).

- ``await until(cond, timeout=..., what=...)`` in async tests; ``cond`` may be sync or
  async (a callable returning an awaitable is awaited). Returns ``cond``'s first truthy
  value.
- ``until_sync(cond, timeout=..., what=...)``: the same for sync tests (``cond`` sync).
- ``await until_set(event, timeout=..., what=...)`` when the code under test sets an
  ``asyncio.Event``: no polling at all.

An exception from ``cond`` fails the wait at once, unless its type is in ``ignoring``:
then it counts as "not yet" and, if it is the last thing seen, is named in the failure
(and chained to it). ``ignoring=AssertionError`` lets a condition explain itself with
``assert ready, f"... {state}"``.

A fixed sleep in a test is for time that is part of what the test means (a lease must
expire, a stack stays idle for N s); such a sleep carries a comment saying why it
is not a wait (``# a sleep, not a wait: ...``), so ``grep -rn "sleep(" tests`` explains itself. Anything
that waits for something to happen waits here, with a generous ``timeout``: a deadline
only costs time when the test is failing anyway.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

INTERVAL = 0.05  # seconds between two checks unless the caller says otherwise
_LAST_CHARS = 2000  # a longer last-seen repr is cut (a query's rows can be large)

Ignored = type[BaseException] | tuple[type[BaseException], ...]


def _failure(what: str, timeout: float, checks: int, last: Any) -> AssertionError:
    seen = repr(last)
    if len(seen) > _LAST_CHARS:
        seen = seen[:_LAST_CHARS] + f"... ({len(seen)} chars)"
    kind = "exception" if isinstance(last, BaseException) else "value"
    return AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                          f" ({checks} checks; last {kind} seen: {seen})")


async def until(condition: Callable[[], T | Awaitable[T]], *, timeout: float,  # noqa: ASYNC109 (a deadline, not a cancel)
                what: str, interval: float = INTERVAL, ignoring: Ignored = ()) -> T:
    """Check ``condition()`` (awaited when it returns an awaitable) every ``interval`` s
    until it returns something truthy, which is returned; after ``timeout`` s raise
    AssertionError naming ``what`` and the last value or ignored exception seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    checks = 0
    while True:
        checks += 1
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except ignoring as exc:
            last: Any = exc
        else:
            if value:
                return value  # type: ignore[return-value]
            last = value
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _failure(what, timeout, checks, last) from (last if isinstance(last, BaseException) else None)
        await asyncio.sleep(min(interval, remaining))


def until_sync(condition: Callable[[], T], *, timeout: float, what: str, interval: float = INTERVAL,
               ignoring: Ignored = ()) -> T:
    """``until`` for sync tests: ``condition`` is a plain callable, the pause a
    ``time.sleep``."""
    deadline = time.monotonic() + timeout
    checks = 0
    while True:
        checks += 1
        try:
            value = condition()
        except ignoring as exc:
            last: Any = exc
        else:
            if inspect.isawaitable(value):
                close = getattr(value, "close", None)
                if close is not None:
                    close()  # no "never awaited" warning on top of the error
                raise TypeError(f"until_sync: the condition for {what} returned an awaitable; use until()")
            if value:
                return value
            last = value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _failure(what, timeout, checks, last) from (last if isinstance(last, BaseException) else None)
        time.sleep(min(interval, remaining))


async def until_set(event: asyncio.Event, *, timeout: float, what: str) -> None:  # noqa: ASYNC109
    """Wait for ``event`` to be set, or raise AssertionError naming ``what``."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (the event was never set)") from None
