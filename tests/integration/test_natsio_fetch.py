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
from waiting import until

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
    async def settled() -> bool:
        info = await js.consumer_info(STREAM, durable)
        assert info.num_ack_pending == 0 and info.num_pending == pending, (
            f"ack pending {info.num_ack_pending}, pending {info.num_pending}")
        return True

    await until(settled, timeout=5, what=f"{durable} settled with {pending} to deliver", interval=0.02,
                ignoring=AssertionError)


async def _requests_waiting(js: JetStreamContext, durable: str) -> int:
    """Pull requests the server holds for the consumer (not yet answered or withdrawn)."""
    return int((await js.consumer_info(STREAM, durable)).num_waiting)


async def test_a_waiting_fetch_gets_the_first_message_stored_and_withdraws_the_rest(subs) -> None:  # type: ignore[no-untyped-def]
    js, (high, normal) = subs
    waiting = asyncio.ensure_future(natsio.fetch_first([high, normal], wait_sec=5.0))
    for durable in ("high", "normal"):
        await until(lambda d=durable: _requests_waiting(js, d), timeout=5, what=f"the pull request on {durable}",
                    interval=0.01)
    assert not waiting.done()
    started = time.monotonic()
    await js.publish("fetchfirst.normal", b"n1")
    msg = await asyncio.wait_for(waiting, 2.0)
    assert msg is not None and msg.data == b"n1" and time.monotonic() - started < 1.0
    await msg.ack()
    # the withdrawal (UNSUB, PING/PONG) runs beside the caller; well inside the request's 5 s
    # expiry, so only a withdrawal can end it
    async def withdrawn() -> bool:
        return await _requests_waiting(js, "high") == 0

    await until(withdrawn, timeout=2, what="the high pull request withdrawn", interval=0.01)
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
    got = await until(lambda: natsio.fetch_now(other), timeout=2.0, what=f"{durable}'s message given back",
                      interval=0.02)
    assert got.data != msg.data
    await got.ack()
    await _settled(js, durable, pending=0)


async def test_nothing_to_fetch_returns_none_when_the_requests_expire(subs) -> None:  # type: ignore[no-untyped-def]
    _, pulls = subs
    started = time.monotonic()
    assert await natsio.fetch_first(pulls, wait_sec=0.3) is None
    assert 0.25 < time.monotonic() - started < 2.0


async def test_a_reconnect_ends_the_wait_at_once_without_polling(subs) -> None:  # type: ignore[no-untyped-def]
    """On a connection connect() made, the reconnect signal (the server forgot the requests)
    ends a waiting fetch at once: idle slots are not woken every so often to look."""
    js, (high, normal) = subs
    waiting = asyncio.ensure_future(natsio.fetch_first([high, normal], wait_sec=30.0))
    await until(lambda: _requests_waiting(js, "normal"), timeout=5, what="the pull request on normal", interval=0.01)
    started = time.monotonic()
    natsio._reconnected(high._nc)  # what connect()'s reconnected callback does
    assert await asyncio.wait_for(waiting, 2.0) is None
    assert time.monotonic() - started < 0.2  # not after a poll interval, nor the 30 s wait
    # its requests were withdrawn: a message stored now is there for the next fetch
    async def withdrawn() -> bool:
        return await _requests_waiting(js, "normal") == 0 and await _requests_waiting(js, "high") == 0

    await until(withdrawn, timeout=2, what="the requests withdrawn", interval=0.01)
    await js.publish("fetchfirst.normal", b"n9")
    await _settled(js, "normal", pending=1)
    got = await natsio.fetch_first([high, normal], wait_sec=5.0)  # the new signal does not end this one
    assert got is not None and got.data == b"n9"
    await got.ack()


async def test_a_wake_ends_the_wait_and_withdraws_the_requests(subs) -> None:  # type: ignore[no-untyped-def]
    """A slot woken for other work (a handed-off command) stops waiting at once; its
    requests are withdrawn, so a message stored afterwards waits for the next fetch."""
    js, (high, normal) = subs
    wake = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(natsio.fetch_first([high, normal], wait_sec=30.0, wake=wake))
    await until(lambda: _requests_waiting(js, "normal"), timeout=5, what="the pull request on normal", interval=0.01)
    wake.set_result(None)
    assert await asyncio.wait_for(waiting, 2.0) is None

    async def withdrawn() -> bool:
        return await _requests_waiting(js, "normal") == 0 and await _requests_waiting(js, "high") == 0

    await until(withdrawn, timeout=2, what="both pull requests withdrawn", interval=0.01)
    await js.publish("fetchfirst.normal", b"n3")
    await _settled(js, "normal", pending=1)
    got = await natsio.fetch_now(normal)
    assert got is not None and got.data == b"n3"
    await got.ack()
