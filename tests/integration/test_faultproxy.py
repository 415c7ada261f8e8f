"""The chaos tests' TCP fault proxy (tests/e2e/faultproxy.py) on its own, in front of the
session's real Postgres: a psycopg session through it works (pass), fails at once
(refuse), hangs (blackhole) and works again (back to pass)."""

from __future__ import annotations

import concurrent.futures
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from faultproxy import FaultProxy

pytestmark = pytest.mark.integration

HOLD = 1.0  # how long a blackholed call must stay unanswered to count as hanging


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[FaultProxy]:
    p = FaultProxy()
    yield p
    p.close()


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        yield ex


def select(dsn: str, value: int = 1, **kw: Any) -> int:
    with psycopg.connect(dsn, autocommit=True, **kw) as conn:
        return int(conn.execute("SELECT %s::int", (value,)).fetchone()[0])  # type: ignore[index]


def test_pass_refuse_blackhole_and_back(proxy: FaultProxy, pg_dsn: str,
                                        pool: concurrent.futures.ThreadPoolExecutor) -> None:
    via = proxy.dsn_via(pg_dsn)
    assert f"port={proxy.port}" in via and proxy.target is not None
    assert select(via, 7) == 7
    session = psycopg.connect(via, autocommit=True)
    assert session.execute("SELECT pg_backend_pid()").fetchone() is not None
    assert proxy.open_connections == 1

    proxy.set_mode("refuse")  # the open session is reset at once, new ones are turned away
    assert proxy.open_connections == 0
    with pytest.raises(psycopg.OperationalError):
        session.execute("SELECT 1")
    session.close()
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        select(via, connect_timeout=10)
    assert time.monotonic() - started < 5, "refused, not left to time out"

    proxy.set_mode("blackhole")  # a new session is accepted and then hears nothing
    held = pool.submit(select, via, 8, connect_timeout=30)
    with pytest.raises(concurrent.futures.TimeoutError):
        held.result(timeout=HOLD)
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        select(via, connect_timeout=1)  # libpq gives up on its own deadline: it hung
    assert time.monotonic() - started >= 0.9

    proxy.set_mode("pass")  # the partition heals: the held session goes through
    assert held.result(timeout=30) == 8
    assert select(via, 9) == 9
    assert select(pg_dsn, 10) == 10  # the direct way never went through the proxy


def test_a_partition_holds_an_open_session_until_it_heals(
        proxy: FaultProxy, pg_dsn: str, pool: concurrent.futures.ThreadPoolExecutor) -> None:
    session = psycopg.connect(proxy.dsn_via(pg_dsn), autocommit=True)
    try:
        assert session.execute("SELECT 1").fetchone() == (1,)
        proxy.set_mode("blackhole")
        query = pool.submit(lambda: session.execute("SELECT 42").fetchone())
        with pytest.raises(concurrent.futures.TimeoutError):
            query.result(timeout=HOLD)
        proxy.set_mode("pass")
        assert query.result(timeout=30) == (42,)
    finally:
        session.close()


def test_refuse_from_the_start_and_a_target_set_later(pg_dsn: str) -> None:
    with FaultProxy(mode="refuse") as proxy:
        assert proxy.target is None
        with pytest.raises(psycopg.OperationalError):
            select(f"host=127.0.0.1 port={proxy.port} user=noetl dbname=noetl", connect_timeout=5)
        via = proxy.dsn_via(pg_dsn)
        proxy.set_mode("pass")
        assert select(via) == 1
        with pytest.raises(ValueError, match="mode must be one of"):
            proxy.set_mode("drop")


def test_close_stops_listening_and_resets_sessions(pg_dsn: str) -> None:
    proxy = FaultProxy()
    session = psycopg.connect(proxy.dsn_via(pg_dsn), autocommit=True)
    proxy.close()
    proxy.close()  # idempotent
    with pytest.raises(psycopg.OperationalError):
        session.execute("SELECT 1")
    session.close()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", proxy.port), timeout=2):
        pass
    assert not proxy._thread.is_alive()
