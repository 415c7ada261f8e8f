"""A generator rebound to a new node id (the process rejoined) stamps the new node and
keeps its clock watermark."""

from __future__ import annotations

import pytest

from noetl_common.ids import NODE_BITS, SEQ_BITS, SnowflakeGenerator


def node_of(snowflake: int) -> int:
    return (snowflake >> SEQ_BITS) & ((1 << NODE_BITS) - 1)


def test_rebind_switches_the_node_and_keeps_the_clock_watermark() -> None:
    clock = iter([1000, 1000, 999, 1001])
    gen = SnowflakeGenerator(5, clock_ms=lambda: next(clock))
    a, b = gen.next_id(), gen.next_id()
    gen.rebind(9)
    c, d = gen.next_id(), gen.next_id()  # the clock stepped back: still after b
    assert [node_of(x) for x in (a, b, c, d)] == [5, 5, 9, 9]
    assert gen.node_id == 9
    assert a < b < c < d and len({a, b, c, d}) == 4
    assert c >> (NODE_BITS + SEQ_BITS) == b >> (NODE_BITS + SEQ_BITS)  # not before the last id's ms


def test_rebind_rejects_a_node_out_of_range() -> None:
    with pytest.raises(ValueError):
        SnowflakeGenerator(1).rebind(1 << NODE_BITS)
