"""Balanced shard assignment with minimal movement (pure).

Each live member gets ``N // M`` or ``N // M + 1`` shards. Members that already hold
more keep the larger quotas; a shard stays with its owner while the owner is live and
within quota; the rest go to the least-loaded members.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def assign(shard_count: int, members: Sequence[int], current: Mapping[int, int | None]) -> dict[int, int]:
    """Target owner per shard. ``current`` maps shard -> owner runtime id (or None)."""
    if not members:
        return {}
    live = sorted(set(members))
    held: dict[int, list[int]] = {m: [] for m in live}
    for shard in range(shard_count):
        owner = current.get(shard)
        if owner in held:
            held[owner].append(shard)
    base, extra = divmod(shard_count, len(live))
    # The members holding the most get the +1 quotas (fewest moves); ties by id.
    ranked = sorted(live, key=lambda m: (-len(held[m]), m))
    quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(ranked)}
    target: dict[int, int] = {}
    orphans: list[int] = []
    for m in live:
        keep = sorted(held[m])[: quota[m]]
        for shard in keep:
            target[shard] = m
    for shard in range(shard_count):
        if shard not in target:
            orphans.append(shard)
    load = {m: sum(1 for o in target.values() if o == m) for m in live}
    for shard in orphans:
        m = min((m for m in live if load[m] < quota[m]), key=lambda m: (load[m], m))
        target[shard] = m
        load[m] += 1
    return target
