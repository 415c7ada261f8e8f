"""The CLI's blocking channel to the api (or the shard-manager), and the one place its
gRPC errors become project errors with a message that says what is wrong.

Three failures look alike on the wire and are told apart here:

- the api cannot be reached (nothing listens, every replica refuses, or it accepts TCP
  but never answers: a stopped process, a partition): ``Unavailable("cannot reach the
  api at X ...")``, at once when refused and after ``CONNECT_TIMEOUT`` when it hangs,
  not after the call's 30 s deadline;
- the api answered but cannot serve the request (UNAVAILABLE such as ``postgres
  unavailable: ...``, RESOURCE_EXHAUSTED, a DEADLINE_EXCEEDED of its own):
  ``CannotServe`` / ``Overloaded`` with the server's message, "the api cannot serve the
  request: ...";
- the api did not answer within the call's deadline: ``Unavailable("the api at X did
  not answer within 30s")``.

Which side an UNAVAILABLE came from is decided by asking the server's grpc.health.v1
right after: a server that answers it is up, so the UNAVAILABLE was its own.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from noetl_client import ApiError, Client
from noetl_common import grpcclient, grpcretry
from noetl_common.errors import ConfigError, NoetlError, Overloaded, Unavailable

if TYPE_CHECKING:
    from noetl_proto.v1 import (
        auth_pb2_grpc,
        catalog_pb2_grpc,
        concurrency_pb2_grpc,
        deadletter_pb2_grpc,
        execution_pb2_grpc,
        schedule_pb2_grpc,
        shard_manager_pb2_grpc,
    )

T = TypeVar("T")

RPC_TIMEOUT = 30.0
CONNECT_TIMEOUT = 5.0
_GRPC_DEADLINE_TEXT = "Deadline Exceeded"  # what gRPC says when the client's own deadline passed


class CannotServe(Unavailable):
    """The api (or shard-manager) answered, but a dependency of it is down (e.g. Postgres)."""


def describe_failure(code: grpc.StatusCode | None, details: str, *, answered: bool, what: str = "api",
                     target: str = "", source: str = "", timeout: float = RPC_TIMEOUT) -> NoetlError | None:
    """The project error for a failed call when its status is about reachability or
    capacity (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED); None for any other
    status (``grpcclient.translate`` maps those). ``answered``: the connection to the
    server was up when the call failed (the status came from the server)."""
    where = f" (from {source})" if source else ""
    details = details or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        if answered:
            return CannotServe(f"the {what} cannot serve the request: {details or 'unavailable'}")
        return Unavailable(f"cannot reach the {what} at {target}{where}: {details or 'unavailable'}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if answered and details and details != _GRPC_DEADLINE_TEXT:
            return CannotServe(f"the {what} cannot serve the request: {details}")
        return Unavailable(f"the {what} at {target}{where} did not answer within {timeout:g}s")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"the {what} cannot serve the request: {details or 'overloaded'}")
    return None


def _read_ca(path: str) -> bytes:
    try:
        return grpcclient.read_file(path)
    except ConfigError as exc:
        raise Unavailable(f"the CA file: {exc}") from exc


# what a subcommand module gets to run its call: ``run(args, fn)`` calls ``fn`` with the api
WithApi = Callable[[Any, Callable[["Api"], int]], int]


class Api:
    """Stubs of the services over one channel to ``target`` (the api's, or with
    ``what="shard-manager"`` the shard-manager's): a ``noetl_client.Client`` (its channel:
    TLS, token, retries; its calls: ``client``), plus the stubs the client package does
    not carry (health, shard-manager). The first call first asks the server's
    grpc.health.v1 (every role serves it), for at most ``connect_timeout``."""

    def __init__(self, target: str, source: str = "", what: str = "api",
                 connect_timeout: float | None = None, token: str = "", ca_file: str = "") -> None:
        self.target = target
        self.source = source
        self.what = what
        self.connect_timeout = CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
        # the client package's channel: round robin over replicas, transparent retries on
        # UNAVAILABLE of the idempotent methods only, keepalive (a replica that froze is
        # dropped within seconds), TLS trusting ca_file when given (the local stack's CA,
        # NOETL_TLS_CA_FILE), the token (bearer metadata) on every call
        self.client = Client(target, token=token, root_certificates=_read_ca(ca_file) if ca_file else None,
                             timeout=RPC_TIMEOUT)
        self.channel = self.client.channel
        self._connected = False
        self.health = health_pb2_grpc.HealthStub(self.channel)

    # The stubs, the client package's made on first use (a command loads only the generated
    # modules of the services it calls).

    @property
    def executions(self) -> execution_pb2_grpc.ExecutionServiceStub:
        return self.client.executions

    @property
    def catalog(self) -> catalog_pb2_grpc.CatalogServiceStub:
        return self.client.catalog

    @property
    def credentials(self) -> catalog_pb2_grpc.CredentialServiceStub:
        return self.client.credentials

    @property
    def tokens(self) -> auth_pb2_grpc.AuthServiceStub:
        return self.client.tokens

    @property
    def schedules(self) -> schedule_pb2_grpc.ScheduleServiceStub:
        return self.client.schedules

    @property
    def concurrency(self) -> concurrency_pb2_grpc.ConcurrencyServiceStub:
        return self.client.concurrency

    @property
    def dead_letters(self) -> deadletter_pb2_grpc.DeadLetterServiceStub:
        return self.client.dead_letters

    @cached_property
    def shard_manager(self) -> shard_manager_pb2_grpc.ShardManagerServiceStub:
        from noetl_proto.v1 import shard_manager_pb2_grpc

        return shard_manager_pb2_grpc.ShardManagerServiceStub(self.channel)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _where(self) -> str:
        return f" (from {self.source})" if self.source else ""

    def answers(self, timeout: float) -> grpc.StatusCode | None:
        """Ask the server's health service: None when it answered (whatever its status
        or the RPC's outcome), else the status code of the failure (UNAVAILABLE: refused
        or lost; DEADLINE_EXCEEDED: it did not answer in ``timeout``)."""
        try:
            self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            if grpcretry.grpc_transient(exc):  # refused, lost, or no answer in time
                return exc.code()  # type: ignore[attr-defined,no-any-return]
        return None

    def connect(self) -> None:
        """Once per channel, before the first call: fail fast when the server cannot be
        reached (refused at once; accepting connections but not answering within
        ``connect_timeout``) instead of after the call's own deadline. A refusal is left
        to the call that follows, which reports gRPC's reason."""
        if self._connected:
            return
        if self.answers(self.connect_timeout) == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Unavailable(f"cannot reach the {self.what} at {self.target}{self._where()}: no answer within "
                              f"{self.connect_timeout:g}s (a stopped or overloaded process, or the network)")
        self._connected = True

    def error(self, exc: grpc.RpcError | ApiError, timeout: float = RPC_TIMEOUT) -> NoetlError:
        """The project error for an RpcError, or the client package's ``ApiError`` of one
        (see the module docstring). For UNAVAILABLE the health service is asked (briefly)
        whether the server itself is reachable."""
        if isinstance(exc, ApiError) and isinstance(exc.__cause__, grpc.RpcError):
            exc = exc.__cause__
        if isinstance(exc, ApiError):
            code, details = exc.code, exc.details
        else:
            code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        answered = code != grpc.StatusCode.UNAVAILABLE or self.answers(min(2.0, self.connect_timeout)) is None
        described = describe_failure(code, details, answered=answered, what=self.what, target=self.target,
                                     source=self.source, timeout=timeout)
        if described is not None:
            return described
        return grpcclient.translate(exc) if isinstance(exc, grpc.RpcError) else NoetlError(details)

    def call(self, fn: Callable[..., T], request: Any, timeout: float = RPC_TIMEOUT) -> T:
        self.connect()
        try:
            return fn(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.error(exc, timeout) from exc

    def call_keyed(self, fn: Callable[..., T], request: Any, timeout: float = RPC_TIMEOUT) -> T:
        """``call`` of a submission (SubmitExecution, RerunExecution: ``grpcretry.KEYED``),
        repeated on a transient failure within ``timeout`` when ``request`` carries an
        idempotency key (``grpcretry.call_keyed``); the api answers a repeated key with the
        execution the first call made."""
        self.connect()
        try:
            return grpcretry.call_keyed(lambda left: fn(request, timeout=left), request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.error(exc, timeout) from exc
