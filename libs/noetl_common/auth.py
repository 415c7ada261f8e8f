"""Identity on every RPC: bearer tokens, roles, and which role may call what.

    client --(authorization: Bearer noetl_...)--> AuthInterceptor --> servicer
                                                     |  sha256(token) -> noetl.api_token (cached)
                                                     |  role allowed for the method? (METHOD_ROLES)
                                                     +-- UNAUTHENTICATED / PERMISSION_DENIED

Roles: ``admin`` (everything, credentials, tokens, cancel any), ``submit`` (run playbooks,
register them, read, cancel its own), ``read`` (read only), ``worker`` (the worker API,
and what a sub-playbook task needs: submit, read, cancel), ``service`` (the runtime's own
roles joining the shard-manager). Health and reflection are open; a method missing from
the table is refused (fail closed; a test checks every RPC of every service is listed).

Tokens are ``noetl_`` + 43 url-safe characters (256 random bits); only their SHA-256 is
stored, so a copy of the table authenticates nobody. A verified token is trusted for
``AuthSettings.cache_sec`` (a revoked one stops working within that).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from .errors import Conflict, InvalidInput, NotFound
from .grpcclient import METADATA_KEY, SyncClientAuth  # noqa: F401  (re-exported)
from .roles import Role
from .rpchandlers import rewrapped

if TYPE_CHECKING:
    from .db import Pool

logger = logging.getLogger(__name__)


def _autocommit(pool: Pool) -> Any:
    """``db.autocommit``, imported when a token is read or written: clients of this module
    (the CLI's ``Role``) do not load Postgres' driver for it."""
    from .db import autocommit

    return autocommit(pool)


def _tokens() -> Any:
    """``noetl_db.tokens``, imported when a token is read or written (as ``_autocommit``)."""
    from noetl_db import tokens

    return tokens

TOKEN_PREFIX = "noetl_"


@dataclass(frozen=True)
class Identity:
    token_id: int
    name: str
    role: Role


# The caller of the RPC being served (set by AuthInterceptor for the handler's task).
current: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("noetl_identity", default=None)

_A, _S, _R, _W, _SV = Role.ADMIN, Role.SUBMIT, Role.READ, Role.WORKER, Role.SERVICE
_READERS = frozenset({_A, _S, _R, _W})
_EXECUTIONS = "/noetl.v1.ExecutionService/"
_CATALOG = "/noetl.v1.CatalogService/"
_CREDENTIALS = "/noetl.v1.CredentialService/"
_WORKER = "/noetl.v1.WorkerService/"
_MEMBERS = "/noetl.v1.ShardManagerService/"
_TOKENS = "/noetl.v1.AuthService/"
_SCHEDULES = "/noetl.v1.ScheduleService/"
_CONCURRENCY = "/noetl.v1.ConcurrencyService/"
_DEAD_LETTERS = "/noetl.v1.DeadLetterService/"

#: Which roles may call which method (full gRPC method name).
METHOD_ROLES: Mapping[str, frozenset[Role]] = {
    # a worker submits, follows and cancels sub-playbooks; the reaper (service) submits
    # the ticks of schedules (docs/ARCHITECTURE.md "Schedules")
    _EXECUTIONS + "SubmitExecution": frozenset({_A, _S, _W, _SV}),
    # a rerun is a new execution of an existing one (a submit token: its own executions only)
    _EXECUTIONS + "RerunExecution": frozenset({_A, _S, _SV}),
    _EXECUTIONS + "GetExecution": _READERS,
    _EXECUTIONS + "ListExecutions": _READERS,
    _EXECUTIONS + "WatchExecution": _READERS,
    _EXECUTIONS + "GetEvents": _READERS,
    _EXECUTIONS + "GetTrace": _READERS,
    _EXECUTIONS + "CancelExecution": frozenset({_A, _S, _W}),  # submit: its own executions only
    _EXECUTIONS + "ListQuarantined": frozenset({_A, _R}),
    _CATALOG + "RegisterPlaybook": frozenset({_A, _S}),
    _CATALOG + "GetPlaybook": _READERS,
    _CATALOG + "ListPlaybooks": _READERS,
    _CREDENTIALS + "PutCredential": frozenset({_A}),
    _CREDENTIALS + "ListCredentials": frozenset({_A}),
    _WORKER + "ClaimCommand": frozenset({_W}),
    _WORKER + "ClaimCommands": frozenset({_W}),
    _WORKER + "RenewLease": frozenset({_W}),
    _WORKER + "GetCredential": frozenset({_W}),  # and only for a claim it holds (noetl_api.grants)
    _MEMBERS + "Join": frozenset({_SV, _W}),
    _MEMBERS + "Heartbeat": frozenset({_SV, _W}),
    _MEMBERS + "Leave": frozenset({_SV, _W}),
    _MEMBERS + "Describe": frozenset({_A, _R, _SV}),
    _TOKENS + "CreateToken": frozenset({_A}),
    _TOKENS + "ListTokens": frozenset({_A}),
    _TOKENS + "RevokeToken": frozenset({_A}),
    _SCHEDULES + "AddSchedule": frozenset({_A}),
    _SCHEDULES + "ListSchedules": _READERS,
    _SCHEDULES + "PauseSchedule": frozenset({_A}),
    _SCHEDULES + "ResumeSchedule": frozenset({_A}),
    _SCHEDULES + "DeleteSchedule": frozenset({_A}),
    _CONCURRENCY + "SetLimit": frozenset({_A}),
    _CONCURRENCY + "ListLimits": _READERS,
    _CONCURRENCY + "DeleteLimit": frozenset({_A}),
    # dead letters (docs/ARCHITECTURE.md "Dead letters"): a redrive is an operator write,
    # like a cancellation (a submit token: its own executions only)
    _DEAD_LETTERS + "ListDeadLetters": frozenset({_A, _S, _R}),
    _DEAD_LETTERS + "GetDeadLetter": frozenset({_A, _S, _R}),
    _DEAD_LETTERS + "RedriveDeadLetter": frozenset({_A, _S}),
}
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_role(text: str) -> Role:
    try:
        return Role(text)
    except ValueError:
        raise InvalidInput(f"unknown role {text!r} (roles: {', '.join(r.value for r in Role)})") from None


def bearer(metadata: Any) -> str:
    """The bearer token of a call's metadata, or ''."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return value[7:].strip()
    return ""


# ---------------------------------------------------------------- the table


async def register_token(pool: Pool, role: Role, name: str, token: str, *, created_by: str = "") -> Identity:
    """Store a token's hash under ``name`` (Conflict when a live token has the name or
    the token is already registered)."""
    if not token.startswith(TOKEN_PREFIX) or len(token) < len(TOKEN_PREFIX) + 32:
        raise InvalidInput(f"a token is {TOKEN_PREFIX!r} followed by at least 32 random characters")
    if not name.strip():
        raise InvalidInput("a token needs a name")
    refused = f"token {name!r} not registered: a live token has that name, or the token is known"
    try:
        async with _autocommit(pool) as conn:
            token_id = await _tokens().register(conn, name, role.value, token_sha256(token), created_by or None)
    except Conflict as exc:
        raise Conflict(refused) from exc
    if token_id is None:
        raise Conflict(refused)
    return Identity(int(token_id), name, role)


async def revoke_token(pool: Pool, name: str) -> bool:
    async with _autocommit(pool) as conn:
        return bool(await _tokens().revoke(conn, name))


async def list_tokens(pool: Pool, include_revoked: bool) -> list[dict[str, Any]]:
    async with _autocommit(pool) as conn:
        return list(await _tokens().listed(conn, include_revoked))


class TokenVerifier:
    """sha256(token) -> Identity from ``noetl.api_token``, cached ``cache_sec`` (misses too,
    so a flood of bad tokens costs one query per distinct token per period)."""

    def __init__(self, pool: Pool, *, cache_sec: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._cache_sec = cache_sec
        self._clock = clock
        self._cache: dict[str, tuple[Identity | None, float]] = {}

    async def verify(self, token: str) -> Identity | None:
        if not token.startswith(TOKEN_PREFIX):
            return None
        digest = token_sha256(token)
        now = self._clock()
        hit = self._cache.get(digest)
        if hit is not None and now < hit[1]:
            return hit[0]
        async with _autocommit(self._pool) as conn:
            # noetl.token_identity (migration 0009): the roles may look a hash up, not read the table
            row = await _tokens().identity(conn, digest)
        identity = Identity(int(row["token_id"]), row["name"], Role(row["role"])) if row else None
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (identity, now + self._cache_sec)
        return identity


# ---------------------------------------------------------------- server side


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a valid token, PERMISSION_DENIED when its role may not call
    the method (or the method is not in METHOD_ROLES). The caller's Identity is
    ``auth.current`` inside the handler."""

    def __init__(self, verify: Callable[[str], Awaitable[Identity | None]],
                 roles: Mapping[str, frozenset[Role]] = METHOD_ROLES) -> None:
        self._verify = verify
        self._roles = roles

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        allowed = self._roles.get(method)
        token = bearer(handler_call_details.invocation_metadata)

        async def check(context: grpc.aio.ServicerContext) -> Identity:
            if allowed is None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method} is not open to any token")
            if not token:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "no token: send `authorization: Bearer <token>` metadata")
            try:
                identity = await self._verify(token)
            except Exception as exc:  # the token table unreachable: not the caller's fault
                logger.warning("verifying a token failed: %s", exc)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot verify tokens now: {exc}")
            if identity is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown or revoked token")
            assert identity is not None and allowed is not None
            if identity.role not in allowed:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"a {identity.role.value} token may not call {method.rsplit('/', 1)[-1]}"
                                    f" (allowed: {', '.join(sorted(r.value for r in allowed))})")
            return identity

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                reset = current.set(await check(context))
                try:
                    return await inner_uu(request, context)
                finally:
                    current.reset(reset)

            return rewrapped(handler, unary_unary=unary_unary)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                reset = current.set(await check(context))
                try:
                    async for item in inner_us(request, context):
                        yield item
                finally:
                    current.reset(reset)

            return rewrapped(handler, unary_stream=unary_stream)
        return handler


def require_identity() -> Identity | None:
    """The caller of the RPC being served (None when authorization is off)."""
    return current.get()


def own_or_admin(submitted_by: int | None) -> None:
    """A `submit` token acts on its own executions only; admin and worker on any."""
    who = current.get()
    if who is None or who.role in (Role.ADMIN, Role.WORKER):
        return
    if submitted_by is None or who.token_id != submitted_by:
        raise NotFound("no such execution for this token")


# ---------------------------------------------------------------- client side


class _ClientAuth(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = (METADATA_KEY, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        md = grpc.aio.Metadata(*(details.metadata or ()), self._md)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                          details.wait_for_ready)

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


def client_interceptors(token: str) -> list[Any]:
    """Interceptors of an aio channel that send ``token`` with every call (none without one)."""
    return [_ClientAuth(token)] if token else []


# ---------------------------------------------------------------- claim tokens


def claim_token(key: bytes, command_id: str, attempt: int, worker_id: str) -> str:
    """The proof a claim hands its worker (HMAC-SHA256 of command, attempt and worker);
    the engine accepts a result only with the token of its command's attempt and worker."""
    mac = hmac.new(key, f"{command_id}#{attempt}#{worker_id}".encode(), hashlib.sha256)
    return mac.hexdigest()[:40]


def claim_token_valid(key: bytes, token: str, command_id: str, attempt: int, worker_id: str) -> bool:
    return hmac.compare_digest(token, claim_token(key, command_id, attempt, worker_id))


async def runtime_secret(pool: Pool, name: str, size: int = 32) -> bytes:
    """A key the runtime keeps for itself in ``noetl.runtime_secret`` (created once, by
    whichever process asks first; every replica then reads the same one)."""
    async with _autocommit(pool) as conn:
        return bytes(await _tokens().runtime_secret(conn, name, secrets.token_bytes(size)))
