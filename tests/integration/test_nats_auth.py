"""A real nats-server with the local stack's security (stacknats.py: TLS, a user per role
with ``natsperms``' permissions), exercised at the client level: each role can do what
the runtime does with NATS (the api creates the streams, its ordered consumer reads the
events, a worker pulls and acks commands, publishes a result, uses the result KV), the
authorization block ``noetl-rt nats-config`` prints is a valid nats-server configuration,
and a refused connection is a ``ConfigError`` that names the cause and hides the password."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType

from noetl_cli import localstack, stackcerts, stacknats
from noetl_common import natsio, natsperms, pools
from noetl_common.errors import ConfigError

pytestmark = pytest.mark.integration


class Secured:
    def __init__(self, dev: Path, server: localstack.NatsServer) -> None:
        self.dev, self.server = dev, server
        self.ca = str(stackcerts.paths(dev)["ca"])

    def url(self, user: str) -> str:
        return stacknats.user_url(self.server.url, self.dev, user)

    async def connect(self, user: str) -> NATS:
        role = user if user in natsperms.ROLES else ""
        return await natsio.connect(self.url(user), name=f"test-{user}", role=role, ca_file=self.ca)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    dev = tmp_path_factory.mktemp("secured-nats")
    server = stacknats.start(dev)
    try:
        yield Secured(dev, server)
    finally:
        server.stop()


async def test_each_role_can_do_what_the_runtime_does(secured: Secured) -> None:
    api, worker = await secured.connect("api"), await secured.connect("worker")
    try:
        ajs, wjs = api.jetstream(timeout=3), worker.jetstream(timeout=3)
        # the worker waits for the streams; the api creates them (and the workers' consumer)
        with pytest.raises(Exception, match="does not exist"):
            await natsio.ensure_streams(wjs, manage=False)
        await natsio.ensure_streams(ajs)
        await natsio.ensure_streams(wjs, manage=False)
        # the engine's ordered consumer on a shard's events
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_event(msg: object) -> None:
            await got.put(msg.data)  # type: ignore[attr-defined]

        sub = await ajs.subscribe(natsio.events_filter(5), ordered_consumer=True, cb=on_event)
        # the engine publishes a command; a worker pulls it, acks it, publishes its result
        await natsio.ensure_pool_consumers(wjs, "default")  # the worker creates its pool's consumers
        await natsio.publish(ajs, natsio.commands_subject("default", "normal", 5), b"command", msg_id="c1")
        pull = await wjs.pull_subscribe_bind(durable=pools.consumer_name("default", "normal"),
                                             stream=natsio.COMMANDS_STREAM)
        msgs = await pull.fetch(1, timeout=5)
        assert [m.data for m in msgs] == [b"command"]
        await msgs[0].ack_sync(timeout=3)
        await natsio.publish(wjs, natsio.events_subject(5, natsio.KIND_CALL), b"result", msg_id="r1")
        assert await asyncio.wait_for(got.get(), 10) == b"result"
        await sub.unsubscribe()
        # the result KV: the api creates the bucket, the worker reads and writes it
        with pytest.raises(Exception):  # noqa: B017 - a refused request times out
            await wjs.create_key_value(KeyValueConfig(bucket=natsperms.DEFAULT_KV_BUCKET, history=1,
                                                      storage=StorageType.MEMORY))
        await ajs.create_key_value(KeyValueConfig(bucket=natsperms.DEFAULT_KV_BUCKET, history=1,
                                                  storage=StorageType.MEMORY))
        wkv = await wjs.key_value(natsperms.DEFAULT_KV_BUCKET)
        await wkv.put("7", b"value")
        assert (await wkv.get("7")).value == b"value"
        akv = await ajs.key_value(natsperms.DEFAULT_KV_BUCKET)
        assert (await akv.get("7")).value == b"value"
    finally:
        await api.close()
        await worker.close()


async def test_hint_roles(secured: Secured) -> None:
    api, projector, checkpointer = [await secured.connect(r) for r in ("api", "projector", "checkpointer")]
    try:
        seen: asyncio.Queue[str] = asyncio.Queue()

        async def on_hint(msg: object) -> None:
            await seen.put(msg.subject)  # type: ignore[attr-defined]

        await projector.subscribe(natsio.projector_subject(2), cb=on_hint)
        await checkpointer.subscribe(natsio.checkpointer_subject(2), cb=on_hint)
        await api.subscribe(natsio.progress_subject(99), cb=on_hint)
        for c in (projector, checkpointer, api):
            await c.flush()
        await natsio.hint(api, natsio.projector_subject(2))
        await natsio.hint(projector, natsio.checkpointer_subject(2))
        await natsio.hint(projector, natsio.progress_subject(99))
        got = {await asyncio.wait_for(seen.get(), 5) for _ in range(3)}
        assert got == {natsio.projector_subject(2), natsio.checkpointer_subject(2), natsio.progress_subject(99)}
    finally:
        for c in (api, projector, checkpointer):
            await c.close()


async def test_a_handoff_reaches_the_worker_and_a_refused_subscription_is_known(secured: Secured) -> None:
    """The api sends a worker its handoffs; a role whose user may not read them learns so
    when it subscribes (``subscribe_permitted``: None), not by waiting for what never comes."""
    api, worker, projector = [await secured.connect(r) for r in ("api", "worker", "projector")]
    try:
        seen: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_handoff(msg: object) -> None:
            await seen.put(msg.data)  # type: ignore[attr-defined]

        subject = natsio.handoff_subject("worker-7")
        assert await natsio.subscribe_permitted(worker, subject, on_handoff) is not None
        assert await natsio.subscribe_permitted(projector, subject, on_handoff) is None
        assert natsio.refused(projector, subject) and not natsio.refused(worker, subject)
        await natsio.send(api, subject, b"command")
        assert await asyncio.wait_for(seen.get(), 5) == b"command"
        await asyncio.sleep(0.2)  # the refused subscription got nothing
        assert seen.empty()
    finally:
        for c in (api, worker, projector):
            await c.close()


async def test_a_refused_connection_names_the_cause_and_hides_the_password(secured: Secured) -> None:
    wrong = secured.url("worker").replace(stacknats.passwords(secured.dev)["worker"], "WRONGPASS")
    with pytest.raises(ConfigError, match="authorization violation") as refused:
        await natsio.connect(wrong, name="test-wrong", ca_file=secured.ca)
    assert "WRONGPASS" not in str(refused.value) and "***" in str(refused.value)
    with pytest.raises(ConfigError, match="authorization violation"):
        await natsio.connect(secured.server.url, name="test-anonymous", ca_file=secured.ca)


def test_the_printed_authorization_block_is_a_valid_server_config(tmp_path: Path) -> None:
    conf = tmp_path / "auth.conf"
    conf.write_text(natsperms.authorization_block() + "jetstream {}\n")
    env = {f"NOETL_NATS_PASSWORD_{u.upper()}": f"pw-{u}" for u in (*natsperms.ROLES, natsperms.ADMIN)}
    out = subprocess.run([localstack.nats_server_binary(), "-t", "-c", str(conf)], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


async def test_a_client_with_a_ca_refuses_a_server_that_does_not_require_tls(
        secured: Secured, tmp_path: Path) -> None:
    plain = localstack.start_nats(tmp_path / "plain")
    try:
        with pytest.raises(ConfigError, match="does not require TLS"):
            await natsio.connect(plain.url, name="test-downgrade", ca_file=secured.ca)
        with pytest.raises(ConfigError, match="does not require TLS"):
            await natsio.connect(plain.url.replace("nats://", "tls://"), name="test-downgrade-url")
    finally:
        plain.stop()
