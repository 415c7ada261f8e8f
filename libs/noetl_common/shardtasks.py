"""Run one worker object per owned shard; start and stop them as leases come and go.

A shard worker has ``epoch``, ``stop()`` (ask it to finish its current batch and
return) and ``async run()``. Used by every sharded role.

Per-shard gauges (``{shard}``-labelled, registered with ``forget_on_loss``) lose the
shard's label set when the process loses the shard, so a member never keeps exporting
the last value of a shard another member now holds."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client as NATS
from prometheus_client import Gauge

from . import natsio
from .config import CoreSettings, ShardSettings
from .service import Service

logger = logging.getLogger(__name__)


_PER_SHARD_GAUGES: dict[str, list[Gauge]] = {}


def forget_on_loss(role: str, gauge: Gauge) -> Gauge:
    """Register ``gauge`` (labelled ``shard`` only): its series of a shard ``role`` loses
    is removed (``ShardTasks`` named ``role`` calls ``forget_shard``)."""
    _PER_SHARD_GAUGES.setdefault(role, []).append(gauge)
    return gauge


def forget_shard(role: str, shard: int) -> None:
    for gauge in _PER_SHARD_GAUGES.get(role, ()):
        with contextlib.suppress(KeyError):
            gauge.remove(str(shard))


class ShardWorker(Protocol):
    epoch: int

    def stop(self) -> None: ...

    async def run(self) -> None: ...


class ShardTasks:
    def __init__(self, name: str, factory: Callable[[int, int], ShardWorker], *, stop_timeout: float = 5.0) -> None:
        self._name = name
        self._factory = factory
        self._stop_timeout = stop_timeout
        self._running: dict[int, tuple[ShardWorker, asyncio.Task[None]]] = {}

    @property
    def shards(self) -> list[int]:
        return sorted(self._running)

    def worker(self, shard: int) -> ShardWorker | None:
        entry = self._running.get(shard)
        return entry[0] if entry else None

    async def apply(self, gained: dict[int, int], lost: set[int]) -> None:
        for shard in set(lost) | set(gained):
            entry = self._running.get(shard)
            if entry is not None and (shard in lost or entry[0].epoch != gained.get(shard)):
                await self._stop(shard)
            if shard in lost:  # after the worker stopped: it cannot set the gauge again
                forget_shard(self._name, shard)
        for shard, epoch in gained.items():
            if shard not in self._running:
                worker = self._factory(shard, epoch)
                task = asyncio.create_task(worker.run(), name=f"{self._name}-{shard}")
                task.add_done_callback(functools.partial(self._done, shard))
                self._running[shard] = (worker, task)

    def _done(self, shard: int, task: asyncio.Task[None]) -> None:
        entry = self._running.get(shard)
        if entry is not None and entry[1] is task:
            self._running.pop(shard, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s for shard %s crashed", self._name, shard, exc_info=task.exception())

    async def _stop(self, shard: int) -> None:
        entry = self._running.pop(shard, None)
        if entry is None:
            return
        worker, task = entry
        worker.stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=self._stop_timeout)
        except (TimeoutError, Exception):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def stop_all(self) -> None:
        await asyncio.gather(*(self._stop(s) for s in list(self._running)))


class ShardedService(Service):
    """A role whose work is one ``ShardWorker`` per held shard (projector, reaper,
    checkpointer, ...). Subclasses implement ``make_shard_worker``; ``nats`` roles get
    ``self.nc`` connected in ``on_start`` and drained on stop."""

    sharded = True
    uses_nats: bool = True

    def __init__(self, core: CoreSettings, shard: ShardSettings) -> None:
        super().__init__(core, shard)
        self.nc: NATS | None = None
        self.tasks = ShardTasks(self.role, self.make_shard_worker)

    def make_shard_worker(self, shard: int, epoch: int) -> ShardWorker:
        raise NotImplementedError

    async def on_start(self) -> None:
        if self.uses_nats:
            self.nc = await natsio.connect(self.core.nats_url, name=self.core.instance)

    async def on_shards(self, gained: dict[int, int], lost: set[int]) -> None:
        await self.tasks.apply(gained, lost)

    async def on_stop(self) -> None:
        await self.tasks.stop_all()
        if self.nc is not None:
            await self.nc.drain()
