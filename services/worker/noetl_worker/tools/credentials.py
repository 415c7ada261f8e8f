"""Stored credentials, as a worker gets them: from the api, for a command it holds.

    Credentials             one per worker: asks the api (``WorkerService.GetCredential``,
                            the only place a secret travels) and keeps an answer for a
                            few seconds per (execution, step, name): the api's permission
                            is per step, so a loop's iterations do not ask again
    CommandSecrets          one per command attempt: what its tools call. Every credential
                            it hands out has its secret values added to the command's
                            Redactor (noetl_common.redact), which scrubs them from what
                            the command reports (errors, stdout, results, logs)

The worker never reads ``noetl.credential`` and never holds the master key. A refused
request is the task's error: ``CREDENTIAL_NOT_FOUND`` (no such credential),
``CREDENTIAL_NOT_PERMITTED`` (the step does not name it); an api that cannot be reached
is waited out (``CREDENTIAL_RETRY_SEC``) before the task fails, retryable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from noetl_common import grpcclient
from noetl_common.errors import Conflict, NoetlError, NotFound, PermissionDenied
from noetl_common.redact import Redactor, dsn_passwords
from noetl_common.retry import retry_transient
from noetl_proto.v1 import worker_pb2

from .outcome import CREDENTIAL_NOT_FOUND, CREDENTIAL_NOT_PERMITTED, TOOL_ERROR, ToolOutcome

# How long a credential request waits out an api that cannot be reached.
CREDENTIAL_RETRY_SEC = 120.0
CREDENTIAL_CALL_TIMEOUT_SEC = 10.0
# How long an answer is reused for the same execution step (seconds).
CACHE_TTL_SEC = 10.0


class CredentialDenied(PermissionDenied):
    """The api refused: the command's step may not read this credential."""


@dataclass(frozen=True, slots=True)
class Holder:
    """The command attempt a credential is asked for."""

    command_id: str
    attempt: int
    execution_id: int
    step: str
    claim_token: str = ""  # the claim's proof (Command.claim_token), shown to the api


@dataclass(frozen=True, slots=True)
class StoredCredential:
    name: str
    kind: str
    data: Mapping[str, Any]

    def __repr__(self) -> str:  # never the data
        return f"StoredCredential(name={self.name!r}, kind={self.kind!r})"


Fetch = Callable[[Holder, str], Awaitable[StoredCredential]]


def api_fetch(stub: Any, worker_id: str, *, retry_sec: float = CREDENTIAL_RETRY_SEC) -> Fetch:
    """A Fetch over ``WorkerService.GetCredential`` (``stub``; its errors translated,
    ``grpcclient.translating``) for this worker: outages (Unavailable) retried for
    ``retry_sec``, then raised; PERMISSION_DENIED -> CredentialDenied; other codes -> the
    project's errors (NotFound, Conflict, ...)."""
    api = grpcclient.translating(stub)

    async def fetch(holder: Holder, name: str) -> StoredCredential:
        request = worker_pb2.GetCredentialRequest(command_id=holder.command_id, attempt=holder.attempt,
                                                  worker_id=worker_id, name=name, claim_token=holder.claim_token)

        async def call() -> Any:
            try:
                return await api.GetCredential(request, timeout=CREDENTIAL_CALL_TIMEOUT_SEC)
            except PermissionDenied as exc:
                raise CredentialDenied(str(exc) or f"credential {name!r} not permitted") from None

        resp = await retry_transient(f"reading credential {name!r}", call, deadline_sec=retry_sec,
                                     initial=0.1, cap=5.0)
        data = json.loads(resp.data_json or "{}")
        return StoredCredential(resp.name or name, resp.kind, data if isinstance(data, dict) else {})

    return fetch


class Credentials:
    """The worker's access to stored credentials (module docstring)."""

    def __init__(self, fetch: Fetch | None, *, ttl: float = CACHE_TTL_SEC,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.ttl = ttl
        self._clock = clock
        self._cache: dict[tuple[int, str, str], tuple[float, StoredCredential]] = {}

    async def get(self, holder: Holder, name: str) -> StoredCredential:
        """The credential ``name`` for ``holder``; NotFound, CredentialDenied, Conflict (the
        claim is not the worker's any more) or Unavailable (the api did not answer)."""
        now = self._clock()
        key = (holder.execution_id, holder.step, name)
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        if self._fetch is None:
            raise NotFound(f"credential {name!r} not found (this worker has no credential access)")
        cred = await self._fetch(holder, name)
        self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.ttl}  # decrypted: keep briefly
        self._cache[key] = (now, cred)
        return cred

    def for_command(self, holder: Holder, redactor: Redactor | None = None) -> CommandSecrets:
        return CommandSecrets(self, holder, redactor if redactor is not None else Redactor())

    def clear(self) -> None:
        self._cache.clear()


class CommandSecrets:
    """The credentials one command attempt reads; their secret values go to ``redactor``."""

    def __init__(self, credentials: Credentials | None, holder: Holder, redactor: Redactor) -> None:
        self._credentials = credentials
        self.holder = holder
        self.redactor = redactor

    async def get(self, name: str) -> StoredCredential:
        if self._credentials is None:
            raise NotFound(f"credential {name!r} not found (this worker has no credential access)")
        cred = await self._credentials.get(self.holder, name)
        self.redactor.add_credential(cred.kind, cred.data)
        return cred

    def add(self, value: Any) -> None:
        """Also scrub ``value`` (something built from a secret, e.g. an Authorization header)."""
        self.redactor.add(value)

    def add_dsn(self, dsn: str) -> None:
        """Scrub a connection string and its password (an inline one too)."""
        for password in dsn_passwords(dsn):
            self.redactor.add(password)


def credential_failure(exc: NoetlError, what: str) -> ToolOutcome:
    """The task outcome of a credential that could not be had (``what`` names it, never
    its data)."""
    if isinstance(exc, NotFound):
        return ToolOutcome.failure(CREDENTIAL_NOT_FOUND, str(exc), kind="NotFound")
    if isinstance(exc, CredentialDenied):
        return ToolOutcome.failure(CREDENTIAL_NOT_PERMITTED, str(exc), kind="CredentialDenied")
    if isinstance(exc, Conflict):  # the claim moved on: the lease renewal stops this command
        return ToolOutcome.failure(TOOL_ERROR, f"cannot read {what}: {exc}", kind="Conflict", retryable=True)
    return ToolOutcome.failure(TOOL_ERROR, f"cannot read {what}: {exc}", kind=type(exc).__name__, retryable=True)


__all__ = ["CREDENTIAL_RETRY_SEC", "CommandSecrets", "CredentialDenied", "Credentials", "Holder",
           "StoredCredential", "api_fetch", "credential_failure"]
