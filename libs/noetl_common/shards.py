"""A member's side of shard ownership: the leases it holds for its role.

State of one shard at a member (River-style leases, ARCHITECTURE.md section 5):

    (not held) --assigned by leader--> renewing --renewed (epoch matches)--> HELD
        ^                                   |                                  |
        |                              0 rows: not ours                  renew loop
        +---------- released <-------------+---- 0 rows / past deadline ------+

* The member renews only the exact term it holds:
  ``UPDATE shard_lease ... WHERE role AND shard_id AND owner_runtime_id = me AND epoch = held``.
* It trusts a lease only until ``t0 + lease - margin`` on the monotonic clock, where
  ``t0`` is taken *before* the renewing statement was sent.
* Every write it makes for a shard is fenced separately, in the write's own
  transaction (``noetl_db.leases.fence``), so a stale holder's write fails even if its clock lies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from noetl_db import leases

from .db import Pool, transaction

logger = logging.getLogger(__name__)


@dataclass
class HeldShard:
    shard_id: int
    epoch: int
    valid_until: float  # monotonic


class ShardOwnership:
    def __init__(self, pool: Pool, role: str, *, lease_sec: float, margin_sec: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self.role = role
        self.lease_sec = lease_sec
        self.margin_sec = margin_sec
        self._clock = clock
        self.runtime_id = 0
        self._held: dict[int, HeldShard] = {}

    def epoch(self, shard_id: int) -> int | None:
        """The epoch held for a shard if the lease is still trusted, else None."""
        held = self._held.get(shard_id)
        if held is None or self._clock() >= held.valid_until:
            return None
        return held.epoch

    def held(self) -> dict[int, int]:
        now = self._clock()
        return {s: h.epoch for s, h in self._held.items() if now < h.valid_until}

    async def renew(self, wanted: dict[int, int] | None = None) -> tuple[dict[int, int], set[int]]:
        """Renew the leases in ``wanted`` (the leader's latest assignment; default: the
        ones held) and the runtime heartbeat. Afterwards exactly the renewed leases are held.

        Returns (gained {shard: epoch}, lost shard ids). A shard is lost when its renewal
        matched no row: it was reassigned (new epoch) or taken away.
        """
        target = dict(self._held_epochs() if wanted is None else wanted)
        t0 = self._clock()
        async with transaction(self._pool) as conn:
            renewed = await leases.renew(conn, self.role, self.runtime_id, self.lease_sec, target)
            await leases.heartbeat(conn, self.runtime_id)
        valid_until = t0 + self.lease_sec - self.margin_sec
        previous = self._held_epochs()
        gained = {s: e for s, e in renewed.items() if previous.get(s) != e}
        lost = {s for s, e in previous.items() if renewed.get(s) != e}
        self._held = {s: HeldShard(s, e, valid_until) for s, e in renewed.items()}
        return gained, lost

    def expire(self) -> set[int]:
        """Drop shards whose trust window ran out (the renew loop fell behind)."""
        now = self._clock()
        gone = {s for s, h in self._held.items() if now >= h.valid_until}
        for s in gone:
            self._held.pop(s)
        return gone

    def release(self, shards: set[int]) -> None:
        for s in shards:
            self._held.pop(s, None)

    def clear(self) -> set[int]:
        gone = set(self._held)
        self._held.clear()
        return gone

    def _held_epochs(self) -> dict[int, int]:
        return {s: h.epoch for s, h in self._held.items()}
