"""Result store pieces that need no real store: the S3 client's signing, error translation
and retries (against a scripted loopback HTTP server), the settings' validation, secrets
kept out of envelope context, and persist-before-emit bounds."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
from typing import Any

import pytest

from noetl_common.config import ResultStoreSettings, load
from noetl_common.errors import ConfigError, NoetlError, NotFound, Unavailable
from noetl_common.retry import is_transient
from noetl_proto.v1 import common_pb2, messages_pb2
from noetl_store import (
    MemoryResultStore,
    S3Client,
    S3Config,
    context_of,
    envelope,
    envelope_from_proto,
    is_secret_key,
)
from noetl_store._s3 import AccessDenied
from noetl_worker.cursor import run_cursor_slot
from noetl_worker.runner import StoreFailure, execute_command, persist_result
from noetl_worker.tools import Tools

# ---------------------------------------------------------------- the S3 client over a scripted server


class ScriptedS3:
    """A loopback HTTP/1.1 server that answers every request with the next scripted
    ``(status, body)`` (the last one repeats; status None: never answer), recording each
    request: how the client signs, retries and translates what an S3 server can answer
    that SeaweedFS cannot be made to (5xx, 429, a hang). The S3 behaviour itself is tested
    against SeaweedFS (tests/integration/test_result_store.py, test_s3_credentials.py)."""

    def __init__(self, *answers: tuple[int | None, bytes], routes: dict[str, bytes] | None = None) -> None:
        self.answers = list(answers)
        self.routes = routes or {}  # path -> a 200 body, answered before the script
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> ScriptedS3:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:] if h)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append((method, target, headers))
                path = target.split("?", 1)[0]
                if path in self.routes:
                    status, body = 200, self.routes[path]
                else:
                    status, body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
                if status is None:
                    await asyncio.Event().wait()
                writer.write(f"HTTP/1.1 {status} S\r\ncontent-type: application/xml\r\netag: \"e\"\r\n"
                             "last-modified: Tue, 24 Nov 2026 00:00:00 GMT\r\n"
                             f"content-length: {len(body)}\r\n\r\n".encode() + (b"" if method == "HEAD" else body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def client(endpoint: str, attempts: int = 3, timeout: float = 10.0) -> S3Client:
    return S3Client(S3Config(endpoint, "bucket", "AK", "SK", attempts=attempts, timeout_sec=timeout,
                             connect_timeout_sec=1.0))


async def test_s3_requests_are_signed_path_style_with_the_body_hash() -> None:
    async with ScriptedS3((200, b'{"a":1}')) as server:
        s3 = client(server.endpoint)
        await s3.put_object("r/1.json", b'{"a":1}')
        assert await s3.get_object("r/1.json") == b'{"a":1}'
        await s3.close()
    (put_method, put_path, put), (get_method, get_path, _) = server.requests
    assert (put_method, put_path, get_method, get_path) == ("PUT", "/bucket/r/1.json", "GET", "/bucket/r/1.json")
    assert put["x-amz-content-sha256"] == hashlib.sha256(b'{"a":1}').hexdigest()
    assert put["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AK/")
    assert put["content-type"] == "application/json"
    assert s3.uri("r/1.json") == "s3://bucket/r/1.json" and s3.key_of("s3://bucket/r/1.json") == "r/1.json"
    with pytest.raises(ValueError):
        s3.key_of("s3://other/r/1.json")


@pytest.mark.parametrize(("status", "body", "error", "text"), [
    (404, b"<Error><Code>NoSuchKey</Code></Error>", NotFound, "(HTTP 404)"),
    (403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>", AccessDenied, "SignatureDoesNotMatch (HTTP 403)"),
    (401, b"", AccessDenied, "HTTP 401"),
    (400, b"<Error><Code>InvalidArgument</Code></Error>", NoetlError, "InvalidArgument (HTTP 400)"),
    (503, b"<Error><Code>SlowDown</Code></Error>", Unavailable, "SlowDown (HTTP 503)"),
    (429, b"", Unavailable, "HTTP 429"),
    (500, b"", Unavailable, "HTTP 500"),
])
async def test_s3_errors_are_translated_once(status: int, body: bytes, error: type[Exception], text: str) -> None:
    async with ScriptedS3((status, body)) as server:
        s3 = client(server.endpoint)
        with pytest.raises(error, match=re.escape(text)) as raised:
            await s3.get_object("k")
        if error is NoetlError:
            assert type(raised.value) is NoetlError
        assert not is_transient(raised.value) or error is Unavailable
        await s3.close()
    assert len(server.requests) == (3 if error is Unavailable else 1)  # only transient failures are retried


async def test_s3_transient_failures_are_retried() -> None:
    async with ScriptedS3((503, b"<Error><Code>SlowDown</Code></Error>"), (500, b""), (200, b"ok")) as server:
        s3 = client(server.endpoint)
        assert await s3.get_object("k") == b"ok"
        await s3.close()
    assert len(server.requests) == 3


async def test_s3_unreachable_and_timeouts_are_unavailable() -> None:
    s3 = client("http://127.0.0.1:9", attempts=1)  # discard port: nothing listens
    with pytest.raises(Unavailable, match=re.escape("cannot reach the S3 server at http://127.0.0.1:9")):
        await s3.put_object("k", b"x")
    await s3.close()
    async with ScriptedS3((None, b"")) as server:
        s3 = client(server.endpoint, attempts=1, timeout=0.5)
        started = time.monotonic()
        with pytest.raises(Unavailable, match="did not answer in time"):
            await s3.get_object("k")
        assert time.monotonic() - started < 5
        await s3.close()


CREDENTIALS = {"AccessKeyId": "{key}", "SecretAccessKey": "secret", "Token": "session-{key}",
               "Expiration": "2099-01-01T00:00:00Z"}
NOWHERE = "http://127.0.0.2:9"  # a loopback address where nothing listens


def credentials(key: str) -> bytes:
    return json.dumps({"Code": "Success", **{k: v.format(key=key) for k, v in CREDENTIALS.items()}}).encode()


def no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS_* variable of the machine reaches the client, and the chain's last link (the
    instance metadata service) points at the loopback: a test never calls out."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", NOWHERE)


@pytest.mark.parametrize("source", ["static", "env", "container", "instance profile"])
async def test_s3_credentials_come_from_the_default_chain_without_static_keys(
        source: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Providers of the chain served by a loopback stand-in for the AWS endpoint they call
    (the EKS Pod Identity agent, the instance metadata service); the S3 request is signed
    with what they returned, session token included. Web identity (IRSA) is not here:
    obstore 0.12.1 calls STS at sts.<region>.amazonaws.com, which no setting moves. (Real
    keys from the environment against SeaweedFS: tests/integration/test_s3_credentials.py.)"""
    no_aws_environment(monkeypatch)
    routes = {"/container": credentials("CONTAINERKEY"), "/latest/api/token": b"imds-token",
              "/latest/meta-data/iam/security-credentials/": b"noetl-role",
              "/latest/meta-data/iam/security-credentials/noetl-role": credentials("IMDSKEY")}
    async with ScriptedS3((200, b"ok"), routes=routes) as server:
        if source == "env":
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENVKEY")
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
        elif source == "container":
            (tmp_path / "token").write_text("pod-identity-token")
            monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", server.endpoint + "/container")
            monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(tmp_path / "token"))
        elif source == "instance profile":
            monkeypatch.setenv("AWS_METADATA_ENDPOINT", server.endpoint)
        keys = ("AK", "SK") if source == "static" else ("", "")
        s3 = S3Client(S3Config(server.endpoint, "bucket", *keys))
        assert await s3.get_object("k") == b"ok"
        await s3.close()
    (_, _, headers), = [r for r in server.requests if r[1].startswith("/bucket/")]
    key = {"static": "AK", "env": "ENVKEY", "container": "CONTAINERKEY", "instance profile": "IMDSKEY"}[source]
    assert headers["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={key}/"), headers
    assert headers.get("x-amz-security-token") == (None if source in ("static", "env") else f"session-{key}")
    if source == "container":
        (_, _, asked), = [r for r in server.requests if r[1] == "/container"]
        assert asked["authorization"] == "pod-identity-token"


async def test_s3_credentials_that_cannot_be_had_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """No keys anywhere: the chain ends at the instance metadata service; when that does
    not answer, the request is Unavailable naming it (not the S3 server)."""
    no_aws_environment(monkeypatch)
    s3 = S3Client(S3Config("http://127.0.0.1:9", "bucket", attempts=1))
    with pytest.raises(Unavailable, match=re.escape(f"getting credentials: cannot reach {NOWHERE}/")):
        await s3.get_object("k")
    await s3.close()


# ---------------------------------------------------------------- settings


def test_result_settings_defaults_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (ResultStoreSettings().tier, ResultStoreSettings().cache) == ("db", "none")
    with pytest.raises(ConfigError, match="NOETL_RESULT_TIER=s3 needs NOETL_RESULT_S3_ENDPOINT, "
                                          "NOETL_RESULT_S3_BUCKET") as missing:
        load(ResultStoreSettings, tier="s3")
    assert "ACCESS_KEY" not in str(missing.value)  # keys are optional
    with pytest.raises(ConfigError, match="go together"):
        load(ResultStoreSettings, tier="s3", s3_endpoint="http://minio:9000", s3_bucket="b", s3_access_key="a")
    # no keys: the default credential chain
    keyless = load(ResultStoreSettings, tier="s3", s3_endpoint="http://minio:9000", s3_bucket="b")
    assert (keyless.s3_access_key, keyless.s3_secret_key.get_secret_value()) == ("", "")
    with pytest.raises(ConfigError, match="NOETL_RESULT_TIER"):
        load(ResultStoreSettings, tier="tape")
    with pytest.raises(ConfigError, match="must be an http"):
        load(ResultStoreSettings, tier="s3", s3_endpoint="minio:9000", s3_bucket="b", s3_access_key="a",
             s3_secret_key="s")
    monkeypatch.setenv("NOETL_RESULT_TIER", "s3")
    monkeypatch.setenv("NOETL_RESULT_CACHE", "kv")
    monkeypatch.setenv("NOETL_RESULT_S3_ENDPOINT", "http://127.0.0.1:9000")
    monkeypatch.setenv("NOETL_RESULT_S3_BUCKET", "results")
    monkeypatch.setenv("NOETL_RESULT_S3_ACCESS_KEY", "ak")
    monkeypatch.setenv("NOETL_RESULT_S3_SECRET_KEY", "sk")
    monkeypatch.setenv("NOETL_RESULT_S3_PREFIX", "runtime")
    s = load(ResultStoreSettings)
    assert (s.tier, s.cache, s.s3_prefix, s.s3_configured) == ("s3", "kv", "runtime/", True)
    assert "sk" not in repr(s)  # the secret key is a SecretStr


# ---------------------------------------------------------------- secrets never reach context


def test_credential_shaped_keys_never_reach_the_context() -> None:
    value = {"rowcount": 3, "status": "ok", "password": "p", "DB_Password": "p", "passwd": "p", "secret": "s",
             "client_secret": "s", "token": "t", "access_token": "t", "next_page_token": "t", "api_key": "k",
             "ApiKey": "k", "Authorization": "Bearer x", "auth": "a", "basic_auth": "a", "credential": "c",
             "credentials": "c", "private_key": "k", "PRIVATE-KEY": "k", "dsn": "postgres://u:p@h/db",
             "pg_dsn": "d", "cookie": "c"}
    assert context_of(value) == {"rowcount": 3, "status": "ok"}
    env = envelope("ok", None, None, value)
    assert set(env["context"]) == {"rowcount", "status"}
    for key in ("password", "X-Api-Key", "sessionToken", "AWS_SECRET_ACCESS_KEY", "Dsn"):
        assert is_secret_key(key), key
    for key in ("rowcount", "status", "rows", "total", "next_page"):
        assert not is_secret_key(key), key


def test_the_engine_drops_secrets_a_foreign_worker_put_in_context() -> None:
    pb = common_pb2.ResultEnvelope(status="ok", context_json=json.dumps({"n": 1, "password": "hunter2",
                                                                         "Api_Key": "k"}))
    assert envelope_from_proto(pb)["context"] == {"n": 1}


# ---------------------------------------------------------------- persist-before-emit bounds


class HangingStore(MemoryResultStore):
    async def put(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()


def command(spec: dict[str, Any], kind: str = "python", context: dict[str, Any] | None = None
            ) -> messages_pb2.Command:
    ctx = {"execution_id": 5, "workload": {}, "ctx": {}, "steps": {}, "known_steps": [], "event": {},
           "iter": None, **(context or {})}
    return messages_pb2.Command(command_id="5:s:1", execution_id=5, shard_id=0, step="s", attempt=1, kind=kind,
                                spec_json=json.dumps(spec), context_json=json.dumps(ctx))


async def test_persist_result_is_bounded_in_time() -> None:
    """Each attempt is bounded, and so are the retries of a store that does not answer."""
    started = time.monotonic()
    with pytest.raises(StoreFailure, match=r"did not answer within 0\.05s"):
        await persist_result(HangingStore(), {"x": 1}, command=command({}), task="t", parent_ref_id=None,
                             limit_sec=0.05, retry_sec=0.3)
    assert time.monotonic() - started < 5
    # a value the store refuses is not an outage: no retry
    started = time.monotonic()
    with pytest.raises(StoreFailure, match="not JSON serialisable"):
        await persist_result(MemoryResultStore(), {"x": object()}, command=command({}), task="t",
                             parent_ref_id=None)
    assert time.monotonic() - started < 1


class FlakyStore(MemoryResultStore):
    """Unreachable for its first ``failures`` puts (an outage), then a normal store."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.attempts = 0

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise Unavailable("postgres unavailable: connection refused")
        return await super().put(*args, **kwargs)


async def test_an_outage_of_the_store_is_waited_out_not_reported() -> None:
    """A store that is down for a while (a Postgres restart) costs time, not a task error:
    the result is stored once it answers again, and the task is not run again."""
    store = FlakyStore(failures=3)
    ref = await persist_result(store, {"x": 1}, command=command({}), task="t", parent_ref_id=None)
    assert store.attempts == 4 and await store.get(ref.ref_id) == {"x": 1}
    spec = {"step": "s", "tool": {"kind": "noop"}}
    result = await execute_command(command(spec, "noop"), FlakyStore(failures=2), Tools())
    assert envelope_from_proto(result.envelope)["status"] == "ok"


async def test_a_hanging_store_is_reference_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """... once the outage outlasts the retries (INFRA_RETRY_SEC)."""
    import noetl_worker.runner as runner

    monkeypatch.setattr(runner, "PERSIST_TIMEOUT_SEC", 0.05)
    monkeypatch.setattr(runner, "INFRA_RETRY_SEC", 0.3)
    spec = {"step": "s", "tool": {"kind": "noop"}}
    result = await asyncio.wait_for(execute_command(command(spec, "noop"), HangingStore(), Tools()), timeout=5)
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "error" and env["reference"] is None
    assert env["error"]["code"] == "REFERENCE_NOT_AVAILABLE" and "did not answer" in env["error"]["message"]


async def test_a_cursor_slot_persists_through_the_same_function(monkeypatch: pytest.MonkeyPatch) -> None:
    import noetl_worker.runner as runner

    monkeypatch.setattr(runner, "PERSIST_TIMEOUT_SEC", 0.05)
    monkeypatch.setattr(runner, "INFRA_RETRY_SEC", 0.3)
    from noetl_worker.cursor_drivers import CursorDrivers

    class NoRows:
        async def open(self, spec: Any, secrets: Any = None) -> Any:
            from contextlib import asynccontextmanager

            class Driver:
                @asynccontextmanager
                async def claim(self, statement: str) -> Any:
                    yield None

            return Driver()

        async def close(self) -> None:
            return None

    tools = Tools(cursors=NoRows())  # type: ignore[arg-type]
    assert CursorDrivers  # the real registry has the same interface
    spec = {"step": "s", "tool": [{"kind": "noop", "name": "n"}]}
    ctx = {"cursor": {"kind": "postgres", "auth": "pg", "claim": "SELECT 1"}, "loop": {"iterator": "row"}}
    result = await asyncio.wait_for(run_cursor_slot(command(spec, "cursor", ctx), HangingStore(), tools), timeout=5)
    env = envelope_from_proto(result.envelope)
    assert env["error"]["code"] == "REFERENCE_NOT_AVAILABLE" and "did not answer" in env["error"]["message"]
