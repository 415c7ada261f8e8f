"""Integration fixtures: a pool and a NATS connection per module, against the session's
real Postgres and NATS (tests/conftest.py starts them on free ports)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from noetl_common import natsio
from noetl_common.db import Pool, make_pool


def _name(request: pytest.FixtureRequest) -> str:
    return "test-" + request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")


@pytest.fixture(scope="module")
async def pool(pg_dsn: str, request: pytest.FixtureRequest) -> AsyncIterator[Pool]:
    p = make_pool(pg_dsn, min_size=1, max_size=8, name=_name(request))
    await p.open(wait=True, timeout=30)
    yield p
    await p.close()


@pytest.fixture(scope="module")
async def nc(nats_url: str, request: pytest.FixtureRequest) -> AsyncIterator[NATS]:
    conn = await natsio.connect(nats_url, name=_name(request))
    await natsio.ensure_streams(conn.jetstream())
    yield conn
    await conn.drain()

