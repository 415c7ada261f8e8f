"""Who may read a stored credential: ``WorkerService.GetCredential``'s decision.

A worker asks for a credential by name for a command attempt it is running. The api
answers with the opened credential only when

    1. the command exists                                      else NOT_FOUND
    2. it is ``claimed`` by that worker, as that attempt,      else FAILED_PRECONDITION
       and the request carries that claim's token (the claim
       check of RenewLease, plus the proof a result carries: a
       worker that lost the claim, or another worker naming
       itself as the holder, gets nothing)
    3. the command's step may read that name                   else PERMISSION_DENIED
       (``noetl_dsl.credrefs``: the step's own references,
       rendered with the execution's workload; the cursor the
       engine rendered for this command; when the step chooses
       one at run time, any credential its playbook names)
    4. the credential exists                                   else NOT_FOUND

The permission check comes before the lookup, so a worker learns nothing about
credentials its command may not read. Every answer is counted
(``noetl_credential_requests_total{outcome}``) and every refusal logged with the command,
worker and name (never data): an audit of who read what.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from prometheus_client import Counter

from noetl_common import auth
from noetl_common.errors import Conflict, NotFound, PermissionDenied
from noetl_common.vocab import CommandStatus
from noetl_dsl import merged_workload
from noetl_dsl.credrefs import Grant, playbook_names, reference_of, step_grant

from .catalog import Catalog
from .claims import Claims
from .credentials import Credential, CredentialStore

logger = logging.getLogger(__name__)

REQUESTS = Counter("noetl_credential_requests_total", "GetCredential answers by outcome",
                   ["outcome"])  # granted, denied, not_held, not_found
GRANT_CACHE_ITEMS = 4096


class CredentialDenied(PermissionDenied):
    """The command's step may not read the credential it asked for (PERMISSION_DENIED)."""


class CredentialGrants:
    def __init__(self, claims: Claims, catalog: Catalog, store: CredentialStore, results: Any = None) -> None:
        """``results``: the result store, to read a workload stored by reference."""
        self._claims = claims
        self._catalog = catalog
        self._store = store
        self._results = results
        self._grants: OrderedDict[tuple[int, str], tuple[Grant, frozenset[str]]] = OrderedDict()

    async def resolve(self, command_id: str, attempt: int, worker_id: str, name: str,
                      claim_token: str = "") -> Credential:
        """The opened credential, or the error of the first check that fails (docstring)."""
        try:
            return await self._resolve(command_id, attempt, worker_id, name, claim_token)
        except CredentialDenied:
            REQUESTS.labels("denied").inc()
            logger.warning("credential %r refused to worker %s for command %s attempt %s: not named by its step",
                           name, worker_id, command_id, attempt)
            raise
        except Conflict:
            REQUESTS.labels("not_held").inc()
            logger.warning("credential %r refused to worker %s for command %s attempt %s: not its claim",
                           name, worker_id, command_id, attempt)
            raise
        except NotFound:
            REQUESTS.labels("not_found").inc()
            raise

    async def _resolve(self, command_id: str, attempt: int, worker_id: str, name: str,
                       claim_token: str) -> Credential:
        row = await self._claims.holder(command_id)
        if row is None:
            raise NotFound(f"command {command_id} not found")
        if row["status"] != CommandStatus.CLAIMED or row["worker_id"] != worker_id or row["attempt"] != attempt:
            raise Conflict(f"command {command_id} attempt {attempt} is not claimed by worker {worker_id}"
                           f" (it is {row['status']}, attempt {row['attempt']})")
        key = self._claims.claim_key
        if key and not auth.claim_token_valid(key, claim_token, command_id, attempt, worker_id):
            raise Conflict(f"command {command_id} attempt {attempt}: the claim token does not match (the caller"
                           " does not hold that claim)")
        grant, named = await self._grant(row)
        cursor = row.get("cursor")
        from_cursor = reference_of(cursor.get("auth")) if isinstance(cursor, dict) else None
        if not (grant.allows(name, named) or name == from_cursor):
            raise CredentialDenied(f"step {row['step']!r} may not read credential {name!r}: the step does not name"
                                   " it (a credential chosen at run time must be named in the playbook, e.g. as a"
                                   " keychain entry)")
        cred = await self._store.get(name)
        REQUESTS.labels("granted").inc()
        return cred

    async def _grant(self, row: dict[str, Any]) -> tuple[Grant, frozenset[str]]:
        key = (int(row["execution_id"]), str(row["step"]))
        hit = self._grants.get(key)
        if hit is not None:
            self._grants.move_to_end(key)
            return hit
        playbook = (await self._catalog.compiled(int(row["catalog_id"]))).playbook
        if row.get("workload_ref_id") and self._results is not None:
            workload = await self._results.get(int(row["workload_ref_id"]))
        else:
            workload = merged_workload(playbook, row.get("payload") or {})
        if not isinstance(workload, dict):
            workload = {}
        found = (step_grant(playbook, str(row["step"]), workload), playbook_names(playbook, workload))
        self._grants[key] = found
        if len(self._grants) > GRANT_CACHE_ITEMS:
            self._grants.popitem(last=False)
        return found


__all__ = ["CredentialDenied", "CredentialGrants"]
