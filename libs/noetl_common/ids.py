"""Identifiers: snowflake ids and the one shard-mixing hash.

Snowflake layout (63 bits, always positive in a signed BIGINT):

    | 41 bits: ms since NOETL_EPOCH | 10 bits: node id | 12 bits: sequence |

Ids are time-ordered, so `noetl.event` can be range-partitioned by
`execution_id` and an execution never straddles partitions.

`shard_for(execution_id, n)` uses splitmix64's finaliser (`mix64`), never
Python's `hash()` (the identity on ints). The SQL function `noetl.mix64(bigint)`
in the migrations computes the same value; a test pins the two together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

NOETL_EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
NODE_BITS = 10
SEQ_BITS = 12
MAX_NODE = (1 << NODE_BITS) - 1
MAX_SEQ = (1 << SEQ_BITS) - 1
_MASK64 = (1 << 64) - 1
# Node id reserved for shard-level system events (checkpoint barriers); never handed out.
SYSTEM_NODE = MAX_NODE


def mix64(value: int) -> int:
    """splitmix64 finaliser over the value's 64-bit two's complement; returns 0..2**64-1."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def shard_for(execution_id: int, shard_count: int) -> int:
    """The shard an execution belongs to. The same function everywhere, SQL included."""
    if shard_count <= 0:
        raise ValueError("shard_count must be positive")
    return mix64(execution_id) % shard_count


def snowflake_at(ms: int, node_id: int = 0, seq: int = 0) -> int:
    """The snowflake id for a wall-clock time in ms (used for partition bounds)."""
    return ((ms - NOETL_EPOCH_MS) << (NODE_BITS + SEQ_BITS)) | (node_id << SEQ_BITS) | seq


def snowflake_time(snowflake: int) -> datetime:
    """The creation time encoded in a snowflake id."""
    ms = (snowflake >> (NODE_BITS + SEQ_BITS)) + NOETL_EPOCH_MS
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class SnowflakeGenerator:
    """Thread-safe snowflake ids for one node. The node id must be unique among live
    generators (the shard-manager hands them out on Join)."""

    def __init__(self, node_id: int, clock_ms: Callable[[], int] | None = None) -> None:
        if not 0 <= node_id <= MAX_NODE:
            raise ValueError(f"node_id must be in 0..{MAX_NODE}, got {node_id}")
        self._node = node_id
        self._clock = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._lock = threading.Lock()
        self._last_ms = -1
        self._seq = 0

    @property
    def node_id(self) -> int:
        return self._node

    def rebind(self, node_id: int) -> None:
        """Switch to a new node id (the process rejoined and was handed another one).
        The clock watermark is kept: time never goes back across the switch."""
        if not 0 <= node_id <= MAX_NODE:
            raise ValueError(f"node_id must be in 0..{MAX_NODE}, got {node_id}")
        with self._lock:
            self._node = node_id

    def next_id(self) -> int:
        with self._lock:
            now = self._clock()
            if now < self._last_ms:  # clock stepped back: keep monotonic
                now = self._last_ms
            if now == self._last_ms:
                self._seq = (self._seq + 1) & MAX_SEQ
                if self._seq == 0:  # sequence exhausted in this ms: wait for the next
                    while now <= self._last_ms:
                        time.sleep(0.0001)
                        now = self._clock()
            else:
                self._seq = 0
            self._last_ms = now
            return snowflake_at(now, self._node, self._seq)


def barrier_execution_id(checkpoint_epoch: int, shard: int) -> int:
    """The synthetic execution id a shard's ``checkpoint.committed`` event is filed under:
    the epoch's timestamp on the reserved node, the shard as sequence. Deterministic per
    (epoch, shard), so a unique index makes the barrier exactly-once, and it lands in the
    partition of the epoch's day."""
    ms = (checkpoint_epoch >> (NODE_BITS + SEQ_BITS)) + NOETL_EPOCH_MS
    return snowflake_at(ms, SYSTEM_NODE, shard & MAX_SEQ)
