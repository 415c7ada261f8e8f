"""``noetl.schedule`` and ``noetl.schedule_tick``: the one module that reads and writes them.

The api changes schedules (add, pause, resume, delete, list); the reaper holding a
schedule's shard fires its ticks:

    round (one transaction)                          submit (after it commits)
    -----------------------                          -------------------------
    fence on the reaper lease (shard, owner, epoch)  every recorded tick without an
    lock the shard's due, unpaused schedules         execution: SubmitExecution with
    decide their due ticks (catch-up policy)         idempotency key schedule/<id>/<tick ms>,
    INSERT a schedule_tick row per fired tick        then its execution id is written back
    move next_tick past now

A stale owner's round matches no lease row and commits nothing; two rounds of one term
serialise on the schedule rows' locks (the second sees next_tick moved); and the primary
key (schedule_id, tick) could not take a second row anyway. A crash between the round
and the submission leaves the tick recorded without an execution: the next owner
submits it with the same key, and the api answers with the same execution if the first
submission got through.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from noetl_common.db import Pool, autocommit, transaction
from noetl_common.errors import Conflict, NotFound
from noetl_common.ids import shard_for
from noetl_common.schedules import CatchUp, Spec, decide, first_tick

from . import leases

# The reaper's shard leases are the schedules' (a schedule's shard: shard_for(schedule_id)).
SCHEDULER_ROLE = "reaper"


def idempotency_key(schedule_id: int, tick: datetime) -> str:
    """The SubmitExecution idempotency key of one tick (the same on every retry)."""
    return f"schedule/{schedule_id}/{int(tick.timestamp() * 1000)}"


def spec_of(row: dict[str, Any]) -> Spec:
    return Spec(cron=row["cron"] or "", time_zone=row["time_zone"], interval_ms=row["interval_ms"] or 0)


@dataclass(frozen=True)
class RoundResult:
    fired: int
    skipped: int
    lag_sec: list[float]              # how late each fired tick was recorded
    next_due: datetime | None         # the shard's earliest next tick (None: no unpaused schedule)
    now: datetime


_SELECT = (
    "SELECT s.*, t.tick AS last_tick, t.execution_id AS last_execution_id FROM noetl.schedule s"
    " LEFT JOIN LATERAL (SELECT tick, execution_id FROM noetl.schedule_tick x"
    " WHERE x.schedule_id = s.schedule_id ORDER BY tick DESC LIMIT 1) t ON true")


class ScheduleStore:
    def __init__(self, pool: Pool, *, shard_count: int) -> None:
        self._pool = pool
        self._shards = shard_count

    # ------------------------------------------------------------ the api's side

    async def add(self, *, name: str, path: str, version: int, payload: dict[str, Any], spec: Spec,
                  catch_up: CatchUp, paused: bool, created_by: int | None,
                  now: datetime | None = None) -> dict[str, Any]:
        async with transaction(self._pool) as conn:
            cur = await conn.execute("SELECT nextval('noetl.schedule_schedule_id_seq') AS id, now() AS now")
            row = await cur.fetchone()
            assert row is not None
            schedule_id = int(row["id"])
            try:
                await conn.execute(
                    "INSERT INTO noetl.schedule (schedule_id, name, shard_id, catalog_path, catalog_version,"
                    " payload, cron, time_zone, interval_ms, catch_up, paused, next_tick, created_by)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    (schedule_id, name, shard_for(schedule_id, self._shards), path, version, json.dumps(payload),
                     spec.cron or None, spec.time_zone or "UTC", spec.interval_ms or None, catch_up.value,
                     paused, first_tick(spec, now or row["now"]), created_by))
            except psycopg.errors.UniqueViolation as exc:
                raise Conflict(f"name: a schedule named {name!r} exists (delete it first)") from exc
        return await self.get(name)

    async def get(self, name: str) -> dict[str, Any]:
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(_SELECT + " WHERE s.name = %s", (name,))
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"schedule {name!r} not found")
        return dict(row)

    async def all(self) -> list[dict[str, Any]]:
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(_SELECT + " ORDER BY s.name")
            return [dict(r) for r in await cur.fetchall()]

    async def pause(self, name: str) -> dict[str, Any]:
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("UPDATE noetl.schedule SET paused = true, updated_at = now()"
                                     " WHERE name = %s RETURNING schedule_id", (name,))
            if await cur.fetchone() is None:
                raise NotFound(f"schedule {name!r} not found")
        return await self.get(name)

    async def resume(self, name: str, now: datetime | None = None) -> dict[str, Any]:
        """Unpause; ticks that fell in the pause are not fired (paused means not wanted):
        the next tick is the first one after now."""
        async with transaction(self._pool) as conn:
            cur = await conn.execute("SELECT *, now() AS now FROM noetl.schedule WHERE name = %s FOR UPDATE",
                                     (name,))
            row = await cur.fetchone()
            if row is None:
                raise NotFound(f"schedule {name!r} not found")
            if row["paused"]:
                await conn.execute(
                    "UPDATE noetl.schedule SET paused = false, next_tick = %s, updated_at = now()"
                    " WHERE schedule_id = %s", (first_tick(spec_of(row), now or row["now"]), row["schedule_id"]))
        return await self.get(name)

    async def delete(self, name: str) -> bool:
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("DELETE FROM noetl.schedule WHERE name = %s RETURNING schedule_id", (name,))
            return await cur.fetchone() is not None

    # ------------------------------------------------------------ the reaper's side

    async def fire_due(self, shard: int, owner_runtime_id: int, epoch: int, *, grace_sec: float,
                       now: datetime | None = None) -> RoundResult:
        """One round for a shard: record the due ticks the policies fire and move each
        schedule's next tick, in one transaction fenced on the reaper lease (LeaseLost
        when the lease is not this term's any more: nothing was written)."""
        fired = skipped = 0
        lag: list[float] = []
        async with transaction(self._pool) as conn:
            await leases.fence(conn, SCHEDULER_ROLE, shard, owner_runtime_id, epoch)
            cur = await conn.execute("SELECT coalesce(%s, now()) AS now", (now,))
            row = await cur.fetchone()
            assert row is not None
            at: datetime = row["now"]
            cur = await conn.execute(
                "SELECT * FROM noetl.schedule WHERE shard_id = %s AND NOT paused AND next_tick <= %s"
                " ORDER BY next_tick FOR UPDATE", (shard, at))
            for s in await cur.fetchall():
                decision = decide(spec_of(s), s["next_tick"], at, CatchUp(s["catch_up"]), grace_sec=grace_sec)
                for tick in decision.fire:
                    await conn.execute(
                        "INSERT INTO noetl.schedule_tick (schedule_id, tick, shard_id, epoch) VALUES (%s, %s, %s, %s)"
                        " ON CONFLICT (schedule_id, tick) DO NOTHING", (s["schedule_id"], tick, shard, epoch))
                    lag.append(max(0.0, (at - tick).total_seconds()))
                await conn.execute("UPDATE noetl.schedule SET next_tick = %s, updated_at = now()"
                                   " WHERE schedule_id = %s", (decision.next_tick, s["schedule_id"]))
                fired += len(decision.fire)
                skipped += decision.skipped
            cur = await conn.execute("SELECT min(next_tick) AS due FROM noetl.schedule"
                                     " WHERE shard_id = %s AND NOT paused", (shard,))
            due = await cur.fetchone()
        return RoundResult(fired, skipped, lag, due["due"] if due else None, at)

    async def next_due(self, shards: Sequence[int]) -> tuple[datetime, dict[int, datetime]]:
        """The database's now, and the earliest next tick of each of ``shards`` that has an
        unpaused schedule: one query for every shard a reaper holds, so only a shard with
        something due takes the fenced round (``fire_due``)."""
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(
                "SELECT now() AS now, d.shard_id, d.due FROM (SELECT 1) one LEFT JOIN LATERAL"
                " (SELECT shard_id, min(next_tick) AS due FROM noetl.schedule"
                "  WHERE shard_id = ANY(%s) AND NOT paused GROUP BY shard_id) d ON true", (list(shards),))
            found = await cur.fetchall()
        return found[0]["now"], {int(r["shard_id"]): r["due"] for r in found if r["shard_id"] is not None}

    async def pending(self, shards: Sequence[int], limit: int = 100) -> dict[int, list[dict[str, Any]]]:
        """Fired ticks of ``shards`` not submitted yet, with what to submit: per shard the
        ``limit`` oldest, oldest first (shards with none are left out). One query for every
        shard a reaper holds."""
        async with autocommit(self._pool) as conn:
            cur = await conn.execute(
                "SELECT * FROM (SELECT t.shard_id, t.schedule_id, t.tick, s.name, s.catalog_path, s.catalog_version,"
                " s.payload, row_number() OVER (PARTITION BY t.shard_id ORDER BY t.tick) AS n"
                " FROM noetl.schedule_tick t JOIN noetl.schedule s USING (schedule_id)"
                " WHERE t.shard_id = ANY(%s) AND t.execution_id IS NULL AND t.error IS NULL) p"
                " WHERE n <= %s ORDER BY shard_id, tick", (list(shards), limit))
            out: dict[int, list[dict[str, Any]]] = {}
            for r in await cur.fetchall():
                row = dict(r)
                del row["n"]
                out.setdefault(int(row["shard_id"]), []).append(row)
            return out

    async def submitted(self, schedule_id: int, tick: datetime, execution_id: int) -> None:
        """Idempotent: every submission of a tick answers the same execution id."""
        async with autocommit(self._pool) as conn:
            await conn.execute("UPDATE noetl.schedule_tick SET execution_id = %s, submitted_at = now()"
                               " WHERE schedule_id = %s AND tick = %s AND execution_id IS NULL",
                               (execution_id, schedule_id, tick))

    async def refused(self, schedule_id: int, tick: datetime, error: str) -> None:
        """The api refused the tick's submission for good (it will not be retried)."""
        async with autocommit(self._pool) as conn:
            await conn.execute("UPDATE noetl.schedule_tick SET error = %s, submitted_at = now()"
                               " WHERE schedule_id = %s AND tick = %s AND execution_id IS NULL",
                               (error[:2000], schedule_id, tick))

    async def ticks(self, schedule_id: int) -> list[dict[str, Any]]:
        async with autocommit(self._pool) as conn:
            cur = await conn.execute("SELECT * FROM noetl.schedule_tick WHERE schedule_id = %s ORDER BY tick",
                                     (schedule_id,))
            return [dict(r) for r in await cur.fetchall()]
