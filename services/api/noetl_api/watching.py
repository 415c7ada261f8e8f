"""What the WatchExecution streams of one api replica read, shared among them.

Every stream used to subscribe to its execution's progress hints, read the read model
(three queries) on each hint, and read it again every second without one (a lost hint's
backstop). 2,000 streams on one running execution made 6,000 queries a second on the
api's pool, and an execution submitted meanwhile took 28 s instead of 30 ms. Now:

* one NATS subscription per watched execution, whatever the number of its streams;
* one read of an execution's read model at a time, shared by every stream that needs one
  at least as new as the hint it was woken by (``read``);
* the backstop is one query a second for every execution watched here (``ShardRounds``:
  the streams wake on shared one-second boundaries), and only an execution whose
  projected version moved is read again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from noetl_common import natsio
from noetl_common.coalesce import ShardRounds

Version = tuple[str, int]  # (status, last_shard_seq) of the projected execution
Reader = Callable[[int, bool], Awaitable[dict[str, Any]]]
Versions = Callable[[list[int]], Awaitable[Mapping[int, Version]]]


class Watched:
    """One execution's watchers on this replica: a generation bumped by each hint, whether
    a hint said it reached a terminal status, and the streams to wake."""

    def __init__(self) -> None:
        self.generation = 0
        self.final = False
        self.wakers: set[asyncio.Event] = set()
        self.sub: Any = None
        # Resolved once the subscription is made (True) or failed (False: a stream that
        # joined meanwhile makes its own attempt).
        self.ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        # (include_results) -> (generation the read started at, the read)
        self.reads: dict[bool, tuple[int, asyncio.Future[dict[str, Any]]]] = {}

    def hinted(self, terminal: bool) -> None:
        self.generation += 1
        self.final = self.final or terminal
        for event in self.wakers:
            event.set()


class WatchHub:
    def __init__(self, nc: Any, read: Reader, versions: Versions, *, backstop_sec: float = 1.0) -> None:
        self._nc = nc
        self._read = read
        self._versions: ShardRounds[int, Version | None] = ShardRounds(versions, None)
        self.backstop_sec = backstop_sec
        self._watched: dict[int, Watched] = {}
        self.reads = 0  # read-model reads made (tests)

    @contextlib.asynccontextmanager
    async def watching(self, execution_id: int, wake: asyncio.Event) -> Any:
        """Registers a stream's ``wake`` event for ``execution_id``'s hints while in the block."""
        while True:
            w = self._watched.get(execution_id)
            if w is not None:
                if await asyncio.shield(w.ready):
                    break
                continue  # its subscription failed: try our own
            w = self._watched[execution_id] = Watched()
            await self._subscribe(execution_id, w)
            break
        w.wakers.add(wake)
        try:
            yield w
        finally:
            w.wakers.discard(wake)
            if not w.wakers and self._watched.get(execution_id) is w:
                del self._watched[execution_id]
                with contextlib.suppress(Exception):
                    await w.sub.unsubscribe()

    async def _subscribe(self, execution_id: int, w: Watched) -> None:
        async def hint(msg: Any) -> None:
            w.hinted(msg.data == natsio.PROGRESS_TERMINAL)

        try:
            w.sub = await self._nc.subscribe(natsio.progress_subject(execution_id), cb=hint)
        except BaseException:
            del self._watched[execution_id]
            w.ready.set_result(False)
            raise
        w.ready.set_result(True)

    async def read(self, execution_id: int, include_results: bool, w: Watched) -> dict[str, Any]:
        """The read model, from a read that started after every hint ``w`` had when this
        was called: a read in flight since then is shared, an older one is not (it may
        predate the change the caller was woken for)."""
        wanted = w.generation
        got = w.reads.get(include_results)
        if got is None or got[0] < wanted:
            self.reads += 1
            fut = asyncio.ensure_future(self._read(execution_id, include_results))
            got = w.reads[include_results] = (wanted, fut)
            entry = got

            def forget(done: asyncio.Future[dict[str, Any]]) -> None:
                if w.reads.get(include_results) is entry:
                    del w.reads[include_results]
                if not done.cancelled():
                    done.exception()  # retrieved: its callers may all have gone

            fut.add_done_callback(forget)
        return await asyncio.shield(got[1])

    async def version(self, execution_id: int) -> Version | None:
        """(status, last_shard_seq) as projected now; the reads of the streams that ask
        within a few ms of each other are one query."""
        return await self._versions.get(execution_id)
