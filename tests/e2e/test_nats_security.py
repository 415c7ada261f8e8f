"""NATS security against the local stack's running roles (issue 12, acceptance): NATS
speaks TLS only and knows a user per role with the permissions of ``natsperms``. A
client without credentials, with a wrong password, in plaintext or not trusting the
stack's CA cannot connect; the worker's credential cannot publish a command or an
engine-only event, cannot delete, purge or create a stream, cannot read other roles'
subjects; and the roles themselves, after real runs, never hit a permissions violation
(their permissions are sufficient) nor log a NATS password."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
from harness import Runner
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig
from waiting import until

from noetl_cli import stacknats
from noetl_common import natsio, natsperms, pools
from noetl_common.errors import ConfigError

pytestmark = pytest.mark.e2e

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello_world.yaml"
PROBE_SHARD = 424242  # no such shard: nothing of the runtime's uses these subjects
WORKERS = pools.consumer_name("default", "normal")  # a consumer the workers created


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def raw_client(runner: Runner, user: str, errors: list[str], **kw: Any) -> NATS:
    """A nats-py client as ``user`` (TLS, the stack's CA) collecting its async errors."""
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(runner.state.nats_user_url(user), name=f"test-{user}", allow_reconnect=False,
                              connect_timeout=5, tls=natsio.tls_context(runner.state.ca_file), error_cb=on_error,
                              inbox_prefix=natsio.inbox_prefix(user), **kw)


def violation(errors: list[str], kind: str, subject: str) -> Callable[[], bool]:
    # nats-py lower-cases the server's error text
    return lambda: any("permissions violation" in e.lower() and kind in e.lower() and subject.lower() in e.lower()
                       for e in errors)


def test_the_stack_runs_nats_with_tls_and_users(runner: Runner) -> None:
    state = runner.state
    assert state.nats_url.startswith("tls://") and "@" not in state.nats_url
    conf = Path(state.nats["config"])
    assert oct(conf.stat().st_mode & 0o777) == "0o600"
    text = conf.read_text()
    assert "tls {" in text and "authorization {" in text
    assert set(stacknats.passwords(state.dev_dir)) == {*natsperms.ROLES, natsperms.ADMIN}
    assert "nats" not in json.loads((state.home / "dev" / "state.json").read_text()).get("env", {})


def test_a_client_without_credentials_cannot_connect(runner: Runner) -> None:
    state = runner.state
    with pytest.raises(ConfigError, match="authorization violation"):
        run(natsio.connect(state.nats_url, name="test-anonymous", ca_file=state.ca_file))
    wrong = urlsplit(state.nats_user_url("worker"))._replace(
        netloc=f"worker:not-the-password@127.0.0.1:{state.nats['port']}").geturl()
    with pytest.raises(ConfigError, match="authorization violation") as refused:
        run(natsio.connect(wrong, name="test-wrong-password", ca_file=state.ca_file))
    assert "not-the-password" not in str(refused.value), "the error shows the password"

    async def plain_nats_py() -> None:
        await nats.connect(state.nats_url, allow_reconnect=False, connect_timeout=5,
                           tls=natsio.tls_context(state.ca_file))

    with pytest.raises(nats.errors.Error):
        run(plain_nats_py())


def test_a_plaintext_client_cannot_connect(runner: Runner) -> None:
    """Right credentials, no TLS: the server refuses (TLS required) and never answers PONG."""
    state = runner.state
    password = stacknats.passwords(state.dev_dir)["admin"]
    with socket.create_connection(("127.0.0.1", int(state.nats["port"])), timeout=5) as sock:
        info = json.loads(sock.recv(65536).decode().split(" ", 1)[1])
        assert info.get("tls_required") is True
        sock.sendall(f'CONNECT {{"user":"admin","pass":"{password}","verbose":false}}\r\nPING\r\n'.encode())
        got = b""
        try:
            while len(got) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass  # a reset connection is a refusal too
    assert b"PONG" not in got, f"a plaintext client was served: {got!r}"
    assert b"TLS Required" in got or not got, got


def test_a_client_not_trusting_the_stacks_ca_cannot_connect(runner: Runner) -> None:
    with pytest.raises(ConfigError, match="not trusted"):
        run(natsio.connect(runner.state.nats_user_url("admin"), name="test-untrusting",
                           ca_file=ssl.get_default_verify_paths().cafile or ""))


def test_the_worker_credential_cannot_publish_a_command(runner: Runner) -> None:
    async def go() -> None:
        errors: list[str] = []
        worker = await raw_client(runner, "worker", errors)
        admin = await runner.state.nats_connect("test-admin-watch")
        seen: list[str] = []

        async def on_msg(msg: Any) -> None:
            seen.append(msg.subject)

        try:
            # The credential works where it is allowed (a stream's info) ...
            info = await worker.jetstream(timeout=2).stream_info(natsio.COMMANDS_STREAM)
            before = int(info.state.last_seq)
            await admin.subscribe("noetl.commands.>", cb=on_msg)
            await admin.subscribe("noetl.events.>", cb=on_msg)
            await admin.flush()
            # ... but a command (core and JetStream) or an engine-only event kind is refused.
            command = natsio.commands_subject('default', 'normal', PROBE_SHARD)
            await worker.publish(command, b"forged")
            with pytest.raises(nats.errors.TimeoutError):
                await worker.jetstream(timeout=1).publish(command, b"forged")
            for kind in (natsio.KIND_SUBMIT, natsio.KIND_CANCEL, natsio.KIND_EXPIRED, natsio.KIND_BARRIER):
                await worker.publish(natsio.events_subject(PROBE_SHARD, kind), b"forged")
            await worker.flush()
            await until(violation(errors, "publish", command), timeout=10, what="the command's permissions violation")
            for kind in (natsio.KIND_SUBMIT, natsio.KIND_CANCEL, natsio.KIND_EXPIRED, natsio.KIND_BARRIER):
                await until(violation(errors, "publish", natsio.events_subject(PROBE_SHARD, kind)), timeout=10,
                            what=f"the {kind} event's permissions violation")
            await admin.flush()
            assert seen == [], f"the worker's forged messages were routed: {seen}"
            after = int((await admin.jetstream().stream_info(natsio.COMMANDS_STREAM)).state.last_seq)
            assert after == before, "a message landed in the commands stream"
        finally:
            await worker.close()
            await admin.close()

    run(go())


def test_the_worker_credential_cannot_manage_streams_or_read_other_roles_subjects(runner: Runner) -> None:
    async def go() -> None:
        errors: list[str] = []
        worker = await raw_client(runner, "worker", errors)
        admin = await runner.state.nats_connect("test-admin-check")
        try:
            js = worker.jetstream(timeout=1)
            api = "$JS.API"
            attempts: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                (f"{api}.STREAM.DELETE.{natsio.COMMANDS_STREAM}", lambda: js.delete_stream(natsio.COMMANDS_STREAM)),
                (f"{api}.STREAM.PURGE.{natsio.EVENTS_STREAM}", lambda: js.purge_stream(natsio.EVENTS_STREAM)),
                (f"{api}.STREAM.CREATE.SNEAKY", lambda: js.add_stream(StreamConfig(name="SNEAKY",
                                                                                  subjects=["sneaky.>"]))),
                (f"{api}.STREAM.UPDATE.{natsio.EVENTS_STREAM}",
                 lambda: js.update_stream(StreamConfig(name=natsio.EVENTS_STREAM, subjects=["noetl.events.>"],
                                                       max_msgs=1))),
                (f"{api}.STREAM.CREATE.KV_noetl_results",
                 lambda: js.add_stream(StreamConfig(name="KV_noetl_results", subjects=["$KV.noetl_results.>"]))),
                (f"{api}.CONSUMER.DELETE.{natsio.COMMANDS_STREAM}.{WORKERS}",
                 lambda: js.delete_consumer(natsio.COMMANDS_STREAM, WORKERS)),
            ]
            for subject, attempt in attempts:
                with pytest.raises(nats.errors.TimeoutError):
                    await attempt()
                await until(violation(errors, "publish", subject), timeout=10, what=f"the violation on {subject}")
            # Subscriptions outside its own: events, other roles' replies and hints.
            for subject in ("noetl.events.>", "noetl.commands.>", "_INBOX.api.>", "_INBOX.>",
                            natsio.progress_subject(1), natsio.projector_subject(0)):
                await worker.subscribe(subject)
                await worker.flush()
                await until(violation(errors, "subscription", subject),
                            timeout=10, what=f"the violation on {subject}")
            # Nothing changed: both streams are there, the workers' consumer too.
            ajs = admin.jetstream()
            for name in (natsio.EVENTS_STREAM, natsio.COMMANDS_STREAM):
                await ajs.stream_info(name)
            await ajs.consumer_info(natsio.COMMANDS_STREAM, WORKERS)
            assert "SNEAKY" not in [s.config.name for s in await ajs.streams_info()]
        finally:
            await worker.close()
            await admin.close()

    run(go())


def test_the_roles_need_nothing_their_permissions_refuse_and_never_log_a_password(runner: Runner) -> None:
    """Runs complete (the rest of the suite runs everything else), and no role's log shows a
    permissions violation or any NATS password."""
    for _ in range(2):
        out = runner.wait(runner.submit(HELLO.read_text()).execution_id, 60)
        assert out.status == "COMPLETED"
    state = runner.state
    passwords = list(stacknats.passwords(state.dev_dir).values())
    assert len(passwords) == len(natsperms.ROLES) + 1
    for log in sorted(state.log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        hits = [line for line in text.splitlines() if "permissions violation" in line.lower()]
        assert not hits, f"{log.name}: {hits[:3]}"
        assert not any(p in text for p in passwords), f"{log.name} shows a NATS password"
