"""A TCP fault proxy for chaos tests: put it between the role processes and Postgres and
switch, at any moment, between a working network and two kinds of outage.

Modes (``proxy.set_mode(mode)`` returns once the mode is in force):

- ``pass``: forward both ways.
- ``refuse``: every open connection is reset at once (RST to both ends) and every new
  one is accepted and reset straight away: "Postgres unreachable".
- ``blackhole``: connections stay open and new ones are accepted, but nothing is
  forwarded either way (bytes already read are held; the rest waits in the kernel): a
  network partition. Back to ``pass``, held connections resume where they stopped (a
  partition that heals) and held new ones reach the target.

The proxy runs an asyncio loop in a daemon thread of the test process, listening on a
free loopback port. Only the roles go through it: ``devstack.up(...,
role_postgres_dsn=proxy.dsn_via)`` starts the stack with the roles' DSN pointing here
(the proxy learns its target from the direct DSN) while ``state.postgres_dsn``, which
the tests' own helpers use, stays direct::

    with FaultProxy() as proxy:
        state = devstack.up(home, scale, env=env, role_postgres_dsn=proxy.dsn_via)
        ...
        proxy.set_mode("refuse")      # Postgres unreachable for the roles
        proxy.set_mode("blackhole")   # or partitioned
        proxy.set_mode("pass")        # healed
        state.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from dataclasses import dataclass, field
from types import TracebackType

from psycopg.conninfo import conninfo_to_dict, make_conninfo

PASS = "pass"
REFUSE = "refuse"
BLACKHOLE = "blackhole"
MODES = (PASS, REFUSE, BLACKHOLE)
_CHUNK = 64 * 1024


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN: the peer sees 'connection reset'."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def reset(self) -> None:
        """RST both ends and stop its tasks (a held connection included)."""
        _reset(self.client)
        _reset(self.upstream)
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()


class FaultProxy:
    """A loopback TCP proxy to ``target`` (host, port) with switchable faults. The target
    may be set later (``set_target`` / ``dsn_via``); until then connections are reset."""

    def __init__(self, target: tuple[str, int] | None = None, *, mode: str = PASS, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.target = target
        self._mode = mode
        self._conns: set[_Conn] = set()
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._thread.start()
        self._server: asyncio.base_events.Server | None = None
        self._passing: asyncio.Event | None = None
        self.host, self.port = self._call(self._start(host, port))

    # ------------------------------------------------------------ the test's side

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def set_target(self, host: str, port: int) -> None:
        self.target = (host, int(port))

    def dsn_via(self, dsn: str) -> str:
        """Aim the proxy at ``dsn``'s host and port; return ``dsn`` going through the proxy."""
        params = conninfo_to_dict(dsn)
        self.set_target(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
        return make_conninfo(dsn, host=self.host, port=str(self.port))

    def set_mode(self, mode: str) -> None:
        """Switch to ``pass``, ``refuse`` or ``blackhole``; returns once it is in force
        (with ``refuse``: every open connection has been reset)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self._call(self._apply(mode))

    def close(self) -> None:
        """Stop listening, reset every connection, stop the thread. Idempotent."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._call(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    # ------------------------------------------------------------ the loop's side

    async def _start(self, host: str, port: int) -> tuple[str, int]:
        self._passing = asyncio.Event()
        if self._mode == PASS:
            self._passing.set()
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def _apply(self, mode: str) -> None:
        assert self._passing is not None
        self._mode = mode
        if mode == PASS:
            self._passing.set()
        else:
            self._passing.clear()
        if mode == REFUSE:
            await self._reset_all()

    async def _reset_all(self) -> None:
        tasks = [t for conn in list(self._conns) for t in conn.tasks]
        for conn in list(self._conns):
            conn.reset()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._passing is not None
        self.accepted += 1
        conn = _Conn(client=writer)
        task = asyncio.current_task()
        if task is not None:
            conn.tasks.add(task)
        self._conns.add(conn)
        try:
            if self._mode == REFUSE:
                return
            await self._passing.wait()  # a blackhole holds new connections here
            if writer.transport.is_closing() or self.target is None:
                return
            try:
                up_reader, conn.upstream = await asyncio.open_connection(*self.target)
            except OSError:
                return
            if self._mode == REFUSE or writer.transport.is_closing():
                return
            pumps = [asyncio.create_task(self._pump(reader, conn.upstream)),
                     asyncio.create_task(self._pump(up_reader, writer))]
            conn.tasks.update(pumps)
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            if self._mode == REFUSE:
                conn.reset()
            else:
                for w in (writer, conn.upstream):
                    if w is not None:
                        w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy until EOF; while not passing, hold what was read (a partition)."""
        assert self._passing is not None
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    return
                await self._passing.wait()
                if writer.transport.is_closing():
                    return
                writer.write(data)
                await writer.drain()
