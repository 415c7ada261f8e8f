"""``noetl.credential``: the one module that reads and writes it (the api's).

Rows are sealed with the api's :class:`~noetl_api.keyring.Keyring` (envelope encryption,
``keyring.py``); only this module, in the api, opens them. ``put`` seals with the primary
key; ``get`` opens (a short in-process cache of opened credentials: the api is where they
are decrypted anyway); ``names`` lists names and kinds, never data.

At start (``prepare``, before the api serves, one transaction under an advisory lock so
replicas starting together take turns):

    no row                          -> nothing to do (an api without a key may run; it
                                       refuses PutCredential with FAILED_PRECONDITION)
    rows, but no key configured     -> ConfigError naming NOETL_CREDENTIALS_KEYS
    a row sealed with a key id that
      is not configured, or whose
      data key does not unwrap      -> ConfigError naming the credential and key id
    legacy plaintext rows (``data``,
      written before migration 0007) -> sealed with the primary key, ``data`` cleared
    rows wrapped by an older key    -> re-wrapped by the primary (rotation)

So after an api with a key has started, no plaintext remains (``data IS NULL`` on every
row), and once every row is wrapped by the primary, older keys can be dropped from the
setting. The plaintext is sealed by the api rather than by ``noetl-rt migrate`` because
only the api holds the master key: the migration job (and its Postgres role) never sees it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from noetl_common.db import Pool, autocommit, transaction
from noetl_common.errors import ConfigError, Conflict, InvalidInput, NotFound
from noetl_db import credentials as credentials_db

from .keyring import SETTING, CredentialSealError, Keyring, Sealed

logger = logging.getLogger(__name__)

KINDS = frozenset({"postgres", "http_bearer", "http_basic", "generic"})
MAX_DATA_BYTES = 64 * 1024
# pg_advisory_xact_lock key of the start-time sealing ("noetl.credential" folded to 63 bits).
PREPARE_LOCK_KEY = 0x6E6F65746C637264
# Opened credentials kept in the api's memory (seconds): GetCredential for a loop's
# thousands of commands decrypts once per credential per this period.
OPEN_CACHE_SEC = 5.0


@dataclass(frozen=True, slots=True)
class Credential:
    name: str
    kind: str
    data: dict[str, Any]

    def __repr__(self) -> str:  # never the data
        return f"Credential(name={self.name!r}, kind={self.kind!r})"


@dataclass(frozen=True, slots=True)
class PrepareReport:
    total: int
    sealed: int  # legacy plaintext rows encrypted now
    rewrapped: int  # rows whose data key moved to the primary key


def check_data(name: str, kind: str, data: Any) -> None:
    """InvalidInput naming what is wrong with a credential to be stored (never its values)."""
    if not name.strip():
        raise InvalidInput("credential name is required")
    if kind not in KINDS:
        raise InvalidInput(f"unknown credential kind {kind!r} (expected one of: {', '.join(sorted(KINDS))})")
    if not isinstance(data, dict) or not data:
        raise InvalidInput("a credential's data must be a non-empty JSON object")
    if kind == "postgres" and not (data.get("dsn") or data.get("host")):
        raise InvalidInput("a postgres credential needs 'dsn' (or host/port/user/password/dbname)")
    if kind == "http_bearer" and not (data.get("token") or data.get("access_token")):
        raise InvalidInput("an http_bearer credential needs 'token'")
    if kind == "http_basic" and not (data.get("username") is not None and data.get("password") is not None):
        raise InvalidInput("an http_basic credential needs 'username' and 'password'")


def _sealed(row: dict[str, Any]) -> Sealed:
    return Sealed(row["key_id"], bytes(row["wrapped_key"]), bytes(row["nonce"]), bytes(row["ciphertext"]))


class CredentialStore:
    def __init__(self, pool: Pool, keyring: Keyring, *, cache_sec: float = OPEN_CACHE_SEC,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self.keyring = keyring
        self._cache_sec = cache_sec
        self._clock = clock
        self._opened: dict[str, tuple[float, Credential]] = {}

    # ------------------------------------------------------------ start

    async def prepare(self) -> PrepareReport:
        """Check the stored credentials against the keyring; seal legacy plaintext rows and
        re-wrap rows of older keys (module docstring). ConfigError when the api cannot serve
        the credentials it has."""
        sealed = rewrapped = 0
        async with transaction(self._pool) as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (PREPARE_LOCK_KEY,))
            cur = await conn.execute("SELECT name, kind, data, key_id, wrapped_key, nonce, ciphertext"
                                     " FROM noetl.credential ORDER BY name FOR UPDATE")
            rows = await cur.fetchall()
            if rows and not self.keyring:
                raise ConfigError(f"{SETTING} is not set, but the runtime database holds {len(rows)} credential(s):"
                                  " the api cannot serve them without the key they are encrypted with"
                                  " (docs/DEPLOY.md, 'Credentials')")
            problems = []
            for row in rows:
                if row["data"] is None:
                    try:
                        self.keyring.check(row["name"], _sealed(row))
                    except CredentialSealError as exc:
                        problems.append(str(exc))
            if problems:
                raise ConfigError(f"{SETTING} cannot open {len(problems)} stored credential(s): "
                                  + "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else ""))
            for row in rows:
                name = row["name"]
                if row["data"] is not None:
                    data = row["data"] if isinstance(row["data"], dict) else json.loads(row["data"])
                    new = self.keyring.seal(name, row["kind"], data)
                    sealed += 1
                else:
                    current = _sealed(row)
                    new = self.keyring.rewrap(name, current)
                    if new is current:
                        continue
                    rewrapped += 1
                await credentials_db.reseal(conn, name, new)
        report = PrepareReport(len(rows), sealed, rewrapped)
        if sealed or rewrapped:
            logger.info("credentials: %d stored, %d plaintext row(s) encrypted, %d re-wrapped by key %s",
                        report.total, sealed, rewrapped, self.keyring.primary)
        return report

    # ------------------------------------------------------------ writes and reads

    async def put(self, name: str, kind: str, data: dict[str, Any]) -> bool:
        """Store (seal) a credential; True when it was created, False when replaced."""
        check_data(name, kind, data)
        if len(json.dumps(data)) > MAX_DATA_BYTES:
            raise InvalidInput(f"a credential's data is at most {MAX_DATA_BYTES} bytes of JSON")
        if not self.keyring:
            raise Conflict(f"this api has no {SETTING}: it cannot store credentials encrypted"
                           " (docs/DEPLOY.md, 'Credentials')")
        sealed = self.keyring.seal(name, kind, data)
        async with transaction(self._pool) as conn:
            created = await credentials_db.put(conn, name, kind, sealed)
        self._opened.pop(name, None)
        return created

    async def names(self) -> list[dict[str, Any]]:
        """Every credential's name, kind and update time (never its data)."""
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("SELECT name, kind, updated_at FROM noetl.credential ORDER BY name")
            return list(await cur.fetchall())

    async def get(self, name: str) -> Credential:
        """The opened credential; NotFound naming it; CredentialSealError when it cannot be
        opened (its key is gone, the row was altered)."""
        now = self._clock()
        hit = self._opened.get(name)
        if hit is not None and now - hit[0] < self._cache_sec:
            return hit[1]
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("SELECT name, kind, data, key_id, wrapped_key, nonce, ciphertext"
                                     " FROM noetl.credential WHERE name = %s", (name,))
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"credential {name!r} not found")
        if row["data"] is not None:  # written by an older api after this one started
            data = row["data"] if isinstance(row["data"], dict) else json.loads(row["data"])
        else:
            data = self.keyring.open(name, row["kind"], _sealed(row))
        cred = Credential(name, row["kind"], data)
        self._opened[name] = (now, cred)
        if len(self._opened) > 1024:
            self._opened = {k: v for k, v in self._opened.items() if now - v[0] < self._cache_sec}
        return cred


__all__ = ["KINDS", "Credential", "CredentialStore", "PrepareReport", "check_data"]
