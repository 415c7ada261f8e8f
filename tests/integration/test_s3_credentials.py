"""The S3 client against a real S3-protocol server (SeaweedFS, SigV4 enforced, started by
the tests): where its credentials come from, and how the server's answers become the
store's errors.

* No static keys configured: the library's default credential chain is used, here its
  first link (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``), by the client and by the
  store the factory builds; static keys, when configured, win over the environment.
* Wrong keys -> AccessDenied (a ConfigError naming the credentials at start), a missing
  object or bucket -> NotFound, an endpoint that is down -> Unavailable; only the last is
  transient.
* A bucket is created (again: fine) and headed through URLs the library presigns.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import pytest

from noetl_cli.localstack import S3Server
from noetl_common.config import ResultStoreSettings
from noetl_common.db import Pool
from noetl_common.errors import ConfigError, NotFound, Unavailable
from noetl_common.retry import is_transient
from noetl_store import S3Client, S3Config, make_result_store
from noetl_store._s3 import AccessDenied

pytestmark = pytest.mark.integration

BUCKET = "noetl-test"  # created by the s3_server fixture (tests/conftest.py)
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No AWS_* variable of the machine's environment reaches the client, and the chain's
    last link (the instance metadata service) is a loopback address: never called out to."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.2:9")
    yield monkeypatch


def key() -> str:
    return f"creds/{uuid.uuid4().hex}.json"


async def test_without_static_keys_the_default_chain_is_used(s3_server: S3Server, pool: Pool,
                                                             aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    s3 = S3Client(S3Config(s3_server.endpoint, BUCKET))
    assert not s3.config.static_keys
    await s3.head_bucket()
    k = key()
    await s3.put_object(k, b'{"chain": 1}')
    assert await s3.get_object(k) == b'{"chain": 1}'
    assert await s3.head_object(k) == len(b'{"chain": 1}')
    await s3.close()

    settings = ResultStoreSettings(tier="s3", s3_endpoint=s3_server.endpoint, s3_bucket=BUCKET,
                                   s3_prefix=f"chain-{uuid.uuid4().hex[:8]}/")
    store = await make_result_store(settings, pool)
    ref = await store.put({"chain": True}, execution_id=7_000_000_170, step="s", command_id="c", task="t",
                          parent_ref_id=None)
    assert ref.type == "s3" and await store.get(ref.ref_id) == {"chain": True}
    await store.close()

    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match=r"the default AWS credential chain .* refused them"):
        await make_result_store(settings, pool)


async def test_static_keys_win_over_the_environment(s3_server: S3Server, aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", "somebody-else")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "their-secret")
    s3 = S3Client(S3Config(s3_server.endpoint, BUCKET, s3_server.access_key, s3_server.secret_key))
    k = key()
    await s3.put_object(k, b"[1]")
    assert await s3.get_object(k) == b"[1]"
    await s3.close()


async def test_refused_credentials_are_access_denied(s3_server: S3Server, aws_env: pytest.MonkeyPatch) -> None:
    good = S3Client(S3Config(s3_server.endpoint, BUCKET, s3_server.access_key, s3_server.secret_key))
    k = key()
    await good.put_object(k, b"{}")
    for access_key, secret_key in ((s3_server.access_key, "wrong-secret"), ("nobody", "x")):
        wrong = S3Client(S3Config(s3_server.endpoint, BUCKET, access_key, secret_key))
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "put": partial(wrong.put_object, key(), b"{}"), "get": partial(wrong.get_object, k),
            "head": partial(wrong.head_object, k), "bucket": wrong.head_bucket}
        for what, call in calls.items():
            with pytest.raises(AccessDenied) as raised:
                await call()
            assert not is_transient(raised.value), (what, raised.value)
            assert "HTTP 403" in str(raised.value) or "HTTP 401" in str(raised.value), (what, raised.value)
        await wrong.close()
    await good.close()


async def test_missing_objects_and_buckets_are_not_found(s3_server: S3Server) -> None:
    s3 = S3Client(S3Config(s3_server.endpoint, BUCKET, s3_server.access_key, s3_server.secret_key))
    for call in (s3.get_object, s3.head_object):
        started = time.monotonic()
        with pytest.raises(NotFound) as raised:
            await call(key())
        assert not is_transient(raised.value) and "HTTP 404" in str(raised.value)
        assert time.monotonic() - started < 2  # not retried
    with pytest.raises(NotFound, match="NoSuchKey"):
        await s3.get_object(key())
    await s3.close()
    elsewhere = S3Client(S3Config(s3_server.endpoint, f"no-such-{uuid.uuid4().hex[:8]}", s3_server.access_key,
                                  s3_server.secret_key))
    with pytest.raises(NotFound):
        await elsewhere.head_bucket()
    with pytest.raises(NotFound, match="NoSuchBucket"):
        await elsewhere.get_object("k")
    await elsewhere.close()


async def test_an_endpoint_that_is_down_is_unavailable(s3_server: S3Server) -> None:
    dead = S3Client(S3Config(DEAD_ENDPOINT, BUCKET, "ak", "sk", attempts=2, connect_timeout_sec=1.0))
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: dead.put_object(key(), b"{}"), lambda: dead.get_object(key()), lambda: dead.head_object(key()),
        dead.head_bucket]
    for call in calls:
        with pytest.raises(Unavailable, match=re.escape("cannot reach the S3 server at http://127.0.0.1:9")) as raised:
            await call()
        assert is_transient(raised.value)
    await dead.close()


async def test_buckets_are_created_and_headed(s3_server: S3Server) -> None:
    name = f"made-{uuid.uuid4().hex[:8]}"
    s3 = S3Client(S3Config(s3_server.endpoint, name, s3_server.access_key, s3_server.secret_key))
    await s3.create_bucket()
    await s3.create_bucket()  # already ours: fine
    await s3.head_bucket()
    await s3.put_object("k.json", b"1")
    assert await s3.get_object("k.json") == b"1"
    await s3.close()


async def test_no_credentials_anywhere_is_a_config_error_at_start(s3_server: S3Server, pool: Pool,
                                                                   aws_env: pytest.MonkeyPatch) -> None:
    """No static keys and no link of the chain answers (the metadata service is a dead
    loopback address): a role refuses to start naming every place it looked; while running,
    the same failure is transient (the metadata service may come back)."""
    settings = ResultStoreSettings(tier="s3", s3_endpoint=s3_server.endpoint, s3_bucket=BUCKET, s3_attempts=1)
    with pytest.raises(ConfigError, match=r"S3 credentials: NOETL_RESULT_S3_ACCESS_KEY .* unset .* "
                                          r"AWS_WEB_IDENTITY_TOKEN_FILE .* getting credentials"):
        await make_result_store(settings, pool)
    s3 = S3Client(S3Config(s3_server.endpoint, BUCKET, attempts=1))
    with pytest.raises(Unavailable, match=re.escape("getting credentials: cannot reach http://127.0.0.2:9")) as raised:
        await s3.put_object(key(), b"{}")
    assert is_transient(raised.value)
    await s3.close()
