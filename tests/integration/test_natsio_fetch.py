"""``natsio.fetch_first`` against a real JetStream: a slot waiting on several consumers at
once gets the first message as soon as it is stored, and the requests it does not use are
withdrawn: nothing stays pending on the server (no 30 s ack wait) or held in the process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from noetl_common import natsio

pytestmark = pytest.mark.integration

STREAM = "TEST_FETCH_FIRST"


@pytest.fixture
async def subs(nc: NATS) -> AsyncIterator[tuple[JetStreamContext, list[JetStreamContext.PullSubscription]]]:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["fetchfirst.>"]))
    out = []
    for key in ("high", "normal"):
        await js.add_consumer(STREAM, ConsumerConfig(durable_name=key, ack_policy=AckPolicy.EXPLICIT, ack_wait=30,
                                                     filter_subject=f"fetchfirst.{key}"))
        out.append(await js.pull_subscribe_bind(durable=key, stream=STREAM))
    yield js, out
    await js.delete_stream(STREAM)


async def _settled(js: JetStreamContext, durable: str, *, pending: int) -> None:
    """The consumer holds no delivered-but-unacked message and has ``pending`` to deliver."""
    for _ in range(100):
        info = await js.consumer_info(STREAM, durable)
        if info.num_ack_pending == 0 and info.num_pending == pending:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{durable}: ack pending {info.num_ack_pending}, pending {info.num_pending}")


async def test_a_waiting_fetch_gets_the_first_message_stored_and_withdraws_the_rest(subs) -> None:  # type: ignore[no-untyped-def]
    js, (high, normal) = subs
    waiting = asyncio.ensure_future(natsio.fetch_first([high, normal], wait_sec=5.0))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    started = time.monotonic()
    await js.publish("fetchfirst.normal", b"n1")
    msg = await asyncio.wait_for(waiting, 2.0)
    assert msg is not None and msg.data == b"n1" and time.monotonic() - started < 1.0
    await msg.ack()
    await asyncio.sleep(0.2)  # the withdrawal (UNSUB, PING/PONG) runs beside the caller
    # the high request was withdrawn: a message stored now is not swallowed by it
    await js.publish("fetchfirst.high", b"h1")
    await _settled(js, "high", pending=1)
    got = await natsio.fetch_now(high)
    assert got is not None and got.data == b"h1"
    await got.ack()


async def test_messages_that_arrive_together_one_is_taken_and_the_other_given_back(subs) -> None:  # type: ignore[no-untyped-def]
    js, (high, normal) = subs
    await js.publish("fetchfirst.high", b"h2")
    await js.publish("fetchfirst.normal", b"n2")
    msg = await natsio.fetch_first([high, normal], wait_sec=5.0)
    assert msg is not None
    await msg.ack()
    other, durable = (normal, "normal") if msg.data == b"h2" else (high, "high")
    # the other consumer delivered too (both requests were served at once): its message was
    # nak'ed back, so it is available now, not after the 30 s ack wait
    deadline = time.monotonic() + 2.0
    while (got := await natsio.fetch_now(other)) is None:
        assert time.monotonic() < deadline, f"{durable}'s message was not given back"
        await asyncio.sleep(0.02)
    assert got.data != msg.data
    await got.ack()
    await _settled(js, durable, pending=0)


async def test_nothing_to_fetch_returns_none_when_the_requests_expire(subs) -> None:  # type: ignore[no-untyped-def]
    _, pulls = subs
    started = time.monotonic()
    assert await natsio.fetch_first(pulls, wait_sec=0.3) is None
    assert 0.25 < time.monotonic() - started < 2.0
