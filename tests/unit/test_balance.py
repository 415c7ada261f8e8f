"""``balance.assign``: every shard to a live member, balanced within one, stable when
nothing changes, and moving no more shards than any balanced assignment must."""

from __future__ import annotations

import itertools
import random

import pytest

from noetl_shard_manager.balance import assign


def loads(target: dict[int, int], members: list[int]) -> dict[int, int]:
    return {m: sum(1 for o in target.values() if o == m) for m in members}


def moves(current: dict[int, int | None], target: dict[int, int]) -> int:
    return sum(1 for s, o in target.items() if current.get(s) != o)


def fewest_moves(shard_count: int, members: list[int], current: dict[int, int | None]) -> int:
    """Brute force: over every balanced quota split, the most shards that can stay put."""
    held = {m: sum(1 for o in current.values() if o == m) for m in members}
    base, extra = divmod(shard_count, len(members))
    best_kept = max(
        sum(min(held[m], base + (1 if m in plus else 0)) for m in members)
        for plus in itertools.combinations(members, extra)
    )
    return shard_count - best_kept


def random_case(rng: random.Random) -> tuple[int, list[int], dict[int, int | None]]:
    shard_count = rng.randint(1, 24)
    members = sorted(rng.sample(range(1, 30), rng.randint(1, 6)))
    owners: list[int | None] = [*members, *rng.sample(range(30, 40), 2), None]  # some dead, some unowned
    current = {s: rng.choice(owners) for s in range(shard_count)}
    return shard_count, members, current


def test_no_members_no_assignment() -> None:
    assert assign(8, [], {0: 1}) == {}


def test_fresh_assignment_is_balanced_and_complete() -> None:
    target = assign(16, [3, 1, 2], {})
    assert sorted(target) == list(range(16))
    assert sorted(loads(target, [1, 2, 3]).values()) == [5, 5, 6]


@pytest.mark.parametrize("seed", range(4))
def test_random_cases_balanced_stable_minimal(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        shard_count, members, current = random_case(rng)
        case = f"assign({shard_count}, {members}, {current})"
        target = assign(shard_count, members, current)

        assert sorted(target) == list(range(shard_count)), case
        assert set(target.values()) <= set(members), case
        counts = loads(target, members).values()
        assert max(counts) - min(counts) <= 1, case
        assert moves(current, target) == fewest_moves(shard_count, members, current), case
        # nothing changed: nothing moves
        assert assign(shard_count, members, target) == target, case
        assert assign(shard_count, list(reversed(members)), target) == target, case


def test_join_and_leave_move_the_minimum() -> None:
    before = assign(12, [1, 2, 3], {})
    joined = assign(12, [1, 2, 3, 4], before)
    assert moves(before, joined) == 3  # 4/4/4 -> 3/3/3/3: one from each
    assert all(joined[s] == before[s] for s in joined if joined[s] != 4)
    left = assign(12, [1, 2, 4], joined)
    assert moves(joined, left) == 3  # only member 3's shards move
    assert {s for s in left if left[s] != joined[s]} == {s for s, o in joined.items() if o == 3}
