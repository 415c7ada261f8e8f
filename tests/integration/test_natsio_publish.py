"""``natsio.publish`` against a real NATS server: a publish whose ack is still awaited when
the client re-establishes its connection ends at once with ``Unavailable`` (the server that
was to answer is gone; the caller publishes again, the same Msg-Id keeps one copy), not
after its ack wait, so a NATS restart under load stalls no result for the ack wait."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS

from noetl_common import natsio
from noetl_common.errors import Unavailable

pytestmark = pytest.mark.integration


async def test_a_reconnect_ends_a_publish_awaiting_its_ack(nc: NATS) -> None:
    # a plain subscriber takes the publish (a request) and never answers: the ack never comes
    subject = "noacks.test"
    silent = await nc.subscribe(subject)
    try:
        waiting = asyncio.ensure_future(natsio.publish(nc.jetstream(), subject, b"x", msg_id="m-1", ack_wait=30))
        await silent.next_msg(timeout=5)  # the request reached the server and the subscriber
        assert not waiting.done()
        natsio._reconnected(nc)  # what connect()'s reconnected callback does
        with pytest.raises(Unavailable, match="reconnected"):
            await asyncio.wait_for(waiting, timeout=2)
        # the next publish waits on the new connection's signal: it is not ended by the old one
        again = asyncio.ensure_future(natsio.publish(nc.jetstream(), subject, b"y", msg_id="m-2", ack_wait=0.5))
        with pytest.raises(Unavailable) as info:
            await again
        assert "reconnected" not in str(info.value)  # its own ack wait ran out
    finally:
        await silent.unsubscribe()

