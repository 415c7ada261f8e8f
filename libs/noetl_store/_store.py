"""The result store interface, an in-memory tier (tests, embedded use) and a
read-through LRU cache.

Results are immutable once written, so caching by ``ref_id`` is always safe: dropping
the cache changes latency only. Values handed out by ``get`` are shared with the cache
and must be treated as read-only.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from noetl_common.errors import NotFound

from ._codec import decode_json, encode_json


@dataclass(frozen=True, slots=True)
class Reference:
    """Where a result payload lives: ``type`` is the tier ("db", ...), ``uri`` its address."""

    ref_id: int
    type: str
    uri: str

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

    @abc.abstractmethod
    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        """Store ``value`` (JSON-encoded with ``encode_json``) and return its reference.
        Raises NotFound when ``parent_ref_id`` does not exist, Unavailable/NoetlError when
        the tier fails; never returns without having stored the value."""

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

    def __init__(self) -> None:
        self._rows: dict[int, _MemoryRow] = {}
        self._ids = itertools.count(1)

    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        data = encode_json(value)
        if parent_ref_id is not None and parent_ref_id not in self._rows:
            raise NotFound(f"parent result reference {parent_ref_id} not found")
        ref_id = next(self._ids)
        self._rows[ref_id] = _MemoryRow(data, parent_ref_id, execution_id, step, command_id, task)
        return Reference(ref_id, self.TIER, f"memory://{ref_id}")

    async def get(self, ref_id: int) -> Any:
        row = self._rows.get(ref_id)
        if row is None:
            raise NotFound(f"result reference {ref_id} not found")
        return decode_json(row.data)

    def parent_of(self, ref_id: int) -> int | None:
        return self._rows[ref_id].parent_ref_id

    def __len__(self) -> int:
        return len(self._rows)


class CachedResultStore(ResultStore):
    """Read-through LRU cache over another store, keyed by ``ref_id`` (results are
    immutable). ``put`` writes through without caching: a result is usually read by
    another command, often on another worker, so caching it here would cost an extra
    encode for little gain."""

    def __init__(self, inner: ResultStore, max_items: int = 1024) -> None:
        if max_items < 1:
            raise ValueError("max_items must be at least 1")
        self.inner = inner
        self.max_items = max_items
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def _remember(self, ref_id: int, value: Any) -> None:
        self._cache[ref_id] = value
        self._cache.move_to_end(ref_id)
        while len(self._cache) > self.max_items:
            self._cache.popitem(last=False)

    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        return await self.inner.put(value, execution_id=execution_id, step=step, command_id=command_id,
                                    task=task, parent_ref_id=parent_ref_id)

    async def get(self, ref_id: int) -> Any:
        if ref_id in self._cache:
            self.hits += 1
            self._cache.move_to_end(ref_id)
            return self._cache[ref_id]
        self.misses += 1
        value = await self.inner.get(ref_id)
        self._remember(ref_id, value)
        return value

    async def get_many(self, ref_ids: Iterable[int]) -> dict[int, Any]:
        ids = list(dict.fromkeys(ref_ids))
        out: dict[int, Any] = {}
        missing: list[int] = []
        for ref_id in ids:
            if ref_id in self._cache:
                self.hits += 1
                self._cache.move_to_end(ref_id)
                out[ref_id] = self._cache[ref_id]
            else:
                missing.append(ref_id)
        if missing:
            self.misses += len(missing)
            fetched = await self.inner.get_many(missing)
            for ref_id, value in fetched.items():
                self._remember(ref_id, value)
            out.update(fetched)
        return {i: out[i] for i in ids if i in out}

    async def close(self) -> None:
        self._cache.clear()
        await self.inner.close()

    def __len__(self) -> int:
        return len(self._cache)
