"""Credentials for integration tests: stored the way the api stores them (sealed with
TEST_KEYS), and opened the way the api opens them."""

from __future__ import annotations

from typing import Any

from noetl_api.credentials import CredentialStore
from noetl_api.keyring import Keyring
from noetl_worker.tools import Holder, StoredCredential
from noetl_worker.tools.credentials import Fetch

# The master key every integration test seals credentials with (the session's database is
# shared: a test that re-keys the table puts back rows sealed with this one).
TEST_KEYS = "itest:" + "A" * 43 + "="


def sealing_keyring() -> Keyring:
    return Keyring.parse(TEST_KEYS)


async def put_credentials(pool: Any, credentials: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """Store credentials as PutCredential does."""
    store = CredentialStore(pool, sealing_keyring())
    for name, (kind, data) in credentials.items():
        await store.put(name, kind, dict(data))


def store_fetch(pool: Any) -> Fetch:
    """A worker's credential Fetch that opens stored credentials itself (the api's
    CredentialStore over the real table and key), for tool tests without an api: what
    GetCredential answers, without its claim check (tests: test_credential_store.py)."""
    store = CredentialStore(pool, sealing_keyring(), cache_sec=0)

    async def fetch(holder: Holder, name: str) -> StoredCredential:
        cred = await store.get(name)
        return StoredCredential(cred.name, cred.kind, cred.data)

    return fetch
