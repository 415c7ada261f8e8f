"""``natsio.publish`` against a real NATS server: a publish whose ack is still awaited when
the client re-establishes its connection does not wait out its ack wait (the server that was
to answer is gone). One with a Msg-Id is sent again at once on the new connection (the
stream's duplicate window keeps one copy); one without ends with ``Unavailable`` for its
caller to decide. So a NATS restart under load stalls no result and no command notice."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from noetl_common import natsio
from noetl_common.errors import Unavailable

pytestmark = pytest.mark.integration


async def test_a_reconnect_ends_a_publish_without_msg_id_awaiting_its_ack(nc: NATS) -> None:
    # a plain subscriber takes the publish (a request) and never answers: the ack never comes
    subject = "noacks.test"
    silent = await nc.subscribe(subject)
    try:
        waiting = asyncio.ensure_future(natsio.publish(nc.jetstream(), subject, b"x", ack_wait=30))
        await silent.next_msg(timeout=5)  # the request reached the server and the subscriber
        assert not waiting.done()
        natsio._reconnected(nc)  # what connect()'s reconnected callback does
        with pytest.raises(Unavailable, match="reconnected"):
            await asyncio.wait_for(waiting, timeout=2)
        # the next publish waits on the new connection's signal: it is not ended by the old one
        again = asyncio.ensure_future(natsio.publish(nc.jetstream(), subject, b"y", ack_wait=0.5))
        with pytest.raises(Unavailable) as info:
            await again
        assert "reconnected" not in str(info.value)  # its own ack wait ran out
    finally:
        await silent.unsubscribe()


async def test_a_reconnect_sends_a_publish_with_msg_id_again_at_once(nc: NATS) -> None:
    # the first copy is never acked (its server is "gone"); the copy sent again is
    subject = "noacks.retry"
    seen: list[Msg] = []
    first_seen = asyncio.Event()

    async def server(msg: Msg) -> None:
        seen.append(msg)
        if len(seen) == 1:
            first_seen.set()
            return
        await msg.respond(json.dumps({"stream": "S", "seq": 7}).encode())

    sub = await nc.subscribe(subject, cb=server)
    try:
        waiting = asyncio.ensure_future(natsio.publish(nc.jetstream(), subject, b"x", msg_id="m-1", ack_wait=30))
        await asyncio.wait_for(first_seen.wait(), timeout=5)
        assert not waiting.done()
        natsio._reconnected(nc)
        ack = await asyncio.wait_for(waiting, timeout=2)  # not the 30 s ack wait
        assert ack.seq == 7
        assert len(seen) == 2
        assert {m.headers["Nats-Msg-Id"] for m in seen if m.headers} == {"m-1"}  # the same id: one copy kept
        assert [m.data for m in seen] == [b"x", b"x"]
    finally:
        await sub.unsubscribe()


async def test_reconnects_that_keep_coming_end_the_publish_after_a_bound(nc: NATS) -> None:
    subject = "noacks.flapping"
    silent = await nc.subscribe(subject)
    try:
        waiting = asyncio.ensure_future(natsio.publish(nc.jetstream(), subject, b"x", msg_id="m-2", ack_wait=30))
        for _ in range(natsio.RECONNECT_REPUBLISHES + 1):
            await silent.next_msg(timeout=5)  # each copy reached the server, then the connection "dropped"
            natsio._reconnected(nc)
        with pytest.raises(Unavailable, match="reconnected"):
            await asyncio.wait_for(waiting, timeout=2)
    finally:
        await silent.unsubscribe()
