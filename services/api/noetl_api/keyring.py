"""Envelope encryption of credentials (AES-256-GCM, the ``cryptography`` library).

    NOETL_CREDENTIALS_KEYS = "k2:<base64 32 bytes>,k1:<base64 32 bytes>"
                              ^ primary: wraps new data keys    ^ still unwraps

    seal(name, kind, data):
        data key   = 32 random bytes (one per credential, new on every write)
        ciphertext = AES-GCM(data key, nonce, JSON(data), aad = name, kind)
        wrapped    = nonce' + AES-GCM(master[primary], nonce', data key, aad = key id, name)
        -> Sealed(key_id, wrapped, nonce, ciphertext)         (what noetl.credential stores)

    open(name, kind, sealed)   unwrap with master[key_id], decrypt, check both tags
    rewrap(name, sealed)       unwrap with master[key_id], wrap again with the primary
                               (rotation: the data and its ciphertext are untouched)

The additional data binds each ciphertext to its row: a ciphertext copied into another
row, a renamed row, a changed kind or key id, or a flipped bit fails authentication
(``CredentialSealError``), never decrypts to something else. Nothing here logs, and no
message carries key material or plaintext. Pure: no I/O (``credentials.py`` stores rows).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from noetl_common.errors import ConfigError, NoetlError

SETTING = "NOETL_CREDENTIALS_KEYS"
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12
_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_DATA_AAD = b"noetl.credential.data/v1\x00"
_KEY_AAD = b"noetl.credential.key/v1\x00"


class CredentialSealError(NoetlError):
    """A sealed credential cannot be opened: its key is not configured, or the row (or the
    key) is not the one it was sealed with. The message names the credential and key id."""


@dataclass(frozen=True, slots=True)
class Sealed:
    """A credential's data as stored: what ``noetl.credential`` holds instead of ``data``."""

    key_id: str
    wrapped_key: bytes
    nonce: bytes
    ciphertext: bytes


def generate_key() -> str:
    """A new master key, base64 text (32 random bytes)."""
    return base64.b64encode(os.urandom(KEY_BYTES)).decode()


def _aad(prefix: bytes, *parts: str) -> bytes:
    return prefix + b"\x00".join(p.encode() for p in parts)


class Keyring:
    """The master keys, first = primary. Parse with :meth:`parse`; an empty keyring seals
    nothing and opens nothing."""

    def __init__(self, keys: list[tuple[str, bytes]]) -> None:
        self._keys = {key_id: AESGCM(material) for key_id, material in keys}
        self.ids: tuple[str, ...] = tuple(key_id for key_id, _ in keys)

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """``id:base64key`` entries, comma separated (whitespace ignored). ConfigError naming
        NOETL_CREDENTIALS_KEYS and the entry's position (never its material) otherwise."""
        keys: list[tuple[str, bytes]] = []
        for n, entry in enumerate((e.strip() for e in text.split(",")), start=1):
            if not entry:
                continue
            key_id, sep, encoded = entry.partition(":")
            key_id = key_id.strip()
            if not sep or not _KEY_ID.match(key_id):
                raise ConfigError(f"{SETTING}: entry {n} is not ID:BASE64KEY (an id of letters, digits, '.', '_'"
                                  " or '-', then ':' and the key in base64)")
            try:
                material = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise ConfigError(f"{SETTING}: key {key_id!r} is not valid base64") from None
            if len(material) != KEY_BYTES:
                raise ConfigError(f"{SETTING}: key {key_id!r} is {len(material)} bytes; AES-256 needs {KEY_BYTES}"
                                  " (generate one with: head -c 32 /dev/urandom | base64)")
            if any(key_id == k for k, _ in keys):
                raise ConfigError(f"{SETTING}: key id {key_id!r} is given twice")
            keys.append((key_id, material))
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self.ids)

    def __repr__(self) -> str:  # never the material
        return f"Keyring(ids={list(self.ids)})"

    @property
    def primary(self) -> str:
        if not self.ids:
            raise ConfigError(f"{SETTING} is not set: the api cannot encrypt credentials")
        return self.ids[0]

    def has(self, key_id: str) -> bool:
        return key_id in self._keys

    # ------------------------------------------------------------ seal / open

    def seal(self, name: str, kind: str, data: dict[str, Any]) -> Sealed:
        data_key = AESGCM.generate_key(bit_length=KEY_BYTES * 8)
        nonce = os.urandom(NONCE_BYTES)
        plaintext = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        ciphertext = AESGCM(data_key).encrypt(nonce, plaintext, _aad(_DATA_AAD, name, kind))
        key_id = self.primary
        return Sealed(key_id, self._wrap(key_id, name, data_key), nonce, ciphertext)

    def open(self, name: str, kind: str, sealed: Sealed) -> dict[str, Any]:
        data_key = self._unwrap(name, sealed)
        try:
            plaintext = AESGCM(data_key).decrypt(sealed.nonce, sealed.ciphertext, _aad(_DATA_AAD, name, kind))
        except (InvalidTag, ValueError):
            raise CredentialSealError(f"credential {name!r} does not decrypt: its row was altered"
                                      " (ciphertext, name or kind)") from None
        value = json.loads(plaintext)
        if not isinstance(value, dict):  # pragma: no cover - seal only writes objects
            raise CredentialSealError(f"credential {name!r} decrypts to a {type(value).__name__}, not an object")
        return value

    def rewrap(self, name: str, sealed: Sealed) -> Sealed:
        """The same data key wrapped by the primary key (a no-op when it already is)."""
        if sealed.key_id == self.primary:
            return sealed
        data_key = self._unwrap(name, sealed)
        return Sealed(self.primary, self._wrap(self.primary, name, data_key), sealed.nonce, sealed.ciphertext)

    def check(self, name: str, sealed: Sealed) -> None:
        """Raise CredentialSealError unless the row's data key unwraps (its key is here and is
        the key it was sealed with)."""
        self._unwrap(name, sealed)

    def _wrap(self, key_id: str, name: str, data_key: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._keys[key_id].encrypt(nonce, data_key, _aad(_KEY_AAD, key_id, name))

    def _unwrap(self, name: str, sealed: Sealed) -> bytes:
        master = self._keys.get(sealed.key_id)
        if master is None:
            raise CredentialSealError(f"credential {name!r} is encrypted with key {sealed.key_id!r}, which is not in"
                                      f" {SETTING} (configured: {', '.join(self.ids) or 'none'})")
        wrapped = sealed.wrapped_key
        try:
            return master.decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], _aad(_KEY_AAD, sealed.key_id, name))
        except (InvalidTag, ValueError):
            raise CredentialSealError(f"the data key of credential {name!r} does not unwrap with key"
                                      f" {sealed.key_id!r}: a different key under that id, or an altered row") from None


__all__ = ["KEY_BYTES", "SETTING", "CredentialSealError", "Keyring", "Sealed", "generate_key"]
