"""``Client``: a blocking client of the runtime's api over one channel (TLS, token,
retries: ``channel``), with the calls most programs need (submit, watch, wait, get,
result, cancel) and the generated stubs of every client service for the rest."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from noetl_proto.v1 import execution_pb2, execution_pb2_grpc

if TYPE_CHECKING:
    from noetl_proto.v1 import (
        auth_pb2_grpc,
        catalog_pb2_grpc,
        concurrency_pb2_grpc,
        deadletter_pb2_grpc,
        schedule_pb2_grpc,
    )

from . import errors, retries
from .channel import open_channel
from .executions import is_terminal, results, submit_request

T = TypeVar("T")

RPC_TIMEOUT = 30.0
POLL_INTERVAL = 0.2
# How long polling goes on through transient failures (the api restarting) and NOT_FOUND
# (the read model not yet showing a fresh submission) before the failure is raised.
TRANSIENT_GRACE = 30.0


@dataclass(frozen=True)
class ClientConfig:
    """Where the api is and how to reach it; ``from_env`` reads what the CLI reads:

    ``NOETL_API``          the api's gRPC target, ``host:port`` (required)
    ``NOETL_TOKEN``        the bearer token to send ("" none)
    ``NOETL_TLS_CA_FILE``  the CA to trust; unset: plaintext (TLS with the system's
                           roots: ``Client(..., tls=True)``)
    """

    target: str
    token: str = ""
    ca_file: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientConfig:
        env = os.environ if environ is None else environ
        target = env.get("NOETL_API", "").strip()
        if not target:
            raise errors.ConfigError("NOETL_API is not set (the api's gRPC target, host:port)")
        return cls(target, token=env.get("NOETL_TOKEN", "").strip(), ca_file=env.get("NOETL_TLS_CA_FILE", ""))


class Client:
    """A blocking client of the api at ``target``.

    ``token``: sent as ``authorization: Bearer <token>`` with every call. TLS when
    ``ca_file`` (or ``root_certificates``, PEM bytes) names the CA to trust, or with
    ``tls=True`` against the system's roots; plaintext otherwise. ``timeout``: the
    deadline of each call, in seconds. Close it (or use ``with``) when done.

    Errors are ``noetl_client.errors.ApiError`` subclasses (``NotFound``,
    ``InvalidArgument``, ``Unavailable``, ...). Reads, watches and cancels are retried by
    the channel on UNAVAILABLE; a submission is repeated with its idempotency key.
    """

    def __init__(self, target: str, *, token: str = "", ca_file: str = "", root_certificates: bytes | None = None,
                 tls: bool = False, timeout: float = RPC_TIMEOUT, options: Sequence[tuple[str, Any]] = ()) -> None:
        if not target:
            raise errors.ConfigError("no api target (host:port)")
        if ca_file:
            try:
                with open(ca_file, "rb") as fh:
                    root_certificates = fh.read()
            except OSError as exc:
                raise errors.ConfigError(f"cannot read the CA file {ca_file}: {exc.strerror or exc}") from exc
        self.target = target
        self.timeout = timeout
        self.channel, self._raw_channel = open_channel(target, token=token, root_certificates=root_certificates,
                                                       tls=tls, options=options)
        self.executions = execution_pb2_grpc.ExecutionServiceStub(self.channel)

    # The other services' stubs are made on first use: their generated modules load then,
    # not with the package (a program that only reads executions does not pay for them).

    @cached_property
    def catalog(self) -> catalog_pb2_grpc.CatalogServiceStub:
        from noetl_proto.v1 import catalog_pb2_grpc

        return catalog_pb2_grpc.CatalogServiceStub(self.channel)

    @cached_property
    def credentials(self) -> catalog_pb2_grpc.CredentialServiceStub:
        from noetl_proto.v1 import catalog_pb2_grpc

        return catalog_pb2_grpc.CredentialServiceStub(self.channel)

    @cached_property
    def schedules(self) -> schedule_pb2_grpc.ScheduleServiceStub:
        from noetl_proto.v1 import schedule_pb2_grpc

        return schedule_pb2_grpc.ScheduleServiceStub(self.channel)

    @cached_property
    def dead_letters(self) -> deadletter_pb2_grpc.DeadLetterServiceStub:
        from noetl_proto.v1 import deadletter_pb2_grpc

        return deadletter_pb2_grpc.DeadLetterServiceStub(self.channel)

    @cached_property
    def concurrency(self) -> concurrency_pb2_grpc.ConcurrencyServiceStub:
        from noetl_proto.v1 import concurrency_pb2_grpc

        return concurrency_pb2_grpc.ConcurrencyServiceStub(self.channel)

    @cached_property
    def tokens(self) -> auth_pb2_grpc.AuthServiceStub:
        from noetl_proto.v1 import auth_pb2_grpc

        return auth_pb2_grpc.AuthServiceStub(self.channel)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> Client:
        """A client configured by ``NOETL_API``, ``NOETL_TOKEN`` and ``NOETL_TLS_CA_FILE``
        (``ClientConfig``); ``kwargs`` pass on (e.g. ``timeout``)."""
        config = ClientConfig.from_env(environ)
        return cls(config.target, token=config.token, ca_file=config.ca_file, **kwargs)

    def close(self) -> None:
        self._raw_channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: Any, request: Any, *, timeout: float | None = None) -> Any:
        """``method(request)`` (a stub's method), its RpcError translated."""
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise errors.translate(exc) from exc

    # ------------------------------------------------------------ executions

    def submit(self, playbook_yaml: str | None = None, *, path: str | None = None, version: int = 0,
               payload: Mapping[str, Any] | None = None, idempotency_key: str | None = None,
               timeout_seconds: float = 0.0, priority: str | None = None) -> execution_pb2.SubmitExecutionResponse:
        """Submit a playbook's YAML, or a registered one by catalog ``path`` (``version`` 0:
        the latest), with ``payload`` merged over its workload; returns once the api has
        committed it (``execution_id``, ``deduplicated``, ...). Repeated on a transient
        failure with the same idempotency key (one is made when none is given), so it
        never makes two executions. ``timeout_seconds``: the execution's own timeout (0:
        the server's default). Numbers in ``payload``: docs/CLIENTS.md."""
        request = submit_request(playbook_yaml, path=path, version=version, payload=payload,
                                 idempotency_key=idempotency_key, timeout_seconds=timeout_seconds, priority=priority)
        try:
            response: execution_pb2.SubmitExecutionResponse = retries.call_keyed(
                lambda left: self.executions.SubmitExecution(request, timeout=left), request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise errors.translate(exc) from exc
        return response

    def get(self, execution_id: int, *, include_results: bool = False) -> execution_pb2.Execution:
        """The execution as the read model has it (with each step's result when asked)."""
        response = self.call(self.executions.GetExecution, execution_pb2.GetExecutionRequest(
            execution_id=execution_id, include_results=include_results))
        return response.execution  # type: ignore[no-any-return]

    def watch(self, execution_id: int, *, include_results: bool = False, timeout: float | None = None,
              changes_only: bool = True) -> Iterator[execution_pb2.Execution]:
        """The execution's snapshots as it changes, ending with the terminal one (or when
        ``timeout`` seconds passed: the last one yielded is then not terminal).
        WatchExecution streams them; when the stream breaks (an api replica going away),
        GetExecution is polled instead, through transient failures for up to
        ``TRANSIENT_GRACE`` seconds. ``changes_only=False`` also yields polled snapshots
        that did not change."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last: list[execution_pb2.Execution | None] = [None]

        def fresh(execution: execution_pb2.Execution) -> bool:
            if changes_only and last[0] is not None and execution == last[0]:
                return False
            last[0] = execution
            return True

        def remaining() -> float | None:
            return None if deadline is None else deadline - time.monotonic()

        stream = self.executions.WatchExecution(execution_pb2.WatchExecutionRequest(
            execution_id=execution_id, include_results=include_results), timeout=remaining())
        try:
            for response in stream:
                if fresh(response.execution):
                    yield response.execution
                if is_terminal(response.execution):
                    return
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,  # type: ignore[attr-defined]
                              grpc.StatusCode.UNAUTHENTICATED):
                raise errors.translate(exc) from exc
        finally:
            stream.cancel()
        # the stream broke or ended early: poll the read model
        trouble_since: float | None = None
        while True:
            left = remaining()
            if left is not None and left <= 0:
                return
            try:
                response = self.executions.GetExecution(execution_pb2.GetExecutionRequest(
                    execution_id=execution_id, include_results=include_results),
                    timeout=self.timeout if left is None else max(0.1, min(self.timeout, left)))
            except grpc.RpcError as exc:
                again = retries.transient(exc) or exc.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
                trouble_since = trouble_since or time.monotonic()
                if not again or time.monotonic() - trouble_since > TRANSIENT_GRACE:
                    raise errors.translate(exc) from exc
                time.sleep(POLL_INTERVAL)
                continue
            trouble_since = None
            if fresh(response.execution) or not changes_only:
                yield response.execution
            if is_terminal(response.execution):
                return
            time.sleep(POLL_INTERVAL)

    def wait(self, execution_id: int, *, timeout: float | None = None) -> execution_pb2.Execution:
        """Follow the execution to its end; returns the terminal snapshot with every step's
        result. ``WaitTimeout`` when it did not end within ``timeout`` seconds."""
        final = None
        for snapshot in self.watch(execution_id, timeout=timeout):
            final = snapshot
        if final is None or not is_terminal(final):
            raise errors.WaitTimeout(f"execution {execution_id} did not end within {timeout:g}s")
        return self.get(execution_id, include_results=True)

    def run(self, playbook_yaml: str | None = None, *, path: str | None = None, version: int = 0,
            payload: Mapping[str, Any] | None = None, timeout: float | None = None,
            idempotency_key: str | None = None) -> execution_pb2.Execution:
        """``submit`` then ``wait``: the terminal execution, with results."""
        submitted = self.submit(playbook_yaml, path=path, version=version, payload=payload,
                                idempotency_key=idempotency_key)
        return self.wait(submitted.execution_id, timeout=timeout)

    def result(self, execution_id: int, step: str | None = None) -> Any:
        """Every step's result ({step: value}, steps without one left out), or ``step``'s
        (``NotFound`` when the execution has no such step; None when it has no result)."""
        execution = self.get(execution_id, include_results=True)
        found = results(execution)
        if step is None:
            return found
        if step not in {s.name for s in execution.steps}:
            raise errors.NotFound(grpc.StatusCode.NOT_FOUND, f"execution {execution_id} has no step {step!r}")
        return found.get(step)

    def cancel(self, execution_id: int, reason: str = "") -> bool:
        """Ask for the execution to be cancelled; False when it had already ended."""
        response = self.call(self.executions.CancelExecution,
                             execution_pb2.CancelExecutionRequest(execution_id=execution_id, reason=reason))
        return bool(response.accepted)
