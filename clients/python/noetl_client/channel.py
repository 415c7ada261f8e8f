"""The channel to the runtime's api: TLS (trusting a CA file, or the system's roots), the
bearer token on every call, keepalive, round robin over replicas and the retry policy
of ``retries``. The runtime's own clients (the CLI, the roles) use the same pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from . import retries

METADATA_KEY = "authorization"

# A peer that stops answering (SIGSTOP, a VM pause, a partition) still holds its TCP
# connections open: only HTTP/2 keepalive pings tell. While a call is in flight, a ping
# goes out after KEEPALIVE_MS without data and the connection is dropped when its ack
# does not come within KEEPALIVE_TIMEOUT_MS, so the call fails UNAVAILABLE, is retried on
# another replica, and round robin stops picking the frozen one (its reconnect never
# completes the HTTP/2 handshake).
KEEPALIVE_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
CLIENT_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # One ping is outstanding at a time: any ping (a BDP probe right after a call too) must
    # time out as fast as a keepalive ping, or it holds the keepalive back for its default
    # minute (measured: a frozen replica held every call routed to it for the call's
    # whole deadline).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]
def tls_target_name(target: str) -> str:
    """The name to verify the servers of an address-list target by (``ipv4:H:P1,H:P2``:
    gRPC would check the whole list as one name); "" for other targets (gRPC checks the
    target's own host)."""
    scheme, _, addresses = target.partition(":")
    if scheme not in ("ipv4", "ipv6") or not addresses:
        return ""
    first = addresses.split(",")[0]
    host = first.rsplit(":", 1)[0] if first.count(":") == 1 or first.startswith("[") else first
    return host.strip("[]")


def channel_options(*, ca_file_given: bool, target: str, max_message_bytes: int = 64 * 1024 * 1024,
                    extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """The options of a channel to the api: round robin over the target's addresses, the
    channel's transparent retry of the idempotent methods (``retries.service_config``),
    keepalive (a frozen replica is dropped within seconds), 64 MiB messages, and the TLS
    name to verify a replica list (``ipv4:H:P1,H:P2``) by."""
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", retries.service_config()),
        ("grpc.enable_retries", 1),
        *CLIENT_KEEPALIVE_OPTIONS,
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if ca_file_given and (name := tls_target_name(target)):
        options.append(("grpc.ssl_target_name_override", name))
    return [*options, *extra]


def open_channel(target: str, *, token: str = "", root_certificates: bytes | None = None, tls: bool = False,
                 options: Sequence[tuple[str, Any]] = ()) -> tuple[grpc.Channel, grpc.Channel]:
    """A blocking channel to ``target``: TLS when ``tls`` or ``root_certificates`` (the CA
    to trust; None: the system's roots), plaintext otherwise; every call carries
    ``token`` as ``authorization: Bearer`` metadata when there is one. Returns (the channel
    to make stubs on, the raw channel to close)."""
    secure = tls or root_certificates is not None
    opts = channel_options(ca_file_given=root_certificates is not None, target=target, extra=options)
    raw = (grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=opts) if secure
           else grpc.insecure_channel(target, options=opts))
    return (grpc.intercept_channel(raw, SyncClientAuth(token)) if token else raw), raw


class SyncClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Sends ``authorization: Bearer <token>`` with every call of a blocking channel
    (``grpc.intercept_channel(channel, SyncClientAuth(token))``)."""

    def __init__(self, token: str) -> None:
        self._md = (METADATA_KEY, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), self._md],
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


__all__ = ["CLIENT_KEEPALIVE_OPTIONS", "KEEPALIVE_MS", "KEEPALIVE_TIMEOUT_MS", "METADATA_KEY", "SyncClientAuth",
           "channel_options", "open_channel", "tls_target_name"]
