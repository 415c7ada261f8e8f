"""Postgres access: pools, the migration runner, event partitions, error translation.

psycopg errors are translated here, once (``translate``), into the project's tree.
Pools are created closed and opened by the service's ``run()``; nothing connects at
import time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from importlib import resources
from typing import Any, TypeAlias

import psycopg
from psycopg.adapt import Dumper
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from . import dbroles
from .errors import Conflict, LeaseLost, NoetlError, NotFound, Unavailable

logger = logging.getLogger(__name__)

MIGRATION_LOCK_KEY = 0x6E6F65746C  # "noetl"
# pg_advisory_xact_lock(REDRIVE_LOCK_CLASS, <execution id folded to int4>): the engine holds
# it while it applies a redrive, the compactor (shared, try) before it compacts the
# execution: a redrive never lands on an execution being compacted (ARCHITECTURE.md
# "Dead letters").
REDRIVE_LOCK_CLASS = 0x444C51  # "DLQ"
# SQLSTATE raised by noetl.assert_lease (migration 0006): the writer's lease is gone.
LEASE_NOT_HELD = "NL001"
PARTITION_LOCK_KEY = 0x6E6F65746C + 1

#: A connection of the runtime's pools: rows come back as dicts.
Conn: TypeAlias = psycopg.AsyncConnection[DictRow]
#: The runtime's connection pool (``make_pool``).
Pool: TypeAlias = AsyncConnectionPool[Conn]


def translate(exc: BaseException) -> NoetlError:
    """Map a psycopg error to the project's error tree (callers ``raise ... from exc``)."""
    if isinstance(exc, NoetlError):
        return exc
    if isinstance(exc, psycopg.Error) and exc.sqlstate == LEASE_NOT_HELD:
        return LeaseLost(exc.diag.message_primary or str(exc).strip())
    if isinstance(exc, psycopg.errors.UniqueViolation):
        return Conflict(str(exc).strip())
    if isinstance(exc, psycopg.errors.ForeignKeyViolation):
        return NotFound(str(exc).strip())
    if isinstance(exc, psycopg.OperationalError | PoolTimeout):
        return Unavailable(f"postgres unavailable: {str(exc).strip()}")
    return NoetlError(f"postgres error: {str(exc).strip()}")


# libpq TCP settings of the runtime's own connections: a peer that vanished without a
# FIN (a partition, a host gone) is detected by TCP within ~15 s instead of hanging a
# statement for the kernel's default of minutes.
TCP_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
                 "tcp_user_timeout": 15_000, "connect_timeout": 5}


RECONNECT_GIVE_UP_SEC = 5.0


def make_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, name: str = "noetl",
              idle_tx_timeout_sec: float | None = None) -> Pool:
    """A closed async pool with dict rows; open it with ``await pool.open(wait=True)``.

    ``idle_tx_timeout_sec``: Postgres ends a session of this pool that sits idle inside a
    transaction longer than that (``idle_in_transaction_session_timeout``). Services pass
    their shard lease: a process frozen mid-transaction (SIGSTOP, VM pause) must not hold
    a lease row lock, and with it the shard-manager's rebalancing, longer than a lease.
    Sessions are named ``noetl-{name}`` (``application_name``, seen in pg_stat_activity)
    and use ``TCP_KEEPALIVE``."""
    kwargs: dict[str, Any] = {"autocommit": False, "row_factory": dict_row, "application_name": f"noetl-{name}",
                              **TCP_KEEPALIVE}
    if idle_tx_timeout_sec:
        kwargs["options"] = f"-c idle_in_transaction_session_timeout={max(1, int(idle_tx_timeout_sec * 1000))}"
    return AsyncConnectionPool(
        conninfo=dsn,
        connection_class=Conn,
        min_size=min_size,
        max_size=max_size,
        open=False,
        name=name,
        kwargs=kwargs,
        timeout=30.0,
        # A lost connection is re-made in the background with backoff (1, 2, 4, 8 s, ...):
        # after an outage of 20 s the next attempt came ~10 s after Postgres was back.
        # Giving an attempt up after 5 s lets the next caller that waits start a fresh one
        # at once (the pool grows on demand), so work resumes within a few seconds.
        reconnect_timeout=RECONNECT_GIVE_UP_SEC,
    )


@contextlib.asynccontextmanager
async def autocommit(pool: Pool) -> AsyncIterator[Conn]:
    """A connection whose statements each commit on their own: for work that is ONE
    statement (a claim, a lease renewal, a result insert, a read). It saves the BEGIN and
    COMMIT round trips a one-statement transaction costs. psycopg errors come out translated."""
    try:
        async with pool.connection() as conn:
            await conn.set_autocommit(True)
            try:
                yield conn
            finally:
                if not conn.closed:
                    await conn.set_autocommit(False)
    except psycopg.Error as exc:  # PoolTimeout included
        raise translate(exc) from exc


@contextlib.asynccontextmanager
async def transaction(pool: Pool) -> AsyncIterator[Conn]:
    """A connection inside one transaction; psycopg errors come out translated."""
    try:
        async with pool.connection() as conn, conn.transaction():
            yield conn
    except psycopg.Error as exc:  # PoolTimeout included
        raise translate(exc) from exc


class Column(list[Any]):
    """One column of a batch's rows, sent as a Postgres array literal in text format:
    the parameter of ``unnest(%t::bigint[], ...)`` or ``= ANY(%t::bigint[])``.

    Why not psycopg's own list dumper: it inspects every element (the type of the first
    non-null one, the largest integer to pick int2/int4/int8) and builds a dumper per list
    in Python, about 18 µs per array whatever its length; an engine batch sends 30-odd
    arrays. Writing the literal costs a join (docs/PERFORMANCE.md "Array parameters":
    an 8-column batch of 3 events dumps in 14 µs against 153 µs). The SQL's cast names the
    element type; the literal is sent untyped (oid 0), so Postgres parses it as that type.
    Elements: None, bool, int, float, str, datetime and date; anything else is refused
    with a ``TypeError`` naming its type (bytes go in binary: ``%b`` with a plain list)."""

    __slots__ = ()


def _escaped(text: str) -> str:
    """``text`` as it goes between an array element's double quotes."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _quoted(text: str) -> str:
    return '"' + _escaped(text) + '"'


def _element(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return _quoted(value)
    if isinstance(value, bool):  # before int: bool is one
        return "t" if value else "f"
    if isinstance(value, int):  # int(): an IntEnum's repr is not its number
        return str(int(value))
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, date):  # datetime is one
        return _quoted(value.isoformat())
    raise TypeError(f"an array parameter cannot hold a {type(value).__name__} ({value!r:.60})")


def array_literal(values: Sequence[Any]) -> str:
    """``values`` as a one-dimensional Postgres array literal (``Column``'s text)."""
    kinds = {type(v) for v in values}
    if kinds <= {int}:
        return "{" + ",".join(map(str, values)) + "}"
    if kinds <= {str}:  # escaped in three passes over the whole column, not one per element
        joined = "\0".join(values)  # NUL: Postgres text never holds one, so it marks the gaps
        if joined.count("\0") == len(values) - 1:
            return '{"' + _escaped(joined).replace("\0", '","') + '"}'
    return "{" + ",".join(map(_element, values)) + "}"


class _ColumnDumper(Dumper):
    format = psycopg.pq.Format.TEXT  # oid 0: the statement's cast types it

    def dump(self, obj: Any) -> bytes:
        return array_literal(obj).encode()


psycopg.adapters.register_dumper(Column, _ColumnDumper)


def columns(rows: Sequence[Sequence[Any]], width: int) -> list[Column]:
    """Rows as ``width`` columns: the parameters of ``INSERT ... SELECT * FROM
    unnest(%t::t1[], ...)``, one statement for a whole batch (``Column``)."""
    return [Column(c) for c in zip(*rows, strict=True)] if rows else [Column() for _ in range(width)]


@contextlib.asynccontextmanager
async def pipelined_transaction(pool: Pool) -> AsyncIterator[Conn]:
    """A transaction in libpq pipeline mode: statements are sent without waiting for
    each other's results; a read (``fetchone``/``fetchall``) waits for everything sent
    before it, and the COMMIT travels with the last statements. BEGIN goes out with the
    first statement. COPY is not available here. psycopg errors come out translated."""
    try:
        async with pool.connection() as conn, conn.pipeline(), conn.transaction():
            yield conn
    except psycopg.Error as exc:  # PoolTimeout included
        raise translate(exc) from exc


# ---------------------------------------------------------------- migrations


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """The versioned migrations shipped in ``noetl_common/migrations``, in order."""
    found = []
    for entry in resources.files("noetl_common.migrations").iterdir():
        if entry.name.endswith(".sql"):
            version, _, rest = entry.name.partition("_")
            found.append(Migration(int(version), rest.removesuffix(".sql"), entry.read_text()))
    found.sort(key=lambda m: m.version)
    return found


def migrate(dsn: str, *, partitions_ahead_days: int = 3) -> list[int]:
    """Apply pending migrations (serialised by an advisory lock), then the roles' grants
    (``dbroles.apply``); returns versions applied. Run with the owner's DSN."""
    applied: list[int] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
            try:
                conn.execute("CREATE SCHEMA IF NOT EXISTS noetl")
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS noetl.schema_migration ("
                    " version int PRIMARY KEY, name text NOT NULL,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                )
                done = {r[0] for r in conn.execute("SELECT version FROM noetl.schema_migration")}
                for m in migrations():
                    if m.version in done:
                        continue
                    with conn.transaction():
                        conn.execute(m.sql.encode())
                        conn.execute(
                            "INSERT INTO noetl.schema_migration (version, name) VALUES (%s, %s)",
                            (m.version, m.name),
                        )
                    logger.info("applied migration %04d_%s", m.version, m.name)
                    applied.append(m.version)
                ensure_event_partitions_sync(conn, datetime.now(UTC).date() - timedelta(days=1),
                                             partitions_ahead_days + 2)
                # the roles' grants (dbroles.GRANTS), every time: they follow the code
                dbroles.apply(conn)
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    except psycopg.Error as exc:
        raise translate(exc) from exc
    return applied


# ---------------------------------------------------------------- partitions


def partition_name(day: date) -> str:
    return f"event_p{day:%Y%m%d}"


# The partitions belong to the owner: the roles create them through the owner's
# SECURITY DEFINER function (migration 0009), which computes the day's snowflake bounds
# (``ids.snowflake_at``) and serialises on PARTITION_LOCK_KEY.
_CREATE_PARTITION = "SELECT noetl.create_event_partition(%s) AS created"


def _missing_days(existing: set[str], first: date, days: int) -> list[date]:
    wanted = [first + timedelta(days=i) for i in range(days)]
    return [d for d in wanted if partition_name(d) not in existing]


_EXISTING_PARTITIONS = (
    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
    "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
    "WHERE n.nspname = 'noetl' AND p.relname = 'event'"
)


def ensure_event_partitions_sync(conn: psycopg.Connection[Any], first: date, days: int) -> list[str]:
    """Create daily event partitions for ``days`` days from ``first`` (autocommit conn)."""
    existing = {r[0] for r in conn.execute(_EXISTING_PARTITIONS)}
    created = []
    for day in _missing_days(existing, first, days):
        with conn.transaction():
            conn.execute(_CREATE_PARTITION, (day,))
        created.append(partition_name(day))
    return created


async def ensure_event_partitions(pool: Pool, first: date, days: int) -> list[str]:
    """Async twin of ``ensure_event_partitions_sync`` for the services' loops."""
    created = []
    try:
        async with pool.connection() as conn:
            cur = await conn.execute(_EXISTING_PARTITIONS)
            existing = {r["relname"] for r in await cur.fetchall()}
            await conn.commit()
            for day in _missing_days(existing, first, days):
                async with conn.transaction():
                    await conn.execute(_CREATE_PARTITION, (day,))
                created.append(partition_name(day))
    except psycopg.Error as exc:
        raise translate(exc) from exc
    if created:
        logger.info("created event partitions %s", created)
    return created
