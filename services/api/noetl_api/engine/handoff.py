"""Handoff offers (docs/ARCHITECTURE.md "Handoff"): a worker's result may carry an offer to
take the command it leads to straight away. An offer that no command of its own result
took (the execution ended, or went on with a loop) is kept for a moment in its api
process, for the next command of any shard there that has no offer of its own: most
often an execution's first step.

An offer is worth one command. A kept one is given at most once and only while it is
fresh (``OFFER_TTL_SEC``): the worker made it while it had an idle slot for it, and a
stale offer could send a command to a worker that has since filled its slots or gone
(its command would then wait for a slot, or for its claim lease to expire).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from noetl_common import pools

# How long an offer no command took is kept for another one.
OFFER_TTL_SEC = 0.25
# At most this many kept offers per api process (the oldest go first).
MAX_KEPT = 256
# A command larger than this (serialised) is queued and claimed, not handed off: a handoff
# is one core-NATS message (the server refuses one past its max_payload, 1 MiB by default).
MAX_HANDOFF_BYTES = 256 * 1024


@dataclass(frozen=True)
class Offer:
    worker: str
    pools: tuple[str, ...]
    labels: Mapping[str, str]
    tools: tuple[str, ...]

    @classmethod
    def of(cls, result: Any) -> Offer | None:
        """The offer a ``CallResult`` carries, if any."""
        if not result.HasField("handoff") or not result.worker_id:
            return None
        h = result.handoff
        return cls(result.worker_id, tuple(h.pools), dict(h.labels), tuple(h.tools))

    def fits(self, pool: str, requires: Mapping[str, str] | None, kind: str) -> bool:
        """Whether the worker qualifies for the command (the claim's own rule)."""
        return pools.qualifies(self.pools, self.labels, self.tools, command_pool=pool, requires=requires, kind=kind)


class OfferBook:
    """The offers kept for a moment (one per api process, shared by its shard engines:
    they run on one event loop, so no lock)."""

    def __init__(self, ttl_sec: float = OFFER_TTL_SEC, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl_sec
        self._clock = clock
        self._kept: deque[tuple[float, Offer]] = deque(maxlen=MAX_KEPT)

    def __len__(self) -> int:
        self._expire()
        return len(self._kept)

    def keep(self, offer: Offer) -> None:
        self._kept.append((self._clock(), offer))

    def take(self, pool: str, requires: Mapping[str, str] | None, kind: str) -> Offer | None:
        """The newest offer whose worker qualifies for the command, removed (the newest:
        its worker is the likeliest to still have the slot it offered)."""
        self._expire()
        for i in range(len(self._kept) - 1, -1, -1):
            offer = self._kept[i][1]
            if offer.fits(pool, requires, kind):
                del self._kept[i]
                return offer
        return None

    def _expire(self) -> None:
        horizon = self._clock() - self._ttl
        while self._kept and self._kept[0][0] < horizon:
            self._kept.popleft()
