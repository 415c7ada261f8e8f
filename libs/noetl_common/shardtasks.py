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
import time
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client as NATS
from prometheus_client import Counter, Gauge

from . import natsio
from .config import CoreSettings, ShardSettings
from .service import Service

logger = logging.getLogger(__name__)

RESTARTS = Counter("noetl_shard_loop_restarts_total",
                   "Shard loops started again after they crashed (an exception escaped the loop)", ["role"])
# A worker that ran this long before crashing starts a new backoff series.
HEALTHY_RUN_SEC = 60.0


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
    """Supervises one worker per wanted shard.

    ``apply(gained, lost)`` says which shards (and epochs) this member wants to work on.
    A worker whose task ends while its shard is still wanted -- it crashed (an exception
    escaped its loop: a dependency outage at start, a bug) or it returned on its own (it
    saw its lease lost or not trusted yet) -- is started again: after a crash with capped
    exponential backoff (``restart_backoff``, reset once a worker has run for a minute),
    after a return once ``still_held(shard, epoch)`` (the member's trust in the lease) is
    true again. ``ensure()`` (called by the membership loop after every lease renewal and
    by a timer) starts what is due, so a shard is never held with no live loop for longer
    than the backoff cap or one renewal. Crashes are logged with their traceback and
    counted in ``noetl_shard_loop_restarts_total{role}``."""

    def __init__(self, name: str, factory: Callable[[int, int], ShardWorker], *, stop_timeout: float = 5.0,
                 still_held: Callable[[int, int], bool] | None = None,
                 restart_backoff: tuple[float, float] = (0.1, 5.0), clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self._name = name
        self._factory = factory
        self._stop_timeout = stop_timeout
        self._still_held = still_held or (lambda _shard, _epoch: True)
        self._backoff = restart_backoff
        self._clock = clock
        self._wanted: dict[int, int] = {}
        self._running: dict[int, tuple[ShardWorker, asyncio.Task[None], float]] = {}
        self._failures: dict[int, int] = {}
        self._not_before: dict[int, float] = {}
        self._down_since: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        RESTARTS.labels(name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def shards(self) -> list[int]:
        return sorted(self._running)

    def worker(self, shard: int) -> ShardWorker | None:
        entry = self._running.get(shard)
        return entry[0] if entry else None

    def unhealthy(self, grace_sec: float) -> list[int]:
        """Wanted shards whose lease is trusted but that have had no live worker for more
        than ``grace_sec`` (a loop that keeps crashing)."""
        now = self._clock()
        return sorted(s for s, since in self._down_since.items()
                      if s in self._wanted and now - since > grace_sec
                      and self._still_held(s, self._wanted[s]))

    async def apply(self, gained: dict[int, int], lost: set[int]) -> None:
        for shard in set(lost) | set(gained):
            entry = self._running.get(shard)
            if entry is not None and (shard in lost or entry[0].epoch != gained.get(shard)):
                await self._stop(shard)
            if shard in lost:  # after the worker stopped: it cannot set the gauge again
                self._forget(shard)
                forget_shard(self._name, shard)
        for shard, epoch in gained.items():
            if self._wanted.get(shard) != epoch:
                self._failures.pop(shard, None)
                self._not_before.pop(shard, None)
            self._wanted[shard] = epoch
            if shard not in self._running:
                self._start(shard, epoch)

    def ensure(self) -> None:
        """Start every wanted shard's worker that is not running and is due."""
        now = self._clock()
        for shard, epoch in list(self._wanted.items()):
            if shard in self._running or now < self._not_before.get(shard, 0.0):
                continue
            if self._still_held(shard, epoch):
                self._start(shard, epoch)

    def _start(self, shard: int, epoch: int) -> None:
        worker = self._factory(shard, epoch)
        task = asyncio.create_task(worker.run(), name=f"{self._name}-{shard}")
        self._running[shard] = (worker, task, self._clock())
        self._down_since.pop(shard, None)
        task.add_done_callback(functools.partial(self._done, shard))

    def _done(self, shard: int, task: asyncio.Task[None]) -> None:
        entry = self._running.get(shard)
        if entry is None or entry[1] is not task:
            return  # stopped on purpose (``_stop`` took it out first)
        self._running.pop(shard, None)
        if shard not in self._wanted:
            return
        now = self._clock()
        self._down_since.setdefault(shard, now)
        if now - entry[2] > HEALTHY_RUN_SEC:
            self._failures.pop(shard, None)
        failures = self._failures[shard] = self._failures.get(shard, 0) + 1
        initial, cap = self._backoff
        delay = min(cap, initial * 2 ** (failures - 1))
        if not task.cancelled() and task.exception() is not None:
            RESTARTS.labels(self._name).inc()
            logger.error("%s for shard %s crashed (%d in a row); restarting in %.1fs", self._name, shard,
                         failures, delay, exc_info=task.exception())
        else:
            logger.info("%s for shard %s ended while the shard is wanted; starting it again in %.1fs once"
                        " its lease is trusted", self._name, shard, delay)
        self._not_before[shard] = now + delay
        self._schedule(delay)

    def _schedule(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(delay, self._tick)

    def _tick(self) -> None:
        """Start what is due; come back for the next restart still in its backoff (shards
        waiting for their lease to be trusted again are started by the membership loop)."""
        self._timer = None
        self.ensure()
        now = self._clock()
        later = [t for s, t in self._not_before.items() if s in self._wanted and s not in self._running and t > now]
        if later:
            self._schedule(min(later) - now)

    def _forget(self, shard: int) -> None:
        self._wanted.pop(shard, None)
        self._failures.pop(shard, None)
        self._not_before.pop(shard, None)
        self._down_since.pop(shard, None)

    async def _stop(self, shard: int) -> None:
        entry = self._running.pop(shard, None)
        if entry is None:
            return
        worker, task, _ = entry
        worker.stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=self._stop_timeout)
        except (TimeoutError, Exception):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def stop_all(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wanted.clear()
        await asyncio.gather(*(self._stop(s) for s in list(self._running)))


class ShardedService(Service):
    """A role whose work is one ``ShardWorker`` per held shard (projector, reaper,
    checkpointer, ...). Subclasses implement ``make_shard_worker``; ``nats`` roles get
    ``self.nc`` connected in ``on_start`` and drained on stop. Shard loops are
    supervised (``ShardTasks``): a crashed loop is started again; the role reports
    NOT_SERVING while one keeps crashing or NATS is unreachable."""

    sharded = True
    uses_nats: bool = True

    def __init__(self, core: CoreSettings, shard: ShardSettings) -> None:
        super().__init__(core, shard)
        self.nc: NATS | None = None
        self.tasks = ShardTasks(self.role, self.make_shard_worker, still_held=self._trusted)

    def _trusted(self, shard: int, epoch: int) -> bool:
        return self.ownership is not None and self.ownership.epoch(shard) == epoch

    def make_shard_worker(self, shard: int, epoch: int) -> ShardWorker:
        raise NotImplementedError

    async def on_start(self) -> None:
        if self.uses_nats:
            self.nc = await natsio.connect(self.core.nats_url, name=self.core.instance, role=self.role,
                                           **self.core.nats_options())

    async def on_shards(self, gained: dict[int, int], lost: set[int]) -> None:
        await self.tasks.apply(gained, lost)

    def on_reconciled(self) -> None:
        self.tasks.ensure()

    async def check_health(self) -> list[str]:
        return shard_health(self.tasks, self.nc if self.uses_nats else None)

    async def on_stop(self) -> None:
        await self.tasks.stop_all()
        if self.nc is not None:
            await self.nc.drain()


# A shard loop down this long (crashing again and again) makes its role NOT_SERVING.
LOOP_DOWN_GRACE_SEC = 10.0


def shard_health(tasks: ShardTasks, nc: NATS | None) -> list[str]:
    """The problems of a sharded role: NATS unreachable, shard loops that keep crashing."""
    problems = []
    if nc is not None and not nc.is_connected:
        problems.append("nats unavailable: not connected")
    down = tasks.unhealthy(LOOP_DOWN_GRACE_SEC)
    if down:
        problems.append(f"{tasks.name} loop(s) of shard(s) {down} down for more than {LOOP_DOWN_GRACE_SEC:g}s")
    return problems
