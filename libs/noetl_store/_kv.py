"""NATS KV as a read-through cache of result values (seed 004 invariant 3).

    get(ref) --KV hit--> value
             --miss---> inner store --> value (then written to KV if small enough)

Key = ref id (results are immutable, so a cached value can never be stale), bucket
``noetl_results`` by default, in-memory storage, history 1. The cache is never consulted
for anything but a value the inner store would return: a purged or deleted bucket, a
KV timeout, a NATS error, all read as a miss (the bucket is re-opened, or re-created, at
most every few seconds). Values above ``max_value_bytes`` (and NATS's max payload) are
not cached. ``put`` goes straight to the inner store (read-through, not write-through).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from noetl_common.codec import decode_json, encode_json

from ._metrics import CACHE, RESOLVE_SECONDS
from ._store import Reference, ResultStore

logger = logging.getLogger(__name__)

CACHE_NAME = "kv"
REOPEN_AFTER_SEC = 2.0
# Room for the message headers NATS adds to a KV entry.
PAYLOAD_HEADROOM = 4096


class KvCachedResultStore(ResultStore):
    """Read-through NATS KV cache over ``inner``."""

    def __init__(self, inner: ResultStore, js: JetStreamContext, *, bucket: str = "noetl_results",
                 max_value_bytes: int = 512 * 1024, timeout_sec: float = 2.0, ttl_sec: float = 0.0) -> None:
        self.inner = inner
        self.js = js
        self.bucket = bucket
        nc = getattr(js, "_nc", None)
        max_payload = int(getattr(nc, "max_payload", 0) or 0)
        self.max_value_bytes = min(max_value_bytes, max_payload - PAYLOAD_HEADROOM) if max_payload else max_value_bytes
        self.timeout_sec = timeout_sec
        self.ttl_sec = ttl_sec
        self._kv: KeyValue | None = None
        self._reopen_at = 0.0
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------ the bucket

    async def _bucket(self) -> KeyValue | None:
        if self._kv is not None:
            return self._kv
        async with self._lock:
            if self._kv is not None or time.monotonic() < self._reopen_at:
                return self._kv
            self._reopen_at = time.monotonic() + REOPEN_AFTER_SEC
            try:
                async with asyncio.timeout(self.timeout_sec):
                    try:
                        self._kv = await self.js.key_value(self.bucket)
                    except BucketNotFoundError:
                        self._kv = await self.js.create_key_value(KeyValueConfig(
                            bucket=self.bucket, history=1, max_value_size=self.max_value_bytes,
                            ttl=self.ttl_sec or None, storage=StorageType.MEMORY,
                            description="noetl result values (read-through cache; safe to purge)"))
            except (NatsError, TimeoutError, OSError) as exc:
                logger.warning("result cache: NATS KV bucket %s unavailable (%s); reading through", self.bucket,
                               exc)
            return self._kv

    def _forget_bucket(self, exc: BaseException) -> None:
        if self._kv is not None:
            logger.info("result cache: NATS KV %s failed (%s); reopening later", self.bucket, exc)
        self._kv = None

    async def create(self) -> bool:
        """Open (or create) the bucket now; False when NATS KV is not available."""
        return await self._bucket() is not None

    # ------------------------------------------------------------ lookups

    async def _lookup(self, kv: KeyValue, ref_id: int) -> tuple[bool, Any, int]:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_sec):
                entry = await kv.get(str(ref_id))
        except (KeyNotFoundError, KeyDeletedError):
            CACHE.labels(CACHE_NAME, "miss").inc()
            return False, None, 0
        except (NatsError, TimeoutError, OSError) as exc:
            self._forget_bucket(exc)
            CACHE.labels(CACHE_NAME, "error").inc()
            return False, None, 0
        if entry.value is None:
            CACHE.labels(CACHE_NAME, "miss").inc()
            return False, None, 0
        value = decode_json(entry.value)
        RESOLVE_SECONDS.labels(CACHE_NAME).observe(time.perf_counter() - start)
        CACHE.labels(CACHE_NAME, "hit").inc()
        return True, value, len(entry.value)

    async def _remember(self, kv: KeyValue | None, ref_id: int, value: Any) -> None:
        if kv is None:
            return
        data = encode_json(value)
        if len(data) > self.max_value_bytes:
            CACHE.labels(CACHE_NAME, "too_large").inc()
            return
        try:
            async with asyncio.timeout(self.timeout_sec):
                await kv.put(str(ref_id), data)
        except (NatsError, TimeoutError, OSError) as exc:
            self._forget_bucket(exc)

    # ------------------------------------------------------------ ResultStore

    async def put(self, value: Any, *, execution_id: int, step: str, command_id: str, task: str,
                  parent_ref_id: int | None) -> Reference:
        return await self.inner.put(value, execution_id=execution_id, step=step, command_id=command_id,
                                    task=task, parent_ref_id=parent_ref_id)

    async def get(self, ref_id: int) -> Any:
        kv = await self._bucket()
        if kv is not None:
            hit, value, _ = await self._lookup(kv, ref_id)
            if hit:
                return value
        value = await self.inner.get(ref_id)
        await self._remember(kv, ref_id, value)
        return value

    async def get_many(self, ref_ids: Iterable[int]) -> dict[int, Any]:
        return {i: value for i, (value, _) in (await self.get_many_sized(ref_ids)).items()}

    async def get_many_sized(self, ref_ids: Iterable[int]) -> dict[int, tuple[Any, int]]:
        ids = list(dict.fromkeys(int(i) for i in ref_ids))
        if not ids:
            return {}
        kv = await self._bucket()
        out: dict[int, tuple[Any, int]] = {}
        if kv is not None:
            looked = await asyncio.gather(*(self._lookup(kv, i) for i in ids))
            out = {i: (value, size) for i, (hit, value, size) in zip(ids, looked, strict=True) if hit}
        missing = [i for i in ids if i not in out]
        if missing:
            fetched = await self.inner.get_many_sized(missing)
            kv = self._kv
            await asyncio.gather(*(self._remember(kv, i, v) for i, (v, _) in fetched.items()))
            out.update(fetched)
        return {i: out[i] for i in ids if i in out}

    async def close(self) -> None:
        await self.inner.close()
