"""Which of the pool's priorities may have notices, and idle slots waiting for one.

A worker's slots take notices from their pool's consumers, one per priority
(``noetl_common.pools``), always asking the higher priority first, with ``no_wait`` pull
requests (``natsio.fetch_now``): no request lingers on the server, so a worker never
holds more notices than it has busy slots, and a priority found empty is not asked again
until there is a reason to.

    hint (a copy of a notice: core NATS ``noetl.commands.{pool}.*.*``)
        -> that priority "may have notices"; one idle slot is woken
    a fetch that came back empty -> that priority "has none" (unless a hint came meanwhile,
                                    or within HINT_GRACE_SEC before it: the core copy of a
                                    notice can arrive before JetStream has stored the
                                    notice, so the slot asks again in a few ms: ``fresh``)
    a fetch that got a notice    -> one more idle slot is woken (a backlog wakes them all)
    no hint for FETCH_POLL_SEC   -> backstop: every priority "may have notices" (hints are
                                    best effort: notices stored before this worker started
                                    or republished while it was disconnected)

Under a backlog of normal notices, busy slots ask only ``normal`` (one request per notice,
as with one shared consumer): ``high`` is asked again once a high notice's hint arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from noetl_common.pools import PRIORITIES

HINT_GRACE_SEC = 0.05  # how long after a hint an empty fetch is not believed


def queues(pools: tuple[str, ...]) -> list[str]:
    """A worker's consumers in fetch order, as ``pool.priority``: every priority, highest
    first, and within one priority its pools in the order it lists them."""
    return [f"{pool}.{priority}" for priority in PRIORITIES for pool in pools]


class Levels:
    """Keys are ``pool.priority`` (``queues``), in the order they are asked."""

    def __init__(self, keys: list[str], capacity: int, backstop_sec: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._hinted_at: dict[str, float] = dict.fromkeys(keys, float("-inf"))
        self.capacity = max(1, capacity)
        self.backstop_sec = backstop_sec
        self.maybe: dict[str, bool] = dict.fromkeys(keys, True)
        self._gen: dict[str, int] = dict.fromkeys(keys, 0)
        self._hints = 0
        self._event = asyncio.Event()
        self._backstop_at = 0.0

    def order(self) -> list[str]:
        """The queues to ask now, highest priority first."""
        return [k for k, maybe in self.maybe.items() if maybe]

    def generation(self, key: str) -> int:
        return self._gen[key]

    def hinted(self, key: str) -> None:
        if key not in self.maybe:
            return
        self._gen[key] += 1
        self._hinted_at[key] = self._clock()
        self.maybe[key] = True
        self.wake()

    def wake(self) -> None:
        """Let one more idle slot look (bounded: hints beyond the slots are not kept)."""
        self._hints = min(self._hints + 1, self.capacity)
        self._event.set()

    def empty(self, key: str, generation: int) -> None:
        """A fetch asked at ``generation`` found nothing: skip ``key`` until a hint."""
        if self._gen[key] == generation and self._clock() - self._hinted_at[key] >= HINT_GRACE_SEC:
            self.maybe[key] = False

    def fresh(self) -> bool:
        """A hint came within HINT_GRACE_SEC and its notice was not found yet: ask again soon."""
        now = self._clock()
        return any(maybe and now - self._hinted_at[k] < HINT_GRACE_SEC for k, maybe in self.maybe.items())

    def backstop(self) -> bool:
        """True (and every priority may have notices again) at most once per backstop period."""
        now = time.monotonic()
        if now - self._backstop_at < self.backstop_sec:
            return False
        self._backstop_at = now
        for p in self.maybe:
            self.maybe[p] = True
        return True

    async def wait(self, seconds: float) -> bool:
        """Wait for a wake-up (True) or ``seconds`` (False)."""
        deadline = time.monotonic() + seconds
        while self._hints == 0:
            self._event.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._event.wait(), remaining)
            except TimeoutError:
                return False
        self._hints -= 1
        return True
