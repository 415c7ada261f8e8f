"""Redaction by value (noetl_common.redact): the forms a secret takes, what of a stored
credential is secret, and the log filter."""

from __future__ import annotations

import base64
import io
import json
import logging

import pytest

from noetl_common.redact import (
    MASK,
    ActiveSecrets,
    LogFilter,
    Redactor,
    is_secret_key,
    mask_secret_keys,
    secret_values,
)

SECRET = 'p@ss "w0rd"/x'


def test_every_form_of_a_secret_is_masked() -> None:
    r = Redactor([SECRET])
    assert r.text(f"failed with {SECRET} twice: {SECRET}") == f"failed with {MASK} twice: {MASK}"
    assert SECRET not in r.text(json.dumps({"password": SECRET}))  # JSON-escaped
    assert "p%40ss" not in r.text("postgresql://u:p%40ss%20%22w0rd%22%2Fx@h/db")  # percent-encoded
    assert r.value({"a": [SECRET, {SECRET: 1}], "n": 3}) == {"a": [MASK, {MASK: 1}], "n": 3}
    assert r.text("nothing here") == "nothing here"


def test_longest_first_and_short_values_ignored() -> None:
    r = Redactor(["abcd", "abcdefgh", "xyz", "", None])  # type: ignore[list-item]
    assert r.text("abcdefgh abcd xyz") == f"{MASK} {MASK} xyz"
    assert not Redactor(["abc"]) and repr(r).startswith("Redactor(")


def test_what_of_a_credential_is_secret() -> None:
    pg = secret_values("postgres", {"dsn": "host=db user=app password=s3cret-pw dbname=app"})
    assert {"host=db user=app password=s3cret-pw dbname=app", "s3cret-pw"} <= pg
    assert "app" not in pg
    url = secret_values("postgres", {"url": "postgresql://app:url-pw@db/app"})
    assert "url-pw" in url
    fields = secret_values("postgres", {"host": "db", "user": "app", "password": "fld-pw", "port": 5432})
    assert fields == {"fld-pw"}
    basic = secret_values("http_basic", {"username": "bob", "password": "b0b-pw"})
    assert {"b0b-pw", "bob:b0b-pw", base64.b64encode(b"bob:b0b-pw").decode()} <= basic and "bob" not in basic
    assert secret_values("http_bearer", {"token": "t0k", "realm": "x"}) == {"t0k"}
    assert secret_values("generic", {"header": "X-Key", "value": "v4lue"}) == {"X-Key", "v4lue"}  # opaque


def test_key_names() -> None:
    assert is_secret_key("DB_Password") and is_secret_key("x-api-key") and not is_secret_key("status_code")
    assert mask_secret_keys({"token": "t", "empty_token": "", "nested": [{"dsn": "d"}], "n": 1}) == {
        "token": MASK, "empty_token": "", "nested": [{"dsn": MASK}], "n": 1}


@pytest.fixture
def logged() -> tuple[logging.Logger, io.StringIO, ActiveSecrets]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    active = ActiveSecrets()
    handler.addFilter(LogFilter(active))
    log = logging.getLogger("test.redact")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log, stream, active


def test_log_filter_masks_messages_arguments_and_tracebacks(logged: tuple[logging.Logger, io.StringIO,
                                                                          ActiveSecrets]) -> None:
    log, stream, active = logged
    log.info("before %s", SECRET)  # no command holds it yet: written as is
    redactor = Redactor([SECRET])
    active.register(redactor)
    log.info("connect failed: %s", SECRET)
    try:
        raise RuntimeError(f"boom {SECRET}")
    except RuntimeError:
        log.exception("crashed with %r", {"password": SECRET})
    active.unregister(redactor)
    log.info("after %s", SECRET)
    lines = stream.getvalue()
    assert lines.count(SECRET) == 2  # "before" and "after" only
    assert f"connect failed: {MASK}" in lines and f"RuntimeError: boom {MASK}" in lines
    assert not active
