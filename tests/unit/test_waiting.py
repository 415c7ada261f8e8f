"""tests/waiting.py, the test tree's one poll helper: it returns the condition's first
truthy value, takes sync and async conditions, and fails naming what it waited for and
the last value or exception it saw."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from waiting import until, until_set, until_sync


def counter(ready_at: int) -> tuple[list[int], Callable[[], int | None]]:
    calls: list[int] = []

    def check() -> int | None:
        calls.append(1)
        return len(calls) * 10 if len(calls) >= ready_at else None

    return calls, check


async def test_until_returns_the_first_truthy_value_of_a_sync_condition() -> None:
    calls, check = counter(3)
    assert await until(check, timeout=5, what="the third call", interval=0.001) == 30
    assert len(calls) == 3


async def test_until_awaits_an_async_condition_and_a_lambda_returning_a_coroutine() -> None:
    values = iter([0, "", {"n": 1}])

    async def probe() -> object:
        await asyncio.sleep(0)  # not a wait: a condition that really suspends
        return next(values)

    assert await until(probe, timeout=5, what="a row", interval=0.001) == {"n": 1}
    assert await until(lambda: probe_once("x"), timeout=5, what="x") == "x"


async def probe_once(value: str) -> str:
    return value


async def test_until_fails_naming_what_and_the_last_value_seen() -> None:
    calls: list[int] = []

    def probe() -> list[int] | None:  # None twice, then [] for ever: the failure names the []
        calls.append(1)
        return None if len(calls) <= 2 else []

    with pytest.raises(AssertionError, match=r"^timed out after 0\.2s waiting for the answer \(\d+ checks;"
                                             r" last value seen: \[\]\)$"):
        await until(probe, timeout=0.2, what="the answer", interval=0.01)
    assert len(calls) > 2


async def test_until_checks_once_more_at_the_deadline_and_never_sleeps_past_it() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"\(2 checks;"):
        await until(lambda: False, timeout=0.05, what="never", interval=10)
    assert time.monotonic() - started < 5


async def test_an_exception_fails_at_once_unless_it_is_ignored() -> None:
    def broken() -> bool:
        raise KeyError("boom")

    with pytest.raises(KeyError):
        await until(broken, timeout=30, what="never")

    tries = iter(range(3))

    def flaky() -> str:
        assert next(tries) == 2, "not the third try"
        return "third"

    assert await until(flaky, timeout=5, what="the third try", interval=0.001, ignoring=AssertionError) == "third"

    with pytest.raises(AssertionError, match=r"waiting for a lookup .*last exception seen: KeyError\('boom'\)") as info:
        await until(broken, timeout=0.05, what="a lookup", interval=0.01, ignoring=(KeyError, OSError))
    assert isinstance(info.value.__cause__, KeyError)


def test_until_sync_returns_the_value_and_fails_naming_what_and_the_last_value() -> None:
    _, check = counter(2)
    assert until_sync(check, timeout=5, what="the second call", interval=0.001) == 20
    with pytest.raises(AssertionError, match=r"timed out after 0\.05s waiting for rows \(\d+ checks; last value seen: \[\]\)"):
        until_sync(lambda: [], timeout=0.05, what="rows", interval=0.01)


def test_until_sync_ignores_only_the_named_exceptions_and_refuses_an_async_condition() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("port 1")

    with pytest.raises(AssertionError, match=r"last exception seen: ConnectionRefusedError\('port 1'\)"):
        until_sync(refused, timeout=0.05, what="the port", interval=0.01, ignoring=OSError)
    with pytest.raises(ConnectionRefusedError):
        until_sync(refused, timeout=30, what="the port")
    with pytest.raises(TypeError, match="use until"):
        until_sync(lambda: probe_once("x"), timeout=5, what="x")  # type: ignore[arg-type, return-value]


class Pending:
    """A falsy value with a long repr (e.g. a page of rows still not ready)."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "x" * 5000


def test_a_long_last_value_is_cut() -> None:
    with pytest.raises(AssertionError, match=r"last value seen: x{2000}\.\.\. \(5000 chars\)\)$"):
        until_sync(Pending, timeout=0.01, what="text", interval=0.005)


async def test_until_set_returns_once_the_event_is_set_and_fails_naming_what() -> None:
    event = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, event.set)
    await until_set(event, timeout=5, what="the signal")
    with pytest.raises(AssertionError, match=r"timed out after 0\.05s waiting for the other signal"):
        await until_set(asyncio.Event(), timeout=0.05, what="the other signal")
