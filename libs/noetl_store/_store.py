"""The result store interface, an in-memory tier (tests, embedded use) and a
read-through LRU cache.

Results are immutable once written, so caching by ``ref_id`` is always safe: dropping
the cache changes latency only. Values handed out by ``get`` are shared with the cache
and must be treated as read-only.

Result size limit: a tier built with ``max_bytes`` > 0 refuses a value whose encoded JSON
is larger (``ResultStore.encode`` raises ``ResultTooLarge`` before anything is written).
Every value a tier stores is encoded there, once, so that is where the limit is exact.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from noetl_common.codec import decode_json, encode_json
from noetl_common.errors import InvalidInput, NotFound

from ._metrics import CACHE, RESOLVE_SECONDS

# The setting that bounds one result (noetl_common.config.LimitSettings.result_bytes).
RESULT_BYTES_SETTING = "NOETL_LIMIT_RESULT_BYTES"


class ResultTooLarge(InvalidInput):
    """A task's result is larger (encoded JSON, in bytes) than the result size limit.

    The task's own failure, not the store's: never retried, never
    ``REFERENCE_NOT_AVAILABLE`` (the worker reports it as ``RESULT_TOO_LARGE``). ``exact``
    is False when ``size`` is only what was seen before reading stopped (a lower bound)."""

    def __init__(self, size: int, limit: int, *, task: str = "", exact: bool = True) -> None:
        self.size = size
        self.limit = limit
        self.task = task
        self.exact = exact
        what = f"result of task '{task}'" if task else "result"
        super().__init__(f"{what} is {'' if exact else 'at least '}{size} bytes; "
                         f"limit {RESULT_BYTES_SETTING}={limit}")

    def for_task(self, task: str) -> ResultTooLarge:
        """The same error naming ``task`` (tools raise it without knowing the task's name)."""
        if self.task or not task:
            return self
        return ResultTooLarge(self.size, self.limit, task=task, exact=self.exact)

    def details(self) -> dict[str, Any]:
        return {"size_bytes": self.size, "size_exact": self.exact, "limit_bytes": self.limit,
                "setting": RESULT_BYTES_SETTING}


def check_result_size(size: int, limit: int, *, task: str = "", exact: bool = True) -> None:
    """Raise ``ResultTooLarge`` when ``size`` bytes exceed ``limit`` (0 = no limit)."""
    if limit > 0 and size > limit:
        raise ResultTooLarge(size, limit, task=task, exact=exact)


@dataclass(frozen=True, slots=True)
class Reference:
    """Where a result payload lives: ``type`` is the tier ("db", ...), ``uri`` its address.
    ``size``: the payload's encoded bytes when this process has just written it (``put``);
    0 when unknown (a reference read back from an event). Not part of the reference's
    identity nor of its JSON form."""

    ref_id: int
    type: str
    uri: str
    size: int = field(default=0, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"ref_id": self.ref_id, "type": self.type, "uri": self.uri}

    @classmethod
    def from_json(cls, data: Any) -> Reference:
        """Parse ``{"ref_id", "type"?, "uri"?}``; raises ValueError on anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("ref_id"), int):
            raise ValueError(f"not a result reference: {data!r}")
        return cls(int(data["ref_id"]), str(data.get("type") or "db"), str(data.get("uri") or ""))


class ResultStore(abc.ABC):
    """Stores result payloads and hands out references (persist-before-emit)."""

    # Largest encoded value a tier stores (0 = no limit); see ``encode``.
    max_bytes: int = 0

    @abc.abstractmethod
    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        """Store ``value`` (JSON-encoded with ``encode_json``) and return its reference.
        Raises ResultTooLarge (nothing written) when the encoded value exceeds the tier's
        ``max_bytes``, NotFound when ``parent_ref_id`` does not exist, Unavailable/NoetlError
        when the tier fails; never returns without having stored the value."""

    def encode(self, value: Any, *, task: str = "") -> bytes:
        """``value`` as the bytes a tier stores; ``ResultTooLarge`` beyond ``max_bytes``."""
        data = encode_json(value)
        check_result_size(len(data), self.max_bytes, task=task)
        return data

    @abc.abstractmethod
    async def get(self, ref_id: int) -> Any:
        """The decoded value of a reference; NotFound when there is none (or its payload
        is not readable from this tier)."""

    async def get_many(self, ref_ids: Iterable[int]) -> dict[int, Any]:
        """Values of the references that exist, by ref id. Missing ids are left out (the
        caller decides whether that is an error); ``get`` raises NotFound instead."""
        out: dict[int, Any] = {}
        for ref_id in dict.fromkeys(ref_ids):
            try:
                out[ref_id] = await self.get(ref_id)
            except NotFound:
                continue
        return out

    async def get_many_sized(self, ref_ids: Iterable[int]) -> dict[int, tuple[Any, int]]:
        """``get_many`` with each value's encoded size in bytes (what a cache in front
        bounds itself by). Tiers that read the encoded bytes anyway report their length;
        this default encodes the value again to measure it."""
        return {i: (v, len(encode_json(v))) for i, v in (await self.get_many(ref_ids)).items()}

    async def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources the store owns (pools passed in are not closed)."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class _MemoryRow:
    data: bytes
    parent_ref_id: int | None
    execution_id: int
    step: str
    command_id: str
    task: str


class MemoryResultStore(ResultStore):
    """Process-local tier: for unit tests and single-process tooling. Not durable."""

    TIER = "memory"

    def __init__(self, *, max_bytes: int = 0) -> None:
        self._rows: dict[int, _MemoryRow] = {}
        self._ids = itertools.count(1)
        self.max_bytes = max_bytes

    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        data = self.encode(value, task=task)
        if parent_ref_id is not None and parent_ref_id not in self._rows:
            raise NotFound(f"parent result reference {parent_ref_id} not found")
        ref_id = next(self._ids)
        self._rows[ref_id] = _MemoryRow(data, parent_ref_id, execution_id, step, command_id, task)
        return Reference(ref_id, self.TIER, f"memory://{ref_id}", len(data))

    async def get(self, ref_id: int) -> Any:
        row = self._rows.get(ref_id)
        if row is None:
            raise NotFound(f"result reference {ref_id} not found")
        return decode_json(row.data)

    def parent_of(self, ref_id: int) -> int | None:
        return self._rows[ref_id].parent_ref_id

    def __len__(self) -> int:
        return len(self._rows)


# ``CachedResultStore``'s name in noetl_result_cache_requests_total{cache} and the tier it
# reports in noetl_reference_resolve_seconds{tier} for what it serves.
PROCESS_CACHE = "process"
# The largest result (encoded bytes) ``CachedResultStore.put`` keeps as it writes it:
# decoded, a value takes several times its JSON size, and a worker keeps 256 of them.
PUT_CACHE_BYTES = 16 * 1024
# What ``CachedResultStore`` keeps in all, in encoded bytes (a result may be up to
# NOETL_LIMIT_RESULT_BYTES, 32 MiB by default: counted by items alone, 2,048 of them could
# take an api's memory). A value larger than a sixteenth of it is served but not kept.
CACHE_BYTES = 64 * 1024 * 1024


class CachedResultStore(ResultStore):
    """Read-through LRU cache over another store, keyed by ``ref_id`` (results are
    immutable). ``put`` writes through, and also keeps a written value of at most
    ``put_cache_bytes`` encoded bytes (``Reference.size``): the next step of a chain often
    runs in the same process and reads it back at once (one Postgres read per step
    saved). What it keeps is the value as a read would return it (decoded from its
    encoding, so a tuple is a list, a datetime its text): dropping the cache changes
    latency only. Larger values are not kept on put (a loop's thousand results would
    crowd out what is read); reading one caches it as before.

    Bounded twice: at most ``max_items`` values and ``max_bytes`` encoded bytes in all
    (the least recently used go first); a value larger than ``max_bytes // 16`` is served
    but not kept, so one large result cannot flush the rest."""

    def __init__(self, inner: ResultStore, max_items: int = 1024, *, put_cache_bytes: int = PUT_CACHE_BYTES,
                 max_bytes: int = CACHE_BYTES) -> None:
        if max_items < 1:
            raise ValueError("max_items must be at least 1")
        if max_bytes < 16:
            raise ValueError("max_bytes must be at least 16")
        self.inner = inner
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_bytes // 16
        self.put_cache_bytes = min(put_cache_bytes, self.max_entry_bytes)
        self._cache: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self.bytes = 0  # encoded bytes of what is kept
        self.hits = 0
        self.misses = 0

    def _remember(self, ref_id: int, value: Any, size: int) -> None:
        if size > self.max_entry_bytes:
            return
        old = self._cache.pop(ref_id, None)
        if old is not None:
            self.bytes -= old[1]
        self._cache[ref_id] = (value, size)
        self.bytes += size
        while len(self._cache) > self.max_items or self.bytes > self.max_bytes:
            _, (_, gone) = self._cache.popitem(last=False)
            self.bytes -= gone

    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        ref = await self.inner.put(value, execution_id=execution_id, step=step, command_id=command_id,
                                   task=task, parent_ref_id=parent_ref_id)
        if 0 < ref.size <= self.put_cache_bytes:
            self._remember(ref.ref_id, decode_json(encode_json(value)), ref.size)
        return ref

    async def get(self, ref_id: int) -> Any:
        start = time.perf_counter()
        if ref_id in self._cache:
            self._hit(1, start)
            self._cache.move_to_end(ref_id)
            return self._cache[ref_id][0]
        self._missed(1)
        found = await self.inner.get_many_sized([ref_id])
        if ref_id not in found:
            return await self.inner.get(ref_id)  # raises the tier's own NotFound
        value, size = found[ref_id]
        self._remember(ref_id, value, size)
        return value

    async def get_many(self, ref_ids: Iterable[int]) -> dict[int, Any]:
        start = time.perf_counter()
        ids = list(dict.fromkeys(ref_ids))
        out: dict[int, Any] = {}
        missing: list[int] = []
        for ref_id in ids:
            if ref_id in self._cache:
                self._cache.move_to_end(ref_id)
                out[ref_id] = self._cache[ref_id][0]
            else:
                missing.append(ref_id)
        if out:
            self._hit(len(out), start)
        if missing:
            self._missed(len(missing))
            for ref_id, (value, size) in (await self.inner.get_many_sized(missing)).items():
                self._remember(ref_id, value, size)
                out[ref_id] = value
        return {i: out[i] for i in ids if i in out}

    def _hit(self, n: int, start: float) -> None:
        """``n`` references served from memory (one resolve observed per call, as the
        tiers observe theirs)."""
        self.hits += n
        CACHE.labels(PROCESS_CACHE, "hit").inc(n)
        RESOLVE_SECONDS.labels(PROCESS_CACHE).observe(time.perf_counter() - start)

    def _missed(self, n: int) -> None:
        self.misses += n
        CACHE.labels(PROCESS_CACHE, "miss").inc(n)

    async def close(self) -> None:
        self._cache.clear()
        self.bytes = 0
        await self.inner.close()

    def __len__(self) -> int:
        return len(self._cache)
