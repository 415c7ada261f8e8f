"""Result store pieces that need no server: the SigV4 signer (AWS's published examples),
the S3 client's error translation and retries (httpx mock transport), the settings'
validation, secrets kept out of envelope context, and persist-before-emit bounds."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from noetl_common.config import ResultStoreSettings, load
from noetl_common.errors import ConfigError, NoetlError, NotFound, Unavailable
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
from noetl_store._sigv4 import EMPTY_SHA256, sign
from noetl_worker.cursor import run_cursor_slot
from noetl_worker.runner import StoreFailure, execute_command, persist_result
from noetl_worker.tools import Tools

# ---------------------------------------------------------------- SigV4 (AWS S3 documentation examples)

AWS = {"access_key": "AKIAIOSFODNN7EXAMPLE", "secret_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
       "region": "us-east-1", "now": datetime(2013, 5, 24, tzinfo=UTC)}
HOST = "examplebucket.s3.amazonaws.com"


def signature(headers: dict[str, str]) -> str:
    return headers["Authorization"].rsplit("Signature=", 1)[1]


def test_sigv4_get_object_example() -> None:
    h = sign("GET", "/test.txt", {}, {"host": HOST, "range": "bytes=0-9"}, EMPTY_SHA256, **AWS)  # type: ignore[arg-type]
    assert h["x-amz-date"] == "20130524T000000Z"
    assert h["Authorization"].startswith(
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, ")
    assert signature(h) == "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"


def test_sigv4_put_object_example() -> None:
    body = b"Welcome to Amazon S3."
    h = sign("PUT", "/test$file.text", {}, {"host": HOST, "date": "Fri, 24 May 2013 00:00:00 GMT",
                                             "x-amz-storage-class": "REDUCED_REDUNDANCY"},
             hashlib.sha256(body).hexdigest(), **AWS)  # type: ignore[arg-type]
    assert signature(h) == "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"


def test_sigv4_list_objects_example_with_query() -> None:
    h = sign("GET", "/", {"max-keys": "2", "prefix": "J"}, {"host": HOST}, EMPTY_SHA256, **AWS)  # type: ignore[arg-type]
    assert signature(h) == "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"


# ---------------------------------------------------------------- the S3 client


def client(handler: Any, attempts: int = 3) -> S3Client:
    return S3Client(S3Config("http://s3.test:9000", "bucket", "AK", "SK", attempts=attempts),
                    transport=httpx.MockTransport(handler))


async def test_s3_requests_are_signed_path_style_with_the_body_hash() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b'{"a":1}' if request.method == "GET" else b"")

    s3 = client(handler)
    await s3.put_object("r/1.json", b'{"a":1}')
    assert await s3.get_object("r/1.json") == b'{"a":1}'
    put, get = seen
    assert put.method == "PUT" and str(put.url) == "http://s3.test:9000/bucket/r/1.json"
    assert put.headers["x-amz-content-sha256"] == hashlib.sha256(b'{"a":1}').hexdigest()
    assert put.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AK/")
    assert "content-type;host;x-amz-content-sha256;x-amz-date" in put.headers["authorization"]
    assert get.headers["x-amz-content-sha256"] == EMPTY_SHA256
    assert s3.uri("r/1.json") == "s3://bucket/r/1.json" and s3.key_of("s3://bucket/r/1.json") == "r/1.json"
    with pytest.raises(ValueError):
        s3.key_of("s3://other/r/1.json")
    await s3.close()


@pytest.mark.parametrize(("status", "body", "error", "text"), [
    (404, b"<Error><Code>NoSuchKey</Code></Error>", NotFound, "NoSuchKey (HTTP 404)"),
    (403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>", AccessDenied, "SignatureDoesNotMatch"),
    (400, b"<Error><Code>InvalidArgument</Code></Error>", NoetlError, "InvalidArgument"),
    (503, b"<Error><Code>SlowDown</Code></Error>", Unavailable, "SlowDown (HTTP 503)"),
    (500, b"", Unavailable, "HTTP 500"),
])
async def test_s3_errors_are_translated_once(status: int, body: bytes, error: type[Exception], text: str) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(status, content=body)

    s3 = client(handler)
    with pytest.raises(error, match=re.escape(text)):
        await s3.get_object("k")
    assert calls == (3 if error is Unavailable else 1)  # only transient failures are retried
    await s3.close()


async def test_s3_transient_failures_are_retried() -> None:
    answers = iter([httpx.ConnectError("refused"), httpx.Response(500), httpx.Response(200, content=b"ok")])

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    s3 = client(handler)
    assert await s3.get_object("k") == b"ok"
    await s3.close()


async def test_s3_unreachable_and_timeouts_are_unavailable() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out")

    for handler, text in ((refused, "cannot reach the S3 server"), (slow, "did not answer in time")):
        s3 = client(handler, attempts=1)
        with pytest.raises(Unavailable, match=text):
            await s3.put_object("k", b"x")
        await s3.close()


# ---------------------------------------------------------------- settings


def test_result_settings_defaults_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (ResultStoreSettings().tier, ResultStoreSettings().cache) == ("db", "none")
    with pytest.raises(ConfigError, match="NOETL_RESULT_TIER=s3 needs NOETL_RESULT_S3_ENDPOINT, "
                                          "NOETL_RESULT_S3_BUCKET, NOETL_RESULT_S3_ACCESS_KEY, "
                                          "NOETL_RESULT_S3_SECRET_KEY"):
        load(ResultStoreSettings, tier="s3")
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
