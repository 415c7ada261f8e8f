"""How a worker's slots take notices from their pools' consumers, one per priority.

A slot with nothing to do asks for one notice in two ways (``WorkerService._next_notice``):

    drain   ``no_wait`` pull requests (``natsio.fetch_now``), highest priority first: the
            first consumer with a notice gives it; the server answers at once either way.
            A consumer found empty is not asked again by any slot for EMPTY_TTL_SEC (under
            a backlog of normal notices a busy slot makes one request per notice, not one
            per priority), so a high notice queued meanwhile waits at most that long
            behind a normal one.
    wait    when the drain found nothing: one long pull request per consumer, all at once,
            answering to one fresh inbox (``natsio.fetch_first``). The first notice any
            consumer has goes to the slot as soon as it is stored; the other requests are
            withdrawn then (the server drops a request nobody listens for) and a notice
            that crossed the withdrawal is nak'ed for another slot at once. A request
            expires after WAIT_SEC and the slot drains and waits again.

So an idle worker hears of a notice when the server delivers it (no hint, no poll), a
worker holds a notice only while a slot is free for it, and a backlog is taken in
priority order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from noetl_common.pools import PRIORITIES

EMPTY_TTL_SEC = 0.05  # how long a consumer found empty is not asked by a draining slot
WAIT_SEC = 5.0        # how long an idle slot's pull requests wait on the server


def queues(pools: tuple[str, ...]) -> list[str]:
    """A worker's consumers in fetch order, as ``pool.priority``: every priority, highest
    first, and within one priority its pools in the order it lists them."""
    return [f"{pool}.{priority}" for priority in PRIORITIES for pool in pools]


def queue_of(subject: str) -> str:
    """The ``pool.priority`` of a notice's subject ``noetl.commands.{pool}.{priority}.{shard}``."""
    parts = subject.split(".")
    return f"{parts[2]}.{parts[3]}" if len(parts) == 5 else ""


class Queues:
    """The worker's consumers (``queues``) and when each was last found empty, shared by
    its slots."""

    def __init__(self, keys: list[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.keys = keys
        self._clock = clock
        self._empty_at: dict[str, float] = dict.fromkeys(keys, float("-inf"))

    def to_drain(self) -> list[str]:
        """The consumers a draining slot asks, highest priority first."""
        now = self._clock()
        return [k for k in self.keys if now - self._empty_at[k] >= EMPTY_TTL_SEC]

    def found_empty(self, key: str) -> None:
        self._empty_at[key] = self._clock()

    def found_notice(self, key: str) -> None:
        """A notice came from ``key``: there may be more (draining slots ask it again)."""
        if key in self._empty_at:
            self._empty_at[key] = float("-inf")
