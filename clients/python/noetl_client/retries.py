"""gRPC retries of the runtime's API, decided once: which failures are transient, which
methods may be repeated, and the one policy that repeats them. The runtime uses the same
definitions (``noetl_common.grpcretry`` re-exports them).

    failure                                  transient?
    -------                                  ----------
    UNAVAILABLE, DEADLINE_EXCEEDED           yes (``TRANSIENT_CODES``)
    any other status                         no: the same request would fail the same way

    method                                   repeated on a transient failure
    ------                                   ------------------------------
    IDEMPOTENT (reads, Watch, Cancel, a      by the channel: the service config's
      worker's claims, upserts, deletes)       retryPolicy names exactly these methods
    KEYED (SubmitExecution, RerunExecution)  only when the request carries an idempotency key
                                               (the api answers a repeated key with the first
                                               execution), by ``call_keyed``: a channel's
                                               policy cannot look at request fields
    NOT_IDEMPOTENT (Join, CreateToken,       never: each call makes something new (a runtime
      AddSchedule)                             id, a token shown once, a schedule id)

Idempotent means what RFC 9110 says of a request: the effect on the server of several
identical calls is the effect of one (a repeated delete may answer NOT_FOUND, a repeated
claim of the same attempt by the same worker returns the command again). A unit test of
the runtime checks every method of every service in ``proto/`` is in exactly one of the
three sets.

Imports only grpc and the standard library.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

_EXECUTION = "/noetl.v1.ExecutionService/"
_CATALOG = "/noetl.v1.CatalogService/"
_CREDENTIAL = "/noetl.v1.CredentialService/"
_CONCURRENCY = "/noetl.v1.ConcurrencyService/"
_DEAD_LETTER = "/noetl.v1.DeadLetterService/"
_SCHEDULE = "/noetl.v1.ScheduleService/"
_SHARD_MANAGER = "/noetl.v1.ShardManagerService/"
_AUTH = "/noetl.v1.AuthService/"
_WORKER = "/noetl.v1.WorkerService/"
_HEALTH = "/grpc.health.v1.Health/"

IDEMPOTENT: frozenset[str] = frozenset({
    _EXECUTION + "GetExecution",
    _EXECUTION + "ListExecutions",
    _EXECUTION + "WatchExecution",       # retried until the first message arrives
    _EXECUTION + "CancelExecution",      # a committed cancel request is committed once
    _EXECUTION + "GetEvents",
    _EXECUTION + "GetTrace",
    _EXECUTION + "ListQuarantined",
    _CATALOG + "RegisterPlaybook",       # content identical to the latest version: that version
    _CATALOG + "GetPlaybook",
    _CATALOG + "ListPlaybooks",
    _CREDENTIAL + "PutCredential",       # an upsert by name
    _CREDENTIAL + "ListCredentials",
    _CONCURRENCY + "SetLimit",           # an upsert by (path, key)
    _CONCURRENCY + "ListLimits",
    _CONCURRENCY + "DeleteLimit",
    _DEAD_LETTER + "ListDeadLetters",
    _DEAD_LETTER + "GetDeadLetter",
    _DEAD_LETTER + "RedriveDeadLetter",  # a pending redrive is answered already_requested
    _SCHEDULE + "ListSchedules",
    _SCHEDULE + "PauseSchedule",
    _SCHEDULE + "ResumeSchedule",
    _SCHEDULE + "DeleteSchedule",
    _SHARD_MANAGER + "Heartbeat",
    _SHARD_MANAGER + "Leave",
    _SHARD_MANAGER + "Describe",
    _AUTH + "ListTokens",
    _AUTH + "RevokeToken",
    _WORKER + "ClaimCommand",            # the same worker claiming the same attempt gets it back
    _WORKER + "ClaimCommands",
    _WORKER + "RenewLease",
    _WORKER + "GetCredential",
    _HEALTH + "Check",                   # served by every role (not in proto/)
    _HEALTH + "Watch",
})

KEYED: frozenset[str] = frozenset({
    _EXECUTION + "SubmitExecution",
    _EXECUTION + "RerunExecution",
})

NOT_IDEMPOTENT: frozenset[str] = frozenset({
    _SHARD_MANAGER + "Join",             # a new runtime id per call
    _AUTH + "CreateToken",               # the token is shown in this answer only
    _SCHEDULE + "AddSchedule",           # a new schedule id; a repeat answers a conflict
})

# The channel's retry of IDEMPOTENT methods; ``call_keyed`` backs off the same way.
MAX_ATTEMPTS = 4
INITIAL_BACKOFF_SEC = 0.1
MAX_BACKOFF_SEC = 2.0
BACKOFF_MULTIPLIER = 2.0

KEY_FIELD = "idempotency_key"


def transient(exc: BaseException) -> bool:
    """True when calling again can succeed: an RpcError with a ``TRANSIENT_CODES`` status."""
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        return code in TRANSIENT_CODES
    return False


def service_config() -> str:
    """The channel's service config: round robin over the target's addresses, and gRPC's
    transparent retry on UNAVAILABLE (a replica died: the call goes to another one) for
    the IDEMPOTENT methods only."""
    names = []
    for method in sorted(IDEMPOTENT):
        service, name = method.strip("/").split("/")
        names.append({"service": service, "method": name})
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{
            "name": names,
            "retryPolicy": {
                "maxAttempts": MAX_ATTEMPTS,
                "initialBackoff": f"{INITIAL_BACKOFF_SEC}s",
                "maxBackoff": f"{MAX_BACKOFF_SEC}s",
                "backoffMultiplier": BACKOFF_MULTIPLIER,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }],
    })


def has_key(request: Any) -> bool:
    """Whether a submission (SubmitExecution, RerunExecution) may be repeated: it carries
    an idempotency key."""
    return bool(getattr(request, KEY_FIELD, ""))


def call_keyed(call: Callable[[float], T], request: Any, *, timeout: float, what: str = "the submission",
               attempts: int = MAX_ATTEMPTS, sleep: Callable[[float], Any] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> T:
    """``call(timeout)`` (a blocking stub call of ``request``); when it fails transiently
    and ``request`` carries an idempotency key, again with the same request, at most
    ``attempts`` calls within ``timeout`` seconds in all, backing off as the channel does
    (full jitter). Without a key: one call. Raises the last RpcError.

    Written out rather than with tenacity (the runtime's ``retry.retry_keyed``, the async
    twin, uses it): this package depends on grpcio and protobuf only."""
    deadline = clock() + timeout
    backoff = INITIAL_BACKOFF_SEC
    attempt = 1
    while True:
        try:
            return call(max(deadline - clock(), 0.0))
        except grpc.RpcError as exc:
            pause = random.uniform(0, backoff)
            if attempt >= attempts or not has_key(request) or not transient(exc) or clock() + pause >= deadline:
                raise
            # info: the CLI prints no log line below a warning, and says what failed in the end
            logger.info("%s failed (attempt %d: %s); retrying in %.2fs with the same idempotency key", what,
                        attempt, exc.code() if hasattr(exc, "code") else exc, pause)
        sleep(pause)
        backoff = min(backoff * BACKOFF_MULTIPLIER, MAX_BACKOFF_SEC)
        attempt += 1


__all__ = ["BACKOFF_MULTIPLIER", "IDEMPOTENT", "INITIAL_BACKOFF_SEC", "KEYED", "KEY_FIELD", "MAX_ATTEMPTS",
           "MAX_BACKOFF_SEC", "NOT_IDEMPOTENT", "TRANSIENT_CODES", "call_keyed", "has_key", "service_config",
           "transient"]
