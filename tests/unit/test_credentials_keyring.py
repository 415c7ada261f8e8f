"""Envelope encryption of credentials (noetl_api.keyring): round trip, wrong keys,
rotation, tampered rows, and the setting's parsing (never echoing key material)."""

from __future__ import annotations

import base64
import dataclasses
import os

import pytest

from noetl_api.keyring import CredentialSealError, Keyring, Sealed, generate_key
from noetl_common.errors import ConfigError

DATA = {"dsn": "host=db user=app password=s3cret-pw dbname=app", "note": "ünïcode"}


def key() -> str:
    return generate_key()


def ring(*entries: tuple[str, str]) -> Keyring:
    return Keyring.parse(",".join(f"{i}:{k}" for i, k in entries))


def test_round_trip_and_nothing_in_clear() -> None:
    k1 = ring(("k1", key()))
    sealed = k1.seal("pg_prod", "postgres", DATA)
    assert sealed.key_id == "k1"
    assert len(sealed.nonce) == 12 and len(sealed.wrapped_key) == 12 + 32 + 16
    assert b"s3cret-pw" not in sealed.ciphertext and b"s3cret-pw" not in sealed.wrapped_key
    assert k1.open("pg_prod", "postgres", sealed) == DATA
    again = k1.seal("pg_prod", "postgres", DATA)  # a new data key and nonce on every write
    assert again.ciphertext != sealed.ciphertext and again.wrapped_key != sealed.wrapped_key


def test_a_wrong_or_missing_key_does_not_open() -> None:
    material = key()
    sealed = ring(("k1", material)).seal("api", "http_bearer", {"token": "t0ken-value"})
    with pytest.raises(CredentialSealError, match="different key under that id") as exc:
        ring(("k1", key())).open("api", "http_bearer", sealed)
    assert material not in str(exc.value) and "t0ken" not in str(exc.value)
    with pytest.raises(CredentialSealError, match=r"key 'k1', which is not in NOETL_CREDENTIALS_KEYS \(configured: k2\)"):
        ring(("k2", key())).open("api", "http_bearer", sealed)
    with pytest.raises(CredentialSealError, match="configured: none"):
        Keyring.parse("").open("api", "http_bearer", sealed)


def test_rotation_opens_with_the_old_key_and_rewraps_to_the_new_one() -> None:
    old, new = key(), key()
    sealed = ring(("k1", old)).seal("pg", "postgres", DATA)
    both = ring(("k2", new), ("k1", old))  # k2 first: the primary
    assert both.open("pg", "postgres", sealed) == DATA  # the old key still decrypts
    rewrapped = both.rewrap("pg", sealed)
    assert rewrapped.key_id == "k2" and rewrapped.ciphertext == sealed.ciphertext  # the data key moved, not the data
    assert ring(("k2", new)).open("pg", "postgres", rewrapped) == DATA  # the old key can go now
    with pytest.raises(CredentialSealError):
        ring(("k1", old)).open("pg", "postgres", rewrapped)
    assert both.rewrap("pg", rewrapped) is rewrapped  # already on the primary: nothing to do
    assert both.seal("x", "generic", {"value": "v"}).key_id == "k2"


@pytest.mark.parametrize("tamper", [
    lambda s: dataclasses.replace(s, ciphertext=bytes([s.ciphertext[0] ^ 1]) + s.ciphertext[1:]),
    lambda s: dataclasses.replace(s, nonce=os.urandom(12)),
    lambda s: dataclasses.replace(s, wrapped_key=s.wrapped_key[:-1] + bytes([s.wrapped_key[-1] ^ 1])),
    lambda s: dataclasses.replace(s, wrapped_key=s.wrapped_key[:5]),
])
def test_a_tampered_row_fails(tamper: object) -> None:
    k = ring(("k1", key()))
    sealed = k.seal("pg", "postgres", DATA)
    with pytest.raises(CredentialSealError):
        k.open("pg", "postgres", tamper(sealed))  # type: ignore[operator]


def test_a_row_bound_to_its_name_kind_and_key_id() -> None:
    k = ring(("k1", key()), ("k2", key()))
    sealed = k.seal("pg_test", "postgres", DATA)
    other = k.seal("pg_prod", "postgres", {"dsn": "host=prod"})
    with pytest.raises(CredentialSealError):  # test's ciphertext copied into prod's row
        k.open("pg_prod", "postgres", Sealed(other.key_id, other.wrapped_key, sealed.nonce, sealed.ciphertext))
    with pytest.raises(CredentialSealError):  # the whole row copied under another name
        k.open("pg_prod", "postgres", sealed)
    with pytest.raises(CredentialSealError, match="row was altered"):  # the kind changed
        k.open("pg_test", "generic", sealed)
    with pytest.raises(CredentialSealError):  # relabelled with another configured key id
        k.open("pg_test", "postgres", dataclasses.replace(sealed, key_id="k2"))


@pytest.mark.parametrize(("text", "fragment"), [
    ("k1", "entry 1 is not ID:BASE64KEY"),
    ("k 1:abc", "entry 1 is not ID:BASE64KEY"),
    ("k1:not base64!", "key 'k1' is not valid base64"),
    (f"k1:{base64.b64encode(b'short').decode()}", "key 'k1' is 5 bytes; AES-256 needs 32"),
])
def test_malformed_settings_name_the_setting_never_the_material(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as exc:
        Keyring.parse(text)
    assert "NOETL_CREDENTIALS_KEYS" in str(exc.value) and fragment in str(exc.value)


def test_parse_orders_and_checks_ids() -> None:
    a, b = key(), key()
    k = Keyring.parse(f" k2:{a} , k1:{b} ,")
    assert k.ids == ("k2", "k1") and k.primary == "k2" and k.has("k1") and bool(k)
    assert a not in repr(k) and b not in repr(k)
    with pytest.raises(ConfigError, match="key id 'k1' is given twice"):
        Keyring.parse(f"k1:{a},k1:{b}")
    empty = Keyring.parse("")
    assert not empty and empty.ids == ()
    with pytest.raises(ConfigError, match="NOETL_CREDENTIALS_KEYS is not set"):
        empty.seal("x", "generic", {"value": "v"})
