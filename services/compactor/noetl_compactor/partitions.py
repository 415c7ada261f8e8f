"""Event partitions: created ahead of need, dropped once expired and empty.

A daily partition ``noetl.event_pYYYYMMDD`` holds the execution ids of that UTC day
(snowflake ids are time-ordered). It is dropped when

* its whole id range is older than the retention horizon (the day ended before it),
* it is older than the window the maintenance keeps creating (yesterday onwards), and
* it holds no rows (its executions were compacted).

The drop is the owner's ``noetl.drop_event_partition`` (migration 0009: the compactor's
database role owns no partition): it checks emptiness, takes the partition advisory
lock and the parent's lock (the order an INSERT takes them), re-checks emptiness under
them, and gives up after a short ``lock_timeout`` (2 s; tried again next round) rather
than queue behind a long transaction. Nothing else ever drops a partition.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, date, datetime, timedelta

from noetl_common.db import Pool, partition_name, transaction

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^event_p(\d{8})$")

_PARTITIONS = (
    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
    "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
    "WHERE n.nspname = 'noetl' AND p.relname = 'event'"
)


def partition_day(name: str) -> date | None:
    match = _NAME.match(name)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y%m%d").replace(tzinfo=UTC).date()


def expired(day: date, *, horizon: datetime, keep_from: date) -> bool:
    """True when the partition of ``day`` lies wholly before ``horizon`` and before the
    maintenance window starting at ``keep_from``."""
    end = datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(days=1)
    return day < keep_from and end <= horizon


async def event_partitions(pool: Pool) -> list[str]:
    async with pool.connection() as conn:
        cur = await conn.execute(_PARTITIONS)
        names = [str(r["relname"]) for r in await cur.fetchall()]
        await conn.commit()
    return sorted(names)


async def drop_expired_partitions(pool: Pool, *, horizon: datetime, keep_from: date) -> list[str]:
    """Drop the expired, empty event partitions; returns the names dropped."""
    dropped: list[str] = []
    for name in await event_partitions(pool):
        day = partition_day(name)
        if day is None or partition_name(day) != name or not expired(day, horizon=horizon, keep_from=keep_from):
            continue
        async with transaction(pool) as conn:
            cur = await conn.execute("SELECT noetl.drop_event_partition(%s) AS dropped", (name,))
            row = await cur.fetchone()
        if not (row and row["dropped"]):
            continue
        logger.info("dropped expired event partition %s", name)
        dropped.append(name)
    return dropped
