"""The data layer's contract: ONE conformance suite over every public function and statement
of ``noetl_db`` (and the Postgres result store's ``noetl_store._postgres``), against the
real Postgres the test session starts, in the style of River's ``riverdrivertest``: each
call runs on real rows, and what its docstring promises is checked on what it returns and
on the rows it leaves (read back with plain SQL here), including the refusals (a fence of
a lease that is not ours, a claim by a worker that does not qualify, a reused idempotency
key) and the idempotent paths (``ON CONFLICT DO NOTHING``).

``test_every_public_function_has_a_conformance_test`` holds the suite to the layer: every
public function (module-level, or a method of a class the module defines) and every
public SQL statement constant is named by the ``@covers`` mark of at least one test here,
so a new function of the layer fails the suite until a test of it exists.

Isolation in the shared database: shards 700-799 (no other test uses them), role, path
and token names under one random ``TAG``, fresh snowflake execution ids and fake owner
ids; the module's last fixture deletes every row the suite created."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import itertools
import json
import pkgutil
import random
import re
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg.rows import dict_row

import noetl_db
from noetl_common.db import REDRIVE_LOCK_CLASS, Pool, autocommit, pipelined_transaction, transaction
from noetl_common.errors import Conflict, LeaseLost, NotFound
from noetl_common.ids import SnowflakeGenerator, shard_for
from noetl_common.schedules import CatchUp, Spec
from noetl_db import (
    Write,
    catalog,
    checkpoints,
    commands,
    credentials,
    dead_letters,
    engine_state,
    events,
    gated,
    leases,
    limits,
    loops,
    read_models,
    requests,
    tokens,
)
from noetl_db._conn import run
from noetl_db.commands import QueuedCommand
from noetl_db.events import EventRow
from noetl_db.loops import IterationResult
from noetl_db.schedules import ScheduleStore, idempotency_key, spec_of
from noetl_flow import CommandUpdate, ExecState, NewCommand
from noetl_flow.projection import ExecutionView, StepView
from noetl_flow.state import Pending, StepRun
from noetl_flow.transitions import DeadLetter
from noetl_store import PostgresResultStore, Reference
from noetl_store._postgres import loop_reference

pytestmark = pytest.mark.integration

# ---------------------------------------------------------------- the coverage map

STORE_MODULE = "noetl_store._postgres"
COVERED: dict[str, set[str]] = defaultdict(set)  # function -> the tests that exercise it
F = TypeVar("F", bound=Callable[..., Any])


def covers(*names: str) -> Callable[[F], F]:
    """Mark a test as exercising ``names`` (``module.function``, ``module.Class.method`` or
    ``module.STATEMENT``; relative to ``noetl_db`` unless they start with ``noetl_``)."""

    def mark(test: F) -> F:
        for name in names:
            COVERED[name if name.startswith("noetl_") else f"noetl_db.{name}"].add(test.__name__)
        return test

    return mark


def layer_modules() -> list[str]:
    found = [f"noetl_db.{m.name}" for m in pkgutil.iter_modules(noetl_db.__path__) if not m.name.startswith("_")]
    return [*sorted(found), STORE_MODULE]


def public_api() -> list[str]:
    """Every public function of the layer's modules (sync or async, module-level or a
    method of a class the module defines) and every public statement constant (a string
    naming a ``noetl.`` table that the module itself assigns: a statement or a fragment)."""
    names: list[str] = []
    for module_name in layer_modules():
        module = importlib.import_module(module_name)
        source = inspect.getsource(module)
        for attr, obj in vars(module).items():
            if attr.startswith("_"):
                continue
            if inspect.isfunction(obj) and obj.__module__ == module_name:
                names.append(f"{module_name}.{attr}")
            elif inspect.isclass(obj) and obj.__module__ == module_name:
                names.extend(f"{module_name}.{attr}.{m}" for m, f in vars(obj).items()
                             if not m.startswith("_") and inspect.isfunction(f))
            elif isinstance(obj, str) and "noetl." in obj and re.search(rf"^{attr}\b.*=", source, re.M):
                names.append(f"{module_name}.{attr}")
    return sorted(names)


PUBLIC = public_api()

# ---------------------------------------------------------------- isolation

TAG = f"conformance-{uuid.uuid4().hex[:8]}"
SHARD_LO, SHARD_HI = 700, 799
_shards = itertools.count(SHARD_LO)
_owners = itertools.count(9_700_000_000 + random.randrange(1_000_000) * 1_000)
IDS = SnowflakeGenerator(node_id=1018)
EIDS: set[int] = set()


def new_shard() -> int:
    shard = next(_shards)
    assert shard <= SHARD_HI, "the suite ran out of its shard range (700-799)"
    return shard


def new_owner() -> int:
    return next(_owners)


def new_eid() -> int:
    eid = IDS.next_id()
    EIDS.add(eid)
    return eid


def unique(what: str) -> str:
    return f"{TAG}-{what}-{uuid.uuid4().hex[:6]}"


CLEANUP = [
    "DELETE FROM noetl.redrive_request WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.dead_letter WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.cancel_request WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.quarantine WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.event WHERE execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.command WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.engine_state WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.concurrency_slot WHERE execution_id = ANY(%(ids)s) OR limit_id IN"
    " (SELECT limit_id FROM noetl.concurrency_limit WHERE path LIKE %(tag)s)",
    "DELETE FROM noetl.concurrency_wait WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.concurrency_limit WHERE path LIKE %(tag)s",
    "DELETE FROM noetl.loop_item WHERE execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.loop_result WHERE execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.execution_step WHERE execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.execution WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.manifest WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.result_ref WHERE execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.execution_request WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR execution_id = ANY(%(ids)s)",
    "DELETE FROM noetl.projection_checkpoint WHERE shard_id BETWEEN %(lo)s AND %(hi)s",
    "DELETE FROM noetl.checkpoint WHERE shard_id BETWEEN %(lo)s AND %(hi)s",
    "DELETE FROM noetl.schedule WHERE name LIKE %(tag)s",
    "DELETE FROM noetl.shard_lease WHERE shard_id BETWEEN %(lo)s AND %(hi)s OR role LIKE %(tag)s",
    "DELETE FROM noetl.runtime WHERE role LIKE %(tag)s",
    "DELETE FROM noetl.leader_lease WHERE name LIKE %(tag)s",
    "DELETE FROM noetl.api_token WHERE name LIKE %(tag)s",
    "DELETE FROM noetl.runtime_secret WHERE name LIKE %(tag)s",
    "DELETE FROM noetl.credential WHERE name LIKE %(tag)s",
    "DELETE FROM noetl.catalog WHERE path LIKE %(tag)s",
]


@pytest.fixture(scope="module")
async def _cleanup(pool: Pool) -> AsyncIterator[None]:
    yield
    async with autocommit(pool) as conn:
        for statement in CLEANUP:
            await conn.execute(statement, {"lo": SHARD_LO, "hi": SHARD_HI, "ids": sorted(EIDS), "tag": f"{TAG}%"})


@pytest.fixture
async def db(pool: Pool, _cleanup: None) -> Pool:
    """The module's pool (the rows the suite writes are deleted after its last test)."""
    return pool


@pytest.fixture(scope="module")
async def catalog_id(pool: Pool, _cleanup: None) -> int:
    """One registered playbook the suite's submissions and commands point to."""
    async with transaction(pool) as conn:
        row = await catalog.insert(conn, path=f"{TAG}/playbook", version=1, kind="Playbook", name="conformance",
                                   content="steps: []", sha256="0" * 64, doc={"steps": []})
    return int(row["catalog_id"])


# ---------------------------------------------------------------- helpers

async def sql(pool: Pool, query: str, params: Any = None) -> list[dict[str, Any]]:
    async with autocommit(pool) as conn:
        cur = await conn.execute(query, params)
        return list(await cur.fetchall()) if cur.description else []


async def sql1(pool: Pool, query: str, params: Any = None) -> dict[str, Any] | None:
    found = await sql(pool, query, params)
    return found[0] if found else None


@asynccontextmanager
async def connect(dsn: str, *, autocommit: bool = True) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection of its own (outside the pool): a holder to block or kill, a session setting."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit, row_factory=dict_row)
    try:
        yield conn
    finally:
        await conn.close()


async def put_lease(pool: Pool, role: str, shard: int, owner: int | None, epoch: int, *,
                    until: str = "now() + interval '1 minute'", **positions: int) -> None:
    """A shard lease row as a test wants it (last updated an hour ago)."""
    cols = ["role", "shard_id", "owner_runtime_id", "epoch", *positions]
    values = [role, shard, owner, epoch, *positions.values()]
    await sql(pool,
        f"INSERT INTO noetl.shard_lease ({', '.join(cols)}, leased_until, updated_at)"
        f" VALUES ({', '.join(['%s'] * len(cols))}, {until}, now() - interval '1 hour')"
        f" ON CONFLICT (role, shard_id) DO UPDATE SET owner_runtime_id = EXCLUDED.owner_runtime_id,"
        f" epoch = EXCLUDED.epoch, leased_until = EXCLUDED.leased_until, updated_at = EXCLUDED.updated_at"
        + "".join(f", {c} = EXCLUDED.{c}" for c in positions), values)


async def lease(pool: Pool, role: str, shard: int) -> dict[str, Any] | None:
    return await sql1(pool,
        "SELECT owner_runtime_id, epoch, stream_seq, event_seq, sweep_from, barrier_epoch, barrier_seq, updated_at,"
        " leased_until::text AS until, leased_until > now() + interval '99 years' AS forever,"
        " CASE WHEN isfinite(leased_until) THEN extract(epoch FROM leased_until - now())::float8 END AS left_sec"
        " FROM noetl.shard_lease WHERE role = %s AND shard_id = %s", (role, shard))


async def submit(pool: Pool, catalog_id: int, shard: int, *, eid: int | None = None, key: str | None = None,
                 parent: int | None = None, payload: str = '{"x": 1}', workload_ref_id: int | None = None) -> int:
    eid = eid or new_eid()
    async with autocommit(pool) as conn:
        assert await requests.insert_submission(
            conn, execution_id=eid, shard_id=shard, catalog_id=catalog_id, payload=payload, idempotency_key=key,
            parent_execution_id=parent, parent_step="call" if parent else None, timeout_sec=60.0, traceparent=None,
            depth=1 if parent else 0, workload_ref_id=workload_ref_id, payload_bytes=len(payload),
            submitted_by=None, rerun_of=None, rerun_from=None, priority=None)
    return eid


@dataclass(frozen=True)
class Placed:
    pool: str = "default"
    requires: dict[str, str] | None = None
    priority: str = "normal"


async def add_command(pool: Pool, catalog_id: int, shard: int, eid: int, *, step: str = "s", kind: str = "python",
                      attempt: int = 1, context: dict[str, Any] | None = None, placed: Placed = Placed()) -> str:
    command_id = f"{eid}:{step}:{uuid.uuid4().hex[:6]}"
    async with autocommit(pool) as conn:
        await commands.insert_commands(conn, shard, [
            (eid, catalog_id, NewCommand(command_id, step, kind, attempt, context or {}), placed)])
    return command_id


async def command(pool: Pool, command_id: str) -> dict[str, Any] | None:
    return await sql1(pool, "SELECT *, extract(epoch FROM lease_until - now())::float8 AS left_sec"
                            " FROM noetl.command WHERE command_id = %s", (command_id,))


async def add_dead_letter(pool: Pool, shard: int, eid: int, command_id: str | None = None) -> int:
    command_id = command_id or f"{eid}:dead:{uuid.uuid4().hex[:6]}"
    async with autocommit(pool) as conn:
        await dead_letters.insert_dead_letters(conn, shard, [
            (eid, DeadLetter(command_id, "s", 3, "failed", {"message": "boom"}, worker_id="w"))])
    row = await sql1(pool, "SELECT dead_letter_id FROM noetl.dead_letter WHERE command_id = %s", (command_id,))
    assert row is not None
    return int(row["dead_letter_id"])


async def quarantine(pool: Pool, shard: int, eid: int) -> None:
    async with autocommit(pool) as conn:
        await events.quarantine(conn, shard, eid, "event", None, 1, "unprocessable", None)


async def postmaster_age(pool: Pool) -> float:
    row = await sql1(pool, "SELECT extract(epoch FROM now() - pg_postmaster_start_time())::float8 AS age")
    assert row is not None
    return float(row["age"])


# ================================================================ the coverage of the suite

@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_function_has_a_conformance_test(name: str) -> None:
    short = name.removeprefix("noetl_db.")
    assert COVERED.get(name), f"{name} has no conformance test here: write one and mark it @covers({short!r})"


def test_the_coverage_map_names_only_functions_that_exist() -> None:
    assert len(PUBLIC) > 100 and "noetl_db.leases.fence" in PUBLIC, "the collection of the layer's functions broke"
    assert sorted(set(COVERED) - set(PUBLIC)) == []


# ================================================================ leases: the fence

@covers("leases.fence")
async def test_fence_returns_the_positions_of_a_held_lease_and_moves_the_stream_forward_only(db: Pool) -> None:
    role, shard, owner = unique("fence"), new_shard(), new_owner()
    await put_lease(db, role, shard, owner, 3, event_seq=5, stream_seq=10, sweep_from=2, barrier_epoch=1,
                    barrier_seq=4)
    async with transaction(db) as conn:
        got = await leases.fence(conn, role, shard, owner, 3)
    assert got == {"event_seq": 5, "stream_seq": 10, "sweep_from": 2, "barrier_epoch": 1, "barrier_seq": 4}
    row = await lease(db, role, shard)
    assert row is not None
    assert row["updated_at"] > datetime.now(UTC) - timedelta(minutes=1), "the fence touches updated_at"

    async def fenced_stream(stream_seq: int, reset: bool = False) -> int:
        async with transaction(db) as conn:
            return int((await leases.fence(conn, role, shard, owner, 3, stream_seq=stream_seq,
                                           reset=reset))["stream_seq"])

    assert await fenced_stream(7) == 10, "stream_seq only moves forward"
    assert await fenced_stream(12) == 12
    assert await fenced_stream(4, reset=True) == 4, "reset: the stream went back"
    assert (await lease(db, role, shard) or {})["stream_seq"] == 4


@covers("leases.fence")
@pytest.mark.parametrize("case", ["another owner", "an older epoch", "expired", "no deadline", "no row"])
async def test_fence_refuses_a_lease_that_is_not_held(db: Pool, case: str) -> None:
    role, shard, owner = unique("refuse"), new_shard(), new_owner()
    until = {"expired": "now() - interval '1 second'", "no deadline": "NULL"}.get(case, "now() + interval '1 minute'")
    if case != "no row":
        await put_lease(db, role, shard, owner, 3, until=until, stream_seq=10)
    def still(row: dict[str, Any] | None) -> dict[str, Any] | None:
        return row and {k: v for k, v in row.items() if k != "left_sec"}  # left_sec: relative to now

    before = still(await lease(db, role, shard))
    who, epoch = {"another owner": (new_owner(), 3), "an older epoch": (owner, 2)}.get(case, (owner, 3))
    with pytest.raises(LeaseLost):
        async with transaction(db) as conn:
            await leases.fence(conn, role, shard, who, epoch, stream_seq=99)
    assert still(await lease(db, role, shard)) == before, "a refused fence writes nothing"


@covers("leases.fence", "leases.move")
async def test_a_takeover_waits_for_the_fenced_transaction_then_fences_the_old_owner_out(db: Pool,
                                                                                          pg_dsn: str) -> None:
    role, shard, old, new = unique("move"), new_shard(), new_owner(), new_owner()
    await put_lease(db, role, shard, old, 1)
    async with connect(pg_dsn, autocommit=False) as holder, connect(pg_dsn) as other:
        await leases.fence(holder, role, shard, old, 1)  # the batch's transaction stays open
        await other.execute("SET lock_timeout = '150ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            await leases.move(other, role, shard, new, 30.0)
        await holder.commit()
        await leases.move(other, role, shard, new, 30.0)
    row = await lease(db, role, shard)
    assert row is not None
    assert (row["owner_runtime_id"], row["epoch"]) == (new, 2)
    assert 28 < row["left_sec"] <= 30
    with pytest.raises(LeaseLost):
        async with transaction(db) as conn:
            await leases.fence(conn, role, shard, old, 1)
    async with transaction(db) as conn:
        await leases.fence(conn, role, shard, new, 2)


@covers("leases.send_fence", "leases.fenced")
async def test_a_fence_sent_in_a_pipeline_is_read_after_the_statements_queued_behind_it(db: Pool) -> None:
    role, shard, owner = unique("pipe"), new_shard(), new_owner()
    await put_lease(db, role, shard, owner, 1, event_seq=7)
    async with pipelined_transaction(db) as conn:
        cursor = await leases.send_fence(conn, role, shard, owner, 1, stream_seq=3)
        behind = await conn.execute("SELECT event_seq FROM noetl.shard_lease WHERE role = %s AND shard_id = %s",
                                    (role, shard))
        got = await leases.fenced(cursor, role, shard, 1)
        assert (await behind.fetchone() or {})["event_seq"] == 7
    assert (got["event_seq"], got["stream_seq"]) == (7, 3)
    with pytest.raises(LeaseLost):
        async with pipelined_transaction(db) as conn:
            cursor = await leases.send_fence(conn, role, shard, new_owner(), 1)
            await leases.fenced(cursor, role, shard, 1)


@covers("leases.fenced_batch", "events.append_events_write",
        "engine_state.save_states_write", "commands.insert_commands_write", "commands.update_commands_write",
        "loops.store_loop_results_write", "limits.release_writes", "engine_state.unstarted_gate")
async def test_a_fenced_batch_writes_everything_in_one_statement_or_nothing(db: Pool, catalog_id: int) -> None:
    """The engine's one-statement batch: the fence (owner, epoch, lease not run out, and the
    event_seq the engine numbered from) guards every write; a fence that matches nothing
    leaves every table as it was."""
    role, shard, owner = unique("fast"), new_shard(), new_owner()
    await put_lease(db, role, shard, owner, 2, event_seq=40, stream_seq=5, sweep_from=100)
    eid, ended = new_eid(), new_eid()
    done_cmd = await add_command(db, catalog_id, shard, eid, step="a")
    async with autocommit(db) as conn:
        lid = (await limits.set_limit(conn, f"{TAG}/{unique('fastlimit')}", "", 3))["limit_id"]
        assert await limits.take_slot(conn, lid, "k", 3, ended, shard)
    new_cmd = f"{eid}:b:1"
    state = ExecState(eid, shard, catalog_id, ctx={"v": 1})

    def writes(seq: int) -> list[Write]:
        built = [
            events.append_events_write([EventRow(eid, shard, seq + 1, "call.done", "a", done_cmd, None, "{}"),
                                        EventRow(eid, shard, seq + 2, "step.enter", "b", new_cmd, None, "{}")]),
            engine_state.save_states_write(shard, [engine_state.StateRow(state, seq + 2, None)]),
            commands.insert_commands_write(shard, [QueuedCommand(eid, catalog_id, NewCommand(new_cmd, "b", "python", 1,
                                                                                           {"x": 1}), Placed())]),
            loops.store_loop_results_write([IterationResult(eid, "i1", 0, "ok", None)]),
            commands.update_commands_write([CommandUpdate(done_cmd, "done")]),
            *limits.release_writes([ended])]
        assert None not in built
        return [w for w in built if w is not None]

    async def batch(conn: Any, *, epoch: int = 2, event_seq: int = 40, starts: tuple[int, ...] = ()) -> bool:
        return await leases.fenced_batch(conn, role, shard, owner, epoch, event_seq=event_seq, stream_seq=9,
                                         positions=leases.EnginePositions(42, 50, 7, 41), writes=writes(40),
                                         checks=[engine_state.unstarted_gate(starts)] if starts else [])

    async def written() -> tuple[int, ...]:
        row = await sql1(db,
            "SELECT (SELECT count(*) FROM noetl.event WHERE execution_id = %(e)s) AS ev,"
            " (SELECT count(*) FROM noetl.engine_state WHERE execution_id = %(e)s) AS st,"
            " (SELECT count(*) FROM noetl.command WHERE command_id = %(c)s) AS cmd,"
            " (SELECT count(*) FROM noetl.loop_result WHERE execution_id = %(e)s) AS lr,"
            " (SELECT count(*) FROM noetl.command WHERE command_id = %(d)s AND status = 'done') AS upd,"
            " (SELECT count(*) FROM noetl.concurrency_slot WHERE execution_id = %(x)s) AS slot",
            {"e": eid, "c": new_cmd, "d": done_cmd, "x": ended}) or {}
        return tuple(int(v) for v in row.values())

    started, queued = new_eid(), new_eid()
    async with autocommit(db) as conn:
        await engine_state.save_states(conn, shard, [engine_state.StateRow(ExecState(started, shard, catalog_id), 1,
                                                                           None)])
        await limits.enqueue(conn, lid, "k", queued, shard)
    async with autocommit(db) as conn:
        assert await batch(conn, epoch=3) is False, "another epoch"
        assert await batch(conn, event_seq=39) is False, "the engine's event_seq is stale"
        assert await batch(conn, starts=(eid, started)) is False, "it would start an execution that has state"
        assert await batch(conn, starts=(queued,)) is False, "it would start an execution that waits in a queue"
    assert await written() == (0, 0, 0, 0, 0, 1), "a fence that matched nothing wrote nothing"
    row = await lease(db, role, shard) or {}
    assert (row["event_seq"], row["stream_seq"], row["sweep_from"]) == (40, 5, 100)
    await put_lease(db, role, shard, owner, 2, until="now() - interval '1 second'")
    async with autocommit(db) as conn:
        assert await batch(conn) is False, "the lease ran out"
    await put_lease(db, role, shard, owner, 2)
    async with autocommit(db) as conn:
        assert await batch(conn, starts=(eid, new_eid())) is True, "neither has state nor waits"
    assert await written() == (2, 1, 1, 1, 1, 0)
    row = await lease(db, role, shard) or {}
    assert (row["event_seq"], row["stream_seq"], row["sweep_from"], row["barrier_epoch"], row["barrier_seq"]) == (
        42, 9, 100, 7, 41), "sweep_from and stream_seq only move forward"
    async with autocommit(db) as conn:  # each write on its own (GUARD is TRUE there) as its function runs it
        assert await engine_state.load_states(conn, [eid]) == {eid: state}
        assert await batch(conn) is False, "the engine's event_seq moved on: a repeated batch writes nothing"
        await run(conn, None)
        await run(conn, commands.update_commands_write([CommandUpdate(new_cmd, "cancelled")]))
    assert (await command(db, new_cmd) or {})["status"] == "cancelled"


@covers("leases.assert_lease", "leases.finish_engine_batch")
async def test_a_batch_records_its_positions_and_commits_nothing_once_its_lease_ran_out(db: Pool) -> None:
    role, shard, owner = unique("batch"), new_shard(), new_owner()
    await put_lease(db, role, shard, owner, 1, event_seq=1, sweep_from=10)
    async with transaction(db) as conn:
        await leases.fence(conn, role, shard, owner, 1)
        await leases.finish_engine_batch(conn, role, shard, 9, 5, 2, 8)
        await leases.assert_lease(conn, role, shard, owner, 1)
    row = await lease(db, role, shard) or {}
    assert (row["event_seq"], row["sweep_from"], row["barrier_epoch"], row["barrier_seq"]) == (9, 10, 2, 8), \
        "sweep_from only moves forward"
    async with transaction(db) as conn:
        await leases.fence(conn, role, shard, owner, 1)
        await leases.finish_engine_batch(conn, role, shard, 11, 20, 3, 10)
    assert ((await lease(db, role, shard)) or {})["sweep_from"] == 20

    with pytest.raises(LeaseLost):
        async with transaction(db) as conn:
            await leases.fence(conn, role, shard, owner, 1)
            await leases.finish_engine_batch(conn, role, shard, 99, 99, 9, 99)
            # this process froze mid-batch: the lease ran out on the database's clock
            await conn.execute("UPDATE noetl.shard_lease SET leased_until = clock_timestamp() - interval '1 second'"
                               " WHERE role = %s AND shard_id = %s", (role, shard))
            await leases.assert_lease(conn, role, shard, owner, 1)
    row = await lease(db, role, shard) or {}
    assert (row["event_seq"], row["sweep_from"], row["left_sec"] > 0) == (11, 20, True), "nothing committed late"
    with pytest.raises(LeaseLost):
        async with transaction(db) as conn:
            await leases.assert_lease(conn, role, shard, new_owner(), 1)


# ================================================================ leases: a member's leases

@covers("leases.renew", "leases.assignments")
async def test_renew_extends_exactly_the_terms_held(db: Pool) -> None:
    role, owner, other = unique("renew"), new_owner(), new_owner()
    s1, s2, s3, s4 = (new_shard() for _ in range(4))
    soon = "now() + interval '5 seconds'"
    await put_lease(db, role, s1, owner, 1, until=soon)
    await put_lease(db, role, s2, owner, 4, until=soon)
    await put_lease(db, role, s3, other, 1, until=soon)
    await put_lease(db, role, s4, owner, 2, until=soon)
    async with autocommit(db) as conn:
        assert await leases.renew(conn, role, owner, 60.0, {}) == {}
        # s2 at another epoch (it moved and came back), s3 someone else's, s4 not asked
        assert await leases.renew(conn, role, owner, 60.0, {s1: 1, s2: 3, s3: 1}) == {s1: 1}
        mine = await leases.assignments(conn, role, owner)
    left = {s: (await lease(db, role, s) or {})["left_sec"] for s in (s1, s2, s3, s4)}
    assert 58 < left[s1] <= 60 and all(v < 6 for s, v in left.items() if s != s1)
    assert [(r["shard_id"], r["epoch"]) for r in mine] == [(s1, 1), (s2, 4), (s4, 2)]
    assert all(isinstance(r["leased_until"], datetime) for r in mine)


@covers("leases.ensure_shards", "leases.owners")
async def test_ensure_shards_adds_only_missing_rows_without_waiting_on_a_fenced_one(db: Pool, pg_dsn: str) -> None:
    a, b, owner = unique("ens-a"), unique("ens-b"), new_owner()
    await put_lease(db, a, 0, owner, 5)
    async with connect(pg_dsn, autocommit=False) as holder, connect(pg_dsn) as conn:
        await leases.fence(holder, a, 0, owner, 5)  # a member's batch holds shard 0 of role a
        await conn.execute("SET lock_timeout = '300ms'")
        await leases.ensure_shards(conn, [a, b], 3)
        await leases.ensure_shards(conn, [a, b], 3)
        await holder.rollback()
    found = await sql(db, "SELECT role, shard_id, owner_runtime_id, epoch FROM noetl.shard_lease"
                          " WHERE role = ANY(%s) ORDER BY role, shard_id", ([a, b],))
    assert [(r["role"], r["shard_id"], r["owner_runtime_id"], r["epoch"]) for r in found] == [
        (a, 0, owner, 5), (a, 1, None, 0), (a, 2, None, 0), (b, 0, None, 0), (b, 1, None, 0), (b, 2, None, 0)]
    async with autocommit(db) as conn:
        got = await leases.owners(conn, [a, b], 2)
    assert sorted((r["role"], r["shard_id"], r["owner_runtime_id"]) for r in got) == [
        (a, 0, owner), (a, 1, None), (b, 0, None), (b, 1, None)]


@covers("leases.free_leases")
async def test_free_leases_frees_every_lease_of_the_member_and_only_its(db: Pool) -> None:
    r1, r2, owner, other = unique("free1"), unique("free2"), new_owner(), new_owner()
    s1, s2, s3 = new_shard(), new_shard(), new_shard()
    await put_lease(db, r1, s1, owner, 1)
    await put_lease(db, r2, s2, owner, 2)
    await put_lease(db, r1, s3, other, 1)
    async with autocommit(db) as conn:
        await leases.free_leases(conn, owner)
    got = {s: await lease(db, r, s) or {} for r, s in ((r1, s1), (r2, s2), (r1, s3))}
    assert [(got[s]["owner_runtime_id"], got[s]["left_sec"], got[s]["epoch"]) for s in (s1, s2)] == [
        (None, None, 1), (None, None, 2)]
    assert got[s3]["owner_runtime_id"] == other and got[s3]["left_sec"] > 0


@covers("leases.end_lease_holder")
async def test_end_lease_holder_ends_the_session_holding_the_row(db: Pool, pg_dsn: str) -> None:
    role, shard, owner = unique("end"), new_shard(), new_owner()
    await put_lease(db, role, shard, owner, 1)
    async with autocommit(db) as conn:
        assert await leases.end_lease_holder(conn, role, shard) == [], "nobody holds it"
    async with connect(pg_dsn, autocommit=False) as holder:
        await leases.fence(holder, role, shard, owner, 1)
        pid = holder.info.backend_pid
        async with autocommit(db) as conn:
            assert await leases.end_lease_holder(conn, role, shard) == [pid]
        with pytest.raises(psycopg.OperationalError):
            await holder.execute("SELECT 1")
    async with connect(pg_dsn) as conn:
        await conn.execute("SET lock_timeout = '5s'")
        await leases.move(conn, role, shard, new_owner(), 30.0)  # the row is free again
        assert await leases.end_lease_holder(conn, role, shard) == []


@covers("leases.shards_of")
async def test_shards_of_lists_a_role_s_leases_with_their_owner_s_instance(db: Pool) -> None:
    role, other = unique("of"), unique("of2")
    s1, s2, s3 = new_shard(), new_shard(), new_shard()
    async with transaction(db) as conn:
        member = await leases.join(conn, role, "instance-of", "", "", 1, "", None, None, None)
    await put_lease(db, role, s2, member["runtime_id"], 3)
    await put_lease(db, role, s1, None, 0)
    await put_lease(db, other, s3, None, 0)
    async with autocommit(db) as conn:
        mine = await leases.shards_of(conn, role)
        every = await leases.shards_of(conn, "")
    assert [(r["role"], r["shard_id"], r["owner_runtime_id"], r["epoch"], r["owner_instance"]) for r in mine] == [
        (role, s1, None, 0, None), (role, s2, member["runtime_id"], 3, "instance-of")]
    assert {(role, s1), (role, s2), (other, s3)} <= {(r["role"], r["shard_id"]) for r in every}


# ================================================================ leases: members

async def alive_node_ids(conn: Any) -> set[int]:
    cur = await conn.execute("SELECT node_id FROM noetl.runtime WHERE status = 'alive' AND node_id IS NOT NULL")
    return {r["node_id"] for r in await cur.fetchall()}


@covers("leases.join", "leases.leave")
async def test_join_takes_the_lowest_free_node_id_and_records_what_the_member_declared(db: Pool) -> None:
    role = unique("join")
    async with transaction(db) as conn:
        free = sorted(set(range(1023)) - await alive_node_ids(conn))
        a = await leases.join(conn, role, "inst-a", "10.0.0.1:50051", "10.0.0.1:9090", 4242, "sha-a",
                              ["default", "gpu"], {"zone": "z1"}, ["python", "http"])
    async with transaction(db) as conn:
        b = await leases.join(conn, role, "inst-b", "", "", 1, "sha-b", None, None, None)
    assert (a["node_id"], b["node_id"]) == (free[0], free[1])
    row = await sql1(db, "SELECT * FROM noetl.runtime WHERE runtime_id = %s", (a["runtime_id"],)) or {}
    assert {k: row[k] for k in ("role", "instance", "address", "metrics_address", "pid", "node_id",
                                "member_secret_sha256", "pools", "labels", "tools", "status")} == {
        "role": role, "instance": "inst-a", "address": "10.0.0.1:50051", "metrics_address": "10.0.0.1:9090",
        "pid": 4242, "node_id": free[0], "member_secret_sha256": "sha-a", "pools": ["default", "gpu"],
        "labels": {"zone": "z1"}, "tools": ["python", "http"], "status": "alive"}
    row = await sql1(db, "SELECT pools, labels, tools FROM noetl.runtime WHERE runtime_id = %s",
                     (b["runtime_id"],))
    assert row == {"pools": None, "labels": None, "tools": None}

    async with autocommit(db) as conn:
        assert await leases.leave(conn, a["runtime_id"], "sha-a")
    async with transaction(db) as conn:
        c = await leases.join(conn, role, "inst-c", "", "", 1, "sha-c", None, None, None)
    assert c["node_id"] == free[0], "a member that left gives its node id back"

    async def join_one(n: int) -> int:
        async with transaction(db) as conn:
            return int((await leases.join(conn, role, f"inst-{n}", "", "", 1, "", None, None, None))["node_id"])

    concurrent = await asyncio.gather(*(join_one(n) for n in range(4)))
    assert len(set(concurrent)) == 4, "concurrent joins are serialised onto distinct node ids"


@covers("leases.heartbeat", "leases.leave")
async def test_heartbeat_and_leave_answer_only_the_member_holding_its_secret(db: Pool) -> None:
    role = unique("hb")
    async with transaction(db) as conn:
        m = (await leases.join(conn, role, "inst", "", "", 1, "secret-sha", None, None, None))["runtime_id"]
    await sql(db, "UPDATE noetl.runtime SET heartbeat_at = now() - interval '1 hour' WHERE runtime_id = %s", (m,))
    async with autocommit(db) as conn:
        assert await leases.heartbeat(conn, m) is True
        assert await leases.heartbeat(conn, m, "secret-sha") is True
        assert await leases.heartbeat(conn, m, "wrong") is False
        assert await leases.heartbeat(conn, -1) is False
        assert await leases.leave(conn, m, "wrong") is False
        assert await leases.leave(conn, -1) is False
    row = await sql1(db, "SELECT status, heartbeat_at > now() - interval '1 minute' AS fresh FROM noetl.runtime"
                         " WHERE runtime_id = %s", (m,))
    assert row == {"status": "alive", "fresh": True}
    async with autocommit(db) as conn:
        assert await leases.leave(conn, m, "secret-sha") is True
        assert await leases.heartbeat(conn, m) is False, "a member that left is not alive"
    assert (await sql1(db, "SELECT status FROM noetl.runtime WHERE runtime_id = %s", (m,)) or {})["status"] == "left"


@covers("leases.live_members", "leases.members")
async def test_members_lists_the_alive_and_the_recently_seen(db: Pool) -> None:
    role, other = unique("mem"), unique("mem2")
    ids = {}
    async with transaction(db) as conn:
        for name, r in (("alive", role), ("gone", role), ("dead", role), ("other", other)):
            ids[name] = (await leases.join(conn, r, name, "", "", 1, "", None, None, None))["runtime_id"]
    async with autocommit(db) as conn:
        await leases.leave(conn, ids["gone"])
    await sql(db, "UPDATE noetl.runtime SET status = 'dead', heartbeat_at = now() - interval '1 hour'"
                  " WHERE runtime_id = %s", (ids["dead"],))
    async with autocommit(db) as conn:
        live = await leases.live_members(conn, [role])
        live_both = await leases.live_members(conn, [role, other])
        mine = await leases.members(conn, role)
        every = await leases.members(conn, "")
    assert live == [{"runtime_id": ids["alive"], "role": role}]
    assert sorted((r["runtime_id"], r["role"]) for r in live_both) == sorted(
        [(ids["alive"], role), (ids["other"], other)])
    assert [(r["runtime_id"], r["instance"], r["alive"]) for r in mine] == [
        (ids["alive"], "alive", True), (ids["gone"], "gone", False)]
    assert {ids["alive"], ids["gone"], ids["other"]} <= {r["runtime_id"] for r in every}
    assert ids["dead"] not in {r["runtime_id"] for r in every}


@covers("leases.declare_dead")
async def test_declare_dead_takes_silent_members_but_never_within_a_lease_of_the_database_start(db: Pool) -> None:
    role = unique("dead")
    async with transaction(db) as conn:
        silent = (await leases.join(conn, role, "silent", "", "", 1, "", None, None, None))["runtime_id"]
        fresh = (await leases.join(conn, role, "fresh", "", "", 1, "", None, None, None))["runtime_id"]
    await sql(db, "UPDATE noetl.runtime SET heartbeat_at = now() - interval '10 days' WHERE runtime_id = %s",
              (silent,))
    async with autocommit(db) as conn:
        # a lease longer than the server has been up: a restart is everyone's missed heartbeat
        got = await leases.declare_dead(conn, await postmaster_age(db) + 60)
    assert silent not in {r["runtime_id"] for r in got}
    age = await postmaster_age(db)
    if age < 2.5:  # a sleep, not a wait: the server's age is the condition, this is what is left of it
        await asyncio.sleep(2.5 - age)
    async with autocommit(db) as conn:
        await leases.heartbeat(conn, fresh)
        got = await leases.declare_dead(conn, 2.0)
        assert await leases.heartbeat(conn, silent) is False
    mine = [r for r in got if r["runtime_id"] in (silent, fresh)]
    assert mine == [{"runtime_id": silent, "role": role, "instance": "silent"}]
    found = await sql(db, "SELECT runtime_id, status FROM noetl.runtime WHERE role = %s", (role,))
    assert {r["runtime_id"]: r["status"] for r in found} == {silent: "dead", fresh: "alive"}


# ================================================================ leases: leadership, positions

@covers("leases.try_lead", "leases.resign", "leases.leader")
async def test_try_lead_gives_one_leader_and_bumps_the_epoch_on_every_takeover(db: Pool) -> None:
    name = unique("leader")
    contenders = [new_owner() for _ in range(5)]
    async with autocommit(db) as conn:
        assert await leases.leader(conn, name) is None

    async def lead(runtime_id: int) -> int | None:
        async with autocommit(db) as conn:
            return await leases.try_lead(conn, name, runtime_id, f"i{runtime_id}", 30.0)

    got = dict(zip(contenders, await asyncio.gather(*(lead(c) for c in contenders)), strict=True))
    winners = [c for c, epoch in got.items() if epoch is not None]
    assert len(winners) == 1 and got[winners[0]] == 1, got
    a = winners[0]
    b = next(c for c in contenders if c != a)
    async with autocommit(db) as conn:
        row = await leases.leader(conn, name) or {}
        assert (row["holder_runtime_id"], row["holder_instance"], row["epoch"]) == (a, f"i{a}", 1)
        assert await leases.try_lead(conn, name, a, f"i{a}", 30.0) == 1, "a renewal keeps the epoch"
        assert await leases.try_lead(conn, name, b, f"i{b}", 30.0) is None
        await leases.resign(conn, name, b)  # not the holder's: changes nothing
        assert await leases.try_lead(conn, name, b, f"i{b}", 30.0) is None
    await sql(db, "UPDATE noetl.leader_lease SET leased_until = now() - interval '1 second' WHERE name = %s", (name,))
    async with autocommit(db) as conn:
        assert await leases.try_lead(conn, name, b, f"i{b}", 30.0) == 2, "a takeover of an expired lease"
        assert await leases.try_lead(conn, name, a, f"i{a}", 30.0) is None
        await leases.resign(conn, name, b)
        assert await leases.try_lead(conn, name, a, f"i{a}", 30.0) == 3, "a resigned lease is free at once"
        row = await leases.leader(conn, name) or {}
    assert (row["holder_runtime_id"], row["epoch"]) == (a, 3)
    assert row["leased_until"] > datetime.now(UTC) + timedelta(seconds=20)


@covers("leases.assign", "leases.held_positions", "leases.sweep_from")
async def test_assign_held_positions_and_sweep_from(db: Pool) -> None:
    role, shard, first, second = unique("assign"), new_shard(), new_owner(), new_owner()
    async with autocommit(db) as conn:
        await leases.assign(conn, role, shard, first, 4)
        await leases.assign(conn, role, shard, second, 5)
    row = await lease(db, role, shard) or {}
    assert (row["owner_runtime_id"], row["epoch"], row["forever"]) == (second, 5, True)
    async with transaction(db) as conn:
        await leases.fence(conn, role, shard, second, 5)  # no deadline runs out
    await sql(db, "UPDATE noetl.shard_lease SET stream_seq = 3, event_seq = 8, sweep_from = 42"
                  " WHERE role = %s AND shard_id = %s", (role, shard))
    async with autocommit(db) as conn:
        assert await leases.held_positions(conn, role, shard, second, 5) == {"stream_seq": 3, "event_seq": 8}
        assert await leases.held_positions(conn, role, shard, first, 5) is None
        assert await leases.held_positions(conn, role, shard, second, 4) is None
        assert await leases.sweep_from(conn, role, shard) == 42
        assert await leases.sweep_from(conn, role, new_shard()) == 0


# ================================================================ events

@covers("events.quarantine")
async def test_quarantine_records_the_input_and_a_bounded_error(db: Pool) -> None:
    shard, eid = new_shard(), new_eid()
    async with autocommit(db) as conn:
        await events.quarantine(conn, shard, eid, "result", 17, 3, "x" * 5000, b"\x00raw")
        await events.quarantine(conn, shard, eid, "cancel", None, 1, "short", None)
    found = await sql(db, "SELECT shard_id, execution_id, input_kind, stream_seq, attempts, length(error) AS n,"
                          " input FROM noetl.quarantine WHERE execution_id = %s ORDER BY quarantine_id", (eid,))
    assert found == [
        {"shard_id": shard, "execution_id": eid, "input_kind": "result", "stream_seq": 17, "attempts": 3,
         "n": 4000, "input": b"\x00raw"},
        {"shard_id": shard, "execution_id": eid, "input_kind": "cancel", "stream_seq": None, "attempts": 1,
         "n": 5, "input": None}]


@covers("events.append_events", "events.DELETE_EVENTS", "events.DELETE_BARRIERS")
async def test_append_events_writes_the_batch_and_the_deletes_take_what_they_name(db: Pool) -> None:
    shard, e1, e2 = new_shard(), new_eid(), new_eid()
    result = {"status": "ok", "reference": {"ref_id": 1, "type": "db", "uri": "pg://result_payload/1"}}
    async with autocommit(db) as conn:
        await events.append_events(conn, [])
        await events.append_events(conn, [
            (e1, shard, 1, "playbook.started", None, None, None, "{}"),
            (e1, shard, 2, "call.done", "s1", "c1", json.dumps(result), json.dumps({"attempt": 1})),
            (e2, shard, 3, "checkpoint.barrier", None, None, None, "{}")])
    found = await sql(db, "SELECT execution_id, shard_id, shard_seq, event_type, step, command_id, result, meta,"
                          " event_id FROM noetl.event WHERE shard_id = %s ORDER BY shard_seq", (shard,))
    assert [(r["execution_id"], r["shard_seq"], r["event_type"], r["step"], r["command_id"], r["result"], r["meta"])
            for r in found] == [
        (e1, 1, "playbook.started", None, None, None, {}),
        (e1, 2, "call.done", "s1", "c1", result, {"attempt": 1}),
        (e2, 3, "checkpoint.barrier", None, None, None, {})]
    assert found[0]["event_id"] < found[1]["event_id"] < found[2]["event_id"]
    async with autocommit(db) as conn:
        cur = await conn.execute(events.DELETE_BARRIERS, {"ids": [e1, e2], "barrier": "checkpoint.barrier"})
        assert cur.rowcount == 1
        cur = await conn.execute(events.DELETE_EVENTS, {"ids": [e1]})
        assert cur.rowcount == 2
    assert await sql(db, "SELECT 1 FROM noetl.event WHERE shard_id = %s", (shard,)) == []


# ================================================================ commands

@covers("commands.insert_commands", "commands.queued_commands", "commands.state", "commands.placement_of")
async def test_insert_commands_queues_them_once_with_their_placement(db: Pool, catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    c1, c2 = f"{eid}:s1:1", f"{eid}:s2:1"
    async with autocommit(db) as conn:
        await commands.insert_commands(conn, shard, [])
        await commands.insert_commands(conn, shard, [
            (eid, catalog_id, NewCommand(c1, "s1", "python", 1, {"a": 1}, 5.0), Placed())])
        await commands.insert_commands(conn, shard, [
            (eid, catalog_id, NewCommand(c2, "s2", "http", 2, {}), Placed("gpu", {"zone": "z1"}, "high"))])
        # a retried batch: the same command id inserts nothing
        await commands.insert_commands(conn, shard, [
            (eid, catalog_id, NewCommand(c1, "other", "http", 9, {}, 1.0), Placed("x", None, "low"))])
    row = await command(db, c1) or {}
    assert {k: row[k] for k in ("execution_id", "shard_id", "catalog_id", "step", "kind", "status", "attempt",
                                "context", "timeout_sec", "pool", "requires", "priority", "worker_id")} == {
        "execution_id": eid, "shard_id": shard, "catalog_id": catalog_id, "step": "s1", "kind": "python",
        "status": "queued", "attempt": 1, "context": {"a": 1}, "timeout_sec": 5.0, "pool": "default",
        "requires": None, "priority": "normal", "worker_id": None}
    row = await command(db, c2) or {}
    assert (row["pool"], row["requires"], row["priority"], row["attempt"]) == ("gpu", {"zone": "z1"}, "high", 2)
    async with autocommit(db) as conn:
        queued = await commands.queued_commands(conn, shard)
        assert [(r["command_id"], r["execution_id"], r["attempt"], r["kind"], r["pool"], r["priority"])
                for r in queued] == [(c1, eid, 1, "python", "default", "normal"), (c2, eid, 2, "http", "gpu", "high")]
        await commands.update_commands(conn, [CommandUpdate(c1, "done")])
        assert [r["command_id"] for r in await commands.queued_commands(conn, shard)] == [c2]
        assert await commands.state(conn, c1) == {"status": "done", "attempt": 1, "worker_id": None}
        assert await commands.state(conn, "no-such-command") is None
        placed = await commands.placement_of(conn, [c1, c2, "no-such-command"])
    assert placed == {
        c1: {"command_id": c1, "status": "done", "attempt": 1, "worker_id": None, "pool": "default",
             "requires": None, "kind": "python"},
        c2: {"command_id": c2, "status": "queued", "attempt": 2, "worker_id": None, "pool": "gpu",
             "requires": {"zone": "z1"}, "kind": "http"}}


@covers("commands.insert_commands")
async def test_insert_commands_inserts_a_handed_off_command_claimed_by_its_worker(db: Pool, catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    c1, c2 = f"{eid}:s1:1", f"{eid}:s2:1"
    async with autocommit(db) as conn:
        await commands.insert_commands(conn, shard, [
            QueuedCommand(eid, catalog_id, NewCommand(c1, "s1", "python", 1, {}), Placed(), "worker-7"),
            QueuedCommand(eid, catalog_id, NewCommand(c2, "s2", "python", 1, {}), Placed())], lease_sec=30.0)
        queued = [r["command_id"] for r in await commands.queued_commands(conn, shard)]
    assert queued == [c2]
    row = await command(db, c1) or {}
    assert (row["status"], row["worker_id"], row["claimed_at"]) == ("claimed", "worker-7", row["created_at"])
    assert (row["lease_until"] - row["created_at"]).total_seconds() == 30.0
    # its worker renews it as it would a claim; nobody else claims it
    async with autocommit(db) as conn:
        assert await commands.renew(conn, c1, "worker-7", 1, 30.0, None) is not None
        assert await commands.claim(conn, [(c1, 1)], "worker-8", 30.0, pools=["default"], labels={}, tools=[],
                                    need_payload=[]) == {}
    row = await command(db, c2) or {}
    assert (row["status"], row["worker_id"], row["claimed_at"], row["lease_until"]) == ("queued", None, None, None)


@covers("commands.update_commands")
async def test_update_commands_folds_several_updates_of_one_command_in_order(db: Pool, catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    c1, c2, c3 = [await add_command(db, catalog_id, shard, eid, step=s) for s in ("a", "b", "c")]
    await sql(db, "UPDATE noetl.command SET status = 'claimed', worker_id = 'w1' WHERE command_id = ANY(%s)",
              ([c1, c2],))
    async with autocommit(db) as conn:
        await commands.update_commands(conn, [])
        await commands.update_commands(conn, [
            CommandUpdate(c1, "queued", 2), CommandUpdate(c1, "done"),  # re-queued on the way: the worker goes
            CommandUpdate(c2, "failed"),
            CommandUpdate(c3, "queued", 4), CommandUpdate(c3, "cancelled", 5)])
        got = {c: await commands.state(conn, c) for c in (c1, c2, c3)}
    assert got == {c1: {"status": "done", "attempt": 2, "worker_id": None},
                   c2: {"status": "failed", "attempt": 1, "worker_id": "w1"},
                   c3: {"status": "cancelled", "attempt": 5, "worker_id": None}}


@covers("commands.expired_claims", "commands.stale_queued", "commands.unschedulable")
async def test_the_reapers_reads_find_expired_claims_stale_and_unschedulable_commands(db: Pool,
                                                                                      catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    pool = unique("nowhere")[:30].replace(":", "-")
    held, expired, fresh, stale = [await add_command(db, catalog_id, shard, eid, step=s) for s in "hefs"]
    lonely = await add_command(db, catalog_id, shard, eid, step="l", placed=Placed(pool, None, "normal"))
    await sql(db, "UPDATE noetl.command SET status = 'claimed', worker_id = 'w', lease_until = now() + interval '1 h'"
                  " WHERE command_id = %s", (held,))
    await sql(db, "UPDATE noetl.command SET status = 'claimed', worker_id = 'w', lease_until = now() - interval '1 s'"
                  " WHERE command_id = %s", (expired,))
    await sql(db, "UPDATE noetl.command SET updated_at = now() - interval '1 h' WHERE command_id = ANY(%s)",
              ([stale, lonely],))
    async with autocommit(db) as conn:
        # within a lease of the database's start nothing is judged (a restart stops renewals)
        started = await conn.execute("SELECT extract(epoch FROM now() - pg_postmaster_start_time()) AS up")
        up = float((await started.fetchone() or {})["up"])
        other = new_shard()  # the reads are for a set of shards: rows of others are not theirs
        assert [(r["command_id"], r["shard_id"]) for r in await commands.expired_claims(conn, [shard, other], 0.001)
                ] == [(expired, shard)]
        assert await commands.expired_claims(conn, [other], 0.001) == []
        assert await commands.expired_claims(conn, [shard], up + 3600) == []
        assert await commands.expired_claims(conn, [], 0.001) == []
        found = await commands.stale_queued(conn, [other, shard], 60)
        assert {(r["command_id"], r["shard_id"]) for r in found} == {(stale, shard), (lonely, shard)}
        assert {r["command_id"] for r in await commands.stale_queued(conn, [shard], 7200)} == set()
        assert await commands.stale_queued(conn, [other], 60) == []
        assert fresh not in {r["command_id"] for r in found}
        waiting = await commands.unschedulable(conn, [shard, other])
        assert await commands.unschedulable(conn, []) == {}
    assert waiting[shard].get(pool) == 1  # no live worker serves that pool
    assert other not in waiting


async def claim(pool: Pool, wanted: list[tuple[str, int]], worker: str, *, pools: list[str] | None = None,
                labels: dict[str, str] | None = None, tools: list[str] | None = None,
                need_payload: list[int] | None = None) -> dict[str, dict[str, Any]]:
    async with autocommit(pool) as conn:
        return await commands.claim(conn, wanted, worker, 30.0, pools=pools or ["default"], labels=labels or {},
                                    tools=tools or [], need_payload=need_payload or [])


@covers("commands.claim")
async def test_claim_gives_commands_only_to_a_worker_that_qualifies(db: Pool, catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    plain = await add_command(db, catalog_id, shard, eid, step="plain")
    gpu = await add_command(db, catalog_id, shard, eid, step="gpu", placed=Placed("gpu", {"gpu": "a100"}))
    http = await add_command(db, catalog_id, shard, eid, step="http", kind="http")

    got = await claim(db, [(plain, 1), (gpu, 1), (http, 1)], "w1", tools=["python"])
    assert set(got) == {plain}, "gpu: another pool; http: a tool the worker does not run"
    row = await command(db, plain) or {}
    assert (row["status"], row["worker_id"], row["claimed_at"] is not None) == ("claimed", "w1", True)
    assert 28 < row["left_sec"] <= 30
    assert got[plain]["worker_id"] == "w1" and got[plain]["status"] == "claimed"
    assert (await command(db, gpu) or {})["status"] == "queued"

    assert await claim(db, [(gpu, 1)], "w2", pools=["gpu"], labels={"gpu": "t4"}) == {}, "labels do not satisfy"
    assert await claim(db, [(gpu, 1)], "w2", pools=["default"], labels={"gpu": "a100"}) == {}, "not its pool"
    assert set(await claim(db, [(gpu, 1)], "w2", pools=["default", "gpu"], labels={"gpu": "a100", "zone": "z"})) \
        == {gpu}
    assert set(await claim(db, [(http, 1)], "w3", tools=[])) == {http}, "no tools declared: every kind"
    assert [((await command(db, c)) or {})["worker_id"] for c in (gpu, http)] == ["w2", "w3"]


@covers("commands.claim")
async def test_claim_takes_the_asked_attempt_and_gives_a_lost_claim_back_to_its_worker(db: Pool,
                                                                                      catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    c = await add_command(db, catalog_id, shard, eid, attempt=2)
    assert await claim(db, [(c, 1)], "w1") == {}, "an older attempt"
    assert set(await claim(db, [(c, 0)], "w1")) == {c}, "attempt 0: any"
    await sql(db, "UPDATE noetl.command SET lease_until = now() + interval '1 second' WHERE command_id = %s", (c,))
    again = await claim(db, [(c, 2)], "w1")
    assert set(again) == {c} and again[c]["attempt"] == 2, "its first claim's answer was lost: it gets it back"
    assert 28 < ((await command(db, c)) or {})["left_sec"] <= 30, "with a new lease"
    assert await claim(db, [(c, 2)], "w2") == {}, "another worker does not"
    async with autocommit(db) as conn:
        assert await commands.state(conn, c) == {"status": "claimed", "attempt": 2, "worker_id": "w1"}
    await sql(db, "UPDATE noetl.command SET status = 'done' WHERE command_id = %s", (c,))
    assert await claim(db, [(c, 2)], "w1") == {}, "a finished command is claimed by nobody"


@covers("commands.claim")
async def test_claim_returns_the_loop_item_and_the_payload_asked_for(db: Pool, catalog_id: int) -> None:
    shard = new_shard()
    e1 = await submit(db, catalog_id, shard, payload='{"x": 1}')
    e2 = await submit(db, catalog_id, shard, payload="{}", workload_ref_id=123)
    async with autocommit(db) as conn:
        await loops.store_loop_items(conn, e1, "loop1", ["a", "b", "c"])
    c1 = await add_command(db, catalog_id, shard, e1, context={"loop": {"instance": "loop1", "index": 1}})
    c2 = await add_command(db, catalog_id, shard, e1)
    c3 = await add_command(db, catalog_id, shard, e2)
    c4 = await add_command(db, catalog_id, shard, e1)
    got = await claim(db, [(c1, 1), (c2, 1), (c3, 1)], "w", need_payload=[e1, e2])
    assert (got[c1]["loop_item"], got[c1]["has_item"], got[c1]["payload"]) == ("b", True, {"x": 1})
    assert (got[c2]["loop_item"], got[c2]["has_item"], got[c2]["payload"]) == (None, False, {"x": 1})
    assert (got[c3]["payload"], got[c3]["workload_ref_id"]) == (None, 123), "a workload: its reference only"
    assert (await claim(db, [(c4, 1)], "w"))[c4]["payload"] is None, "the payload only when asked for"


@covers("commands.holder")
async def test_holder_is_the_command_as_get_credential_checks_it(db: Pool, catalog_id: int) -> None:
    shard = new_shard()
    eid = await submit(db, catalog_id, shard, payload='{"x": 1}')
    c = await add_command(db, catalog_id, shard, eid, step="fetch", context={"cursor": {"page": 2}})
    await claim(db, [(c, 1)], "w1")
    orphan = await add_command(db, catalog_id, shard, new_eid())
    async with autocommit(db) as conn:
        assert await commands.holder(conn, c) == {
            "command_id": c, "execution_id": eid, "step": "fetch", "attempt": 1, "status": "claimed",
            "worker_id": "w1", "catalog_id": catalog_id, "cursor": {"page": 2}, "payload": {"x": 1},
            "workload_ref_id": None}
        row = await commands.holder(conn, orphan) or {}
        assert (row["cursor"], row["payload"], row["workload_ref_id"]) == (None, None, None)
        assert await commands.holder(conn, "no-such-command") is None


@covers("commands.renew")
async def test_renew_extends_only_the_holder_s_claim_of_that_attempt(db: Pool, catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    c = await add_command(db, catalog_id, shard, eid)
    await claim(db, [(c, 1)], "w1")
    async with autocommit(db) as conn:
        got = await commands.renew(conn, c, "w1", 1, 90.0, json.dumps({"rows": 3}))
        assert got is not None and got["lease_until"] > datetime.now(UTC) + timedelta(seconds=80)
        assert await commands.renew(conn, c, "w1", 1, 90.0, None) is not None
        before = await command(db, c) or {}
        assert before["progress"] == {"rows": 3}, "no progress given: the last one stays"
        assert await commands.renew(conn, c, "w2", 1, 300.0, json.dumps({"rows": 9})) is None
        assert await commands.renew(conn, c, "w1", 2, 300.0, None) is None
    after = await command(db, c) or {}
    assert (after["lease_until"], after["progress"]) == (before["lease_until"], {"rows": 3})
    await sql(db, "UPDATE noetl.command SET status = 'done' WHERE command_id = %s", (c,))
    async with autocommit(db) as conn:
        assert await commands.renew(conn, c, "w1", 1, 90.0, None) is None, "not claimed any more"


# ================================================================ engine_state

@covers("engine_state.save_states", "engine_state.load_states", "engine_state.overdue", "events.NOT_QUARANTINED")
async def test_engine_states_round_trip_and_overdue_lists_running_executions_past_deadline(db: Pool,
                                                                                          catalog_id: int) -> None:
    shard = new_shard()
    e1, e2, e3, e4, e5 = (new_eid() for _ in range(5))
    now = datetime.now(UTC)
    s1 = ExecState(e1, shard, catalog_id, ctx={"a": 1}, steps={"start": StepRun(visits=1, command_id="c")},
                   pending={"c": Pending("start", 2, index=4)}, deadline_ms=5)
    states = [(s1, 5, now - timedelta(hours=2)), (ExecState(e2, shard, catalog_id), 6, now - timedelta(hours=1)),
              (ExecState(e3, shard, catalog_id), 7, None),
              (ExecState(e4, shard, catalog_id, status="completed"), 8, now - timedelta(hours=3)),
              (ExecState(e5, shard, catalog_id), 9, now - timedelta(hours=4))]
    await quarantine(db, shard, e5)
    async with autocommit(db) as conn:
        await engine_state.save_states(conn, shard, [])
        await engine_state.save_states(conn, shard, states)
        assert await engine_state.load_states(conn, []) == {}
        loaded = await engine_state.load_states(conn, [e1, e4, new_eid()])
        assert loaded == {e1: s1, e4: states[3][0]}
        assert await engine_state.overdue(conn, shard, 10) == [e1, e2], "e3: no deadline, e4: ended, e5: quarantined"
        assert await engine_state.overdue(conn, shard, 1) == [e1]
        s1.status = "completed"
        await engine_state.save_states(conn, shard, [(s1, 10, None)])
        assert await engine_state.overdue(conn, shard, 10) == [e2]
    row = await sql1(db, "SELECT status, last_shard_seq, deadline, state->>'status' AS s FROM noetl.engine_state"
                         " WHERE execution_id = %s", (e1,))
    assert row == {"status": "completed", "last_shard_seq": 10, "deadline": None, "s": "completed"}


@covers("engine_state.send_load_states", "engine_state.loaded_states", "requests.send_load_requests",
        "requests.loaded_requests")
async def test_the_engines_reads_travel_together_in_one_pipeline(db: Pool, catalog_id: int) -> None:
    """The engine sends its fence and its reads before reading any of them (one round
    trip): each cursor reads back what ``load_states`` / ``load_requests`` would."""
    shard = new_shard()
    e1, e2 = await submit(db, catalog_id, shard), await submit(db, catalog_id, shard)
    s1 = ExecState(e1, shard, catalog_id, ctx={"k": [1, 2]})
    async with autocommit(db) as conn:
        await engine_state.save_states(conn, shard, [(s1, 3, None)])
    async with pipelined_transaction(db) as conn:
        assert await engine_state.send_load_states(conn, []) is None
        assert await requests.send_load_requests(conn, []) is None
        first = await conn.execute("SELECT 41 + 1 AS n")
        states = await engine_state.send_load_states(conn, [e1, e2])
        reqs = await requests.send_load_requests(conn, [e2, new_eid()])
        assert (await first.fetchone() or {})["n"] == 42
        assert await engine_state.loaded_states(states) == {e1: s1}
        assert set(await requests.loaded_requests(reqs)) == {e2}
        assert await engine_state.loaded_states(None) == {} and await requests.loaded_requests(None) == {}


# ================================================================ requests

async def request_row(pool: Pool, eid: int) -> dict[str, Any] | None:
    return await sql1(pool, "SELECT * FROM noetl.execution_request WHERE execution_id = %s", (eid,))


@covers("requests.insert_submission", "requests.load_requests")
async def test_insert_submission_refuses_a_reused_idempotency_key(db: Pool, catalog_id: int) -> None:
    shard, key = new_shard(), unique("key")
    e1, e2, parent = new_eid(), new_eid(), new_eid()
    async with autocommit(db) as conn:
        assert await requests.insert_submission(
            conn, execution_id=e1, shard_id=shard, catalog_id=catalog_id, payload='{"n": 1}', idempotency_key=key,
            parent_execution_id=parent, parent_step="call", timeout_sec=12.5, traceparent="00-ab-cd-01", depth=2,
            workload_ref_id=77, payload_bytes=8, submitted_by=5, rerun_of=parent, rerun_from="step2",
            priority="high") is True
        assert await requests.insert_submission(
            conn, execution_id=e2, shard_id=shard, catalog_id=catalog_id, payload="{}", idempotency_key=key,
            parent_execution_id=None, parent_step=None, timeout_sec=1.0, traceparent=None, depth=0,
            workload_ref_id=None, payload_bytes=2, submitted_by=None, rerun_of=None, rerun_from=None,
            priority=None) is False
    row = await request_row(db, e1) or {}
    assert {k: row[k] for k in ("shard_id", "catalog_id", "payload", "idempotency_key", "parent_execution_id",
                                "parent_step", "timeout_sec", "traceparent", "depth", "workload_ref_id",
                                "payload_bytes", "submitted_by", "rerun_of", "rerun_from", "priority")} == {
        "shard_id": shard, "catalog_id": catalog_id, "payload": {"n": 1}, "idempotency_key": key,
        "parent_execution_id": parent, "parent_step": "call", "timeout_sec": 12.5, "traceparent": "00-ab-cd-01",
        "depth": 2, "workload_ref_id": 77, "payload_bytes": 8, "submitted_by": 5, "rerun_of": parent,
        "rerun_from": "step2", "priority": "high"}
    assert await request_row(db, e2) is None, "the retry's execution is the first one"
    e3, e4 = await submit(db, catalog_id, shard), await submit(db, catalog_id, shard)  # no key: never a conflict
    async with autocommit(db) as conn:
        assert await requests.load_requests(conn, []) == {}
        loaded = await requests.load_requests(conn, [e1, e3, e4, new_eid()])
    assert set(loaded) == {e1, e3, e4}
    assert (loaded[e1]["path"], loaded[e1]["version"], loaded[e1]["payload"]) == (f"{TAG}/playbook", 1, {"n": 1})


@covers("requests.insert_submission", "requests.insert_submission_row")
async def test_insert_submission_latest_of_pins_only_the_latest_version(db: Pool) -> None:
    """An api's remembered catalog entry is pinned only while it is its path's latest
    version: the check is in the insert's own statement (submissions.py)."""
    path = f"{TAG}/{unique('latest')}"
    async with transaction(db) as conn:
        v1 = await catalog.insert(conn, path=path, version=1, kind="Playbook", name="v1", content="a: 1",
                                  sha256="1" * 64, doc={})

    async def insert(catalog_id: int, key: str | None = None) -> tuple[bool, int]:
        eid = new_eid()
        async with autocommit(db) as conn:
            ok = await requests.insert_submission(
                conn, execution_id=eid, shard_id=1, catalog_id=catalog_id, payload='{"n": 2}', idempotency_key=key,
                parent_execution_id=None, parent_step=None, timeout_sec=9.5, traceparent="00-x", depth=0,
                workload_ref_id=None, payload_bytes=8, submitted_by=3, rerun_of=None, rerun_from=None,
                priority="low", latest_of=path)
        return ok, eid

    ok, e1 = await insert(v1["catalog_id"], key := unique("key"))
    assert ok
    row = await request_row(db, e1) or {}
    assert (row["catalog_id"], row["payload"], row["timeout_sec"], row["traceparent"], row["submitted_by"],
            row["priority"], row["idempotency_key"]) == (v1["catalog_id"], {"n": 2}, 9.5, "00-x", 3, "low", key)
    assert (await insert(v1["catalog_id"], key))[0] is False, "the idempotency key still decides"
    async with transaction(db) as conn:
        v2 = await catalog.insert(conn, path=path, version=2, kind="Playbook", name="v2", content="a: 2",
                                  sha256="2" * 64, doc={})
    ok, stale = await insert(v1["catalog_id"])
    assert not ok and await request_row(db, stale) is None, "v1 is no longer the latest: nothing committed"
    ok, e2 = await insert(v2["catalog_id"])
    assert ok and (await request_row(db, e2) or {}).get("catalog_id") == v2["catalog_id"]
    # the row as committed comes back (what the engine reads of it, but the catalog's part)
    async with autocommit(db) as conn:
        e3 = new_eid()
        row = await requests.insert_submission_row(
            conn, execution_id=e3, shard_id=1, catalog_id=v2["catalog_id"], payload='{"n": 3}', idempotency_key=None,
            parent_execution_id=None, parent_step=None, timeout_sec=9.5, traceparent=None, depth=0,
            workload_ref_id=None, payload_bytes=8, submitted_by=None, rerun_of=None, rerun_from=None,
            priority=None, latest_of=path)
        loaded = (await requests.load_requests(conn, [e3]))[e3]
        assert row == {k: v for k, v in loaded.items() if k not in ("path", "version")}
        thin = await requests.insert_submission_row(
            conn, execution_id=new_eid(), shard_id=1, catalog_id=v2["catalog_id"], payload="{}",
            idempotency_key=None, parent_execution_id=None, parent_step=None, timeout_sec=1, traceparent=None,
            depth=0, workload_ref_id=None, payload_bytes=2, submitted_by=None, rerun_of=None, rerun_from=None,
            priority=None, whole=False)
        assert thin is not None and set(thin) == {"execution_id"}
        assert await requests.insert_submission_row(
            conn, execution_id=new_eid(), shard_id=1, catalog_id=v1["catalog_id"], payload="{}",
            idempotency_key=None, parent_execution_id=None, parent_step=None, timeout_sec=1, traceparent=None,
            depth=0, workload_ref_id=None, payload_bytes=2, submitted_by=None, rerun_of=None, rerun_from=None,
            priority=None, latest_of=path) is None


@covers("requests.unstarted", "events.NOT_QUARANTINED")
async def test_unstarted_sweeps_submissions_not_started_queued_or_quarantined(db: Pool, catalog_id: int) -> None:
    shard = new_shard()
    e = [await submit(db, catalog_id, shard) for _ in range(6)]
    await submit(db, catalog_id, new_shard())  # another shard's
    async with autocommit(db) as conn:
        await engine_state.save_states(conn, shard, [(ExecState(e[1], shard, catalog_id), 1, None)])
        await limits.enqueue(conn, 1, "k", e[2], shard)
    await quarantine(db, shard, e[3])
    async with autocommit(db) as conn:
        assert await requests.unstarted(conn, shard, 0, 10) == [e[0], e[4], e[5]]
        assert await requests.unstarted(conn, shard, e[0], 10) == [e[4], e[5]]
        assert await requests.unstarted(conn, shard, 0, 2) == [e[0], e[4]]
        await limits.dequeue(conn, e[2])


@covers("requests.sweep_candidates")
async def test_sweep_candidates_are_the_shards_a_sweep_may_find_something_on(db: Pool, catalog_id: int) -> None:
    role = unique("engine")
    idle, unstarted, started, queued, late, cancelled, redriven = (new_shard() for _ in range(7))
    shards = [idle, unstarted, started, queued, late, cancelled, redriven]
    owner = new_owner()
    for shard in shards:
        await put_lease(db, role, shard, owner, 1)
    async with autocommit(db) as conn:
        assert await requests.sweep_candidates(conn, role, shards) == set()
        assert await requests.sweep_candidates(conn, role, []) == set()
    e_unstarted = await submit(db, catalog_id, unstarted)
    e_started = await submit(db, catalog_id, started)
    e_queued, e_late, e_cancelled, e_dead = new_eid(), new_eid(), new_eid(), new_eid()
    dead = await add_dead_letter(db, redriven, e_dead)
    async with autocommit(db) as conn:
        now = datetime.now(UTC)
        await engine_state.save_states(conn, started, [(ExecState(e_started, started, catalog_id), 1, None)])
        await engine_state.save_states(conn, late, [(ExecState(e_late, late, catalog_id), 1, now - timedelta(hours=1))])
        await limits.enqueue(conn, 1, "k", e_queued, queued)
        await requests.request_cancel(conn, e_cancelled, cancelled, "asked")
        await requests.request_redrive(conn, dead, e_dead, redriven, "alice")
        assert await requests.sweep_candidates(conn, role, shards) == {unstarted, queued, late, cancelled, redriven}
        # a submission at or below the shard's sweep_from is not looked for
        await conn.execute("UPDATE noetl.shard_lease SET sweep_from = %s WHERE role = %s AND shard_id = %s",
                           (e_unstarted, role, unstarted))
        assert unstarted not in await requests.sweep_candidates(conn, role, [unstarted])
        await limits.dequeue(conn, e_queued)


@covers("requests.request_cancel", "requests.pending_cancels", "requests.applied_cancels", "requests.cascade_cancels",
        "requests.children", "events.NOT_QUARANTINED")
async def test_cancel_requests_are_committed_once_cascade_to_children_and_go_when_applied(db: Pool,
                                                                                        catalog_id: int) -> None:
    shard, child_shard = new_shard(), new_shard()
    parent, other, stuck = [await submit(db, catalog_id, shard) for _ in range(3)]
    c1 = await submit(db, catalog_id, child_shard, parent=parent)
    c2 = await submit(db, catalog_id, child_shard, parent=parent)
    await quarantine(db, shard, stuck)
    async with autocommit(db) as conn:
        await requests.request_cancel(conn, parent, shard, "user asked")
        await requests.request_cancel(conn, parent, shard, "asked again")
        await requests.request_cancel(conn, other, shard, "timeout")
        await requests.request_cancel(conn, stuck, shard, "stuck")
        assert await requests.pending_cancels(conn, shard, 10) == [
            {"execution_id": parent, "reason": "user asked"}, {"execution_id": other, "reason": "timeout"}]
        assert await requests.pending_cancels(conn, shard, 1) == [{"execution_id": parent, "reason": "user asked"}]
        assert sorted((r["execution_id"], r["shard_id"]) for r in await requests.children(conn, [parent])) == \
            sorted([(c1, child_shard), (c2, child_shard)])
        assert await requests.children(conn, [other]) == []
        await requests.request_cancel(conn, c2, child_shard, "its own")
        await requests.cascade_cancels(conn, [])
        await requests.cascade_cancels(conn, [parent])
        assert [(r["execution_id"], r["reason"]) for r in await requests.pending_cancels(conn, child_shard, 10)] == \
            [(c2, "its own"), (c1, "parent execution cancelled")]
        await requests.applied_cancels(conn, [])
        await requests.applied_cancels(conn, [parent, c1])
        assert await requests.pending_cancels(conn, shard, 10) == [{"execution_id": other, "reason": "timeout"}]
        assert [r["execution_id"] for r in await requests.pending_cancels(conn, child_shard, 10)] == [c2]


@covers("requests.request_redrive", "requests.pending_redrive_executions", "requests.redrive_requests",
        "requests.applied_redrives", "events.NOT_QUARANTINED")
async def test_redrive_requests_are_committed_once_swept_oldest_first_and_go_when_applied(db: Pool) -> None:
    shard = new_shard()
    e1, e2, stuck = new_eid(), new_eid(), new_eid()
    d1, d2, d3, d4 = [await add_dead_letter(db, shard, e) for e in (e1, e1, e2, stuck)]
    await quarantine(db, shard, stuck)
    async with autocommit(db) as conn:
        await requests.request_redrive(conn, d2, e1, shard, "alice")
        await requests.request_redrive(conn, d3, e2, shard, "carol")
        await requests.request_redrive(conn, d1, e1, shard, "bob")
        await requests.request_redrive(conn, d2, e1, shard, "mallory")  # committed already: nothing changes
        await requests.request_redrive(conn, d4, stuck, shard, "dave")
        assert await requests.pending_redrive_executions(conn, shard, 10) == [e1, e2]
        assert await requests.pending_redrive_executions(conn, shard, 1) == [e1]
        got = await requests.redrive_requests(conn, e1)
        assert [(r["dead_letter_id"], r["requested_by"]) for r in got] == [(d2, "alice"), (d1, "bob")]
        assert {k: got[0][k] for k in ("step", "reason", "status", "loop_instance", "loop_index",
                                       "redrive_command_id")} == {
            "step": "s", "reason": "failed", "status": "dead", "loop_instance": None, "loop_index": None,
            "redrive_command_id": None}
        await requests.applied_redrives(conn, [])
        await requests.applied_redrives(conn, [d2, d3])
        assert [r["dead_letter_id"] for r in await requests.redrive_requests(conn, e1)] == [d1]
        assert await requests.pending_redrive_executions(conn, shard, 10) == [e1]


@covers("requests.lock_for_redrive")
async def test_lock_for_redrive_holds_the_execution_s_lock_and_tells_a_compacted_one(db: Pool, pg_dsn: str) -> None:
    shard, eid = new_shard(), new_eid()
    try_lock = "SELECT pg_try_advisory_xact_lock(%s, (%s %% 2147483647)::int) AS ok"
    async with transaction(db) as conn, connect(pg_dsn) as other:
        assert await requests.lock_for_redrive(conn, eid) is False
        assert (await (await other.execute(try_lock, (REDRIVE_LOCK_CLASS, eid))).fetchone() or {})["ok"] is False
    async with connect(pg_dsn) as other:
        assert (await (await other.execute(try_lock, (REDRIVE_LOCK_CLASS, eid))).fetchone() or {})["ok"] is True
    await sql(db, "INSERT INTO noetl.manifest (execution_id, shard_id, status, step_count, ref_count, event_count,"
                  " compactor_epoch) VALUES (%s, %s, 'completed', 0, 0, 0, 1)", (eid, shard))
    async with transaction(db) as conn:
        assert await requests.lock_for_redrive(conn, eid) is True


# ================================================================ loops

@covers("loops.store_loop_items")
async def test_store_loop_items_writes_one_row_per_item_across_chunks(db: Pool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    eid = new_eid()
    monkeypatch.setattr(loops, "LOOP_ITEMS_CHUNK", 2)
    at = datetime(2026, 1, 2, tzinfo=UTC)
    items = [{"a": 1}, "b", 3, None, [1, 2], at]
    async with autocommit(db) as conn:
        await loops.store_loop_items(conn, eid, "i1", items)
        await loops.store_loop_items(conn, eid, "i2", [])
    found = await sql(db, "SELECT loop_instance, idx, item FROM noetl.loop_item WHERE execution_id = %s"
                          " ORDER BY loop_instance, idx", (eid,))
    assert [(r["loop_instance"], r["idx"], r["item"]) for r in found] == [
        ("i1", n, item) for n, item in enumerate([*items[:-1], str(at)])]


@covers("loops.store_loop_results", "loops.loop_results", "loops.ok_ranges", "loops.clear_loop_results",
        "loops.copy_loop")
async def test_loop_results_are_accepted_once_read_as_ranges_cleared_and_copied(db: Pool) -> None:
    eid, rerun = new_eid(), new_eid()
    results = [(eid, "i1", n, "error" if n == 2 else "ok", None if n == 2 else 10 + n) for n in (0, 1, 2, 3, 4, 6)]
    async with autocommit(db) as conn:
        await loops.store_loop_items(conn, eid, "i1", list(range(7)))
        await loops.store_loop_results(conn, [])
        await loops.store_loop_results(conn, results)
        await loops.store_loop_results(conn, [(eid, "i1", 0, "error", None)])  # a duplicate result: the first stays
        assert await loops.loop_results(conn, eid, "i1") == {0: 10, 1: 11, 2: None, 3: 13, 4: 14, 6: 16}
        assert await loops.loop_results(conn, eid, "other") == {}
        assert await loops.ok_ranges(conn, eid, "i1") == [(0, 2), (3, 5), (6, 7)]
        await loops.clear_loop_results(conn, [])
        await loops.clear_loop_results(conn, [(eid, "i1", 2), (eid, "i1", 0)])  # 0 succeeded: it stays
        assert await loops.loop_results(conn, eid, "i1") == {0: 10, 1: 11, 3: 13, 4: 14, 6: 16}
        await loops.store_loop_results(conn, [(eid, "i1", 5, "error", None)])
        for _ in range(2):
            await loops.copy_loop(conn, eid, "i1", rerun, "i9")
        assert await loops.loop_results(conn, rerun, "i9") == {0: 10, 1: 11, 3: 13, 4: 14, 6: 16}
    copied = await sql(db, "SELECT idx, item FROM noetl.loop_item WHERE execution_id = %s AND loop_instance = 'i9'"
                           " ORDER BY idx", (rerun,))
    assert [(r["idx"], r["item"]) for r in copied] == [(n, n) for n in range(7)]


# ================================================================ dead_letters

@covers("dead_letters.insert_dead_letters")
async def test_insert_dead_letters_records_each_command_once_with_its_worker(db: Pool, catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    c1 = await add_command(db, catalog_id, shard, eid)
    await sql(db, "UPDATE noetl.command SET worker_id = 'w-row' WHERE command_id = %s", (c1,))
    c2 = f"{eid}:nocommand:1"
    async with autocommit(db) as conn:
        await dead_letters.insert_dead_letters(conn, shard, [])
        await dead_letters.insert_dead_letters(conn, shard, [
            (eid, DeadLetter(c1, "s", 3, "failed", {"kind": "error", "at": datetime(2026, 1, 1, tzinfo=UTC)})),
            (eid, DeadLetter(c2, "loop", 1, "expired", {}, worker_id="w-result", loop_instance="i", loop_index=4))])
        await dead_letters.insert_dead_letters(conn, shard, [(eid, DeadLetter(c1, "x", 9, "expired", {}))])
    found = await sql(db, "SELECT * FROM noetl.dead_letter WHERE execution_id = %s ORDER BY command_id", (eid,))
    assert [{k: r[k] for k in ("shard_id", "command_id", "step", "loop_instance", "loop_index", "attempts", "reason",
                               "error", "worker_id", "status")} for r in found] == [
        {"shard_id": shard, "command_id": c2, "step": "loop", "loop_instance": "i", "loop_index": 4, "attempts": 1,
         "reason": "expired", "error": {}, "worker_id": "w-result", "status": "dead"},
        {"shard_id": shard, "command_id": c1, "step": "s", "loop_instance": None, "loop_index": None, "attempts": 3,
         "reason": "failed", "error": {"kind": "error", "at": "2026-01-01 00:00:00+00:00"}, "worker_id": "w-row",
         "status": "dead"}]


@covers("dead_letters.record_redrives")
async def test_record_redrives_marks_the_redriven_and_records_a_refusal(db: Pool) -> None:
    shard, eid = new_shard(), new_eid()
    d1, d2 = await add_dead_letter(db, shard, eid), await add_dead_letter(db, shard, eid)
    cols = "dead_letter_id, status, redrive_command_id, redriven_by, refusal, redriven_at IS NOT NULL AS at"

    async def state() -> list[tuple[Any, ...]]:
        found = await sql(db, f"SELECT {cols} FROM noetl.dead_letter WHERE dead_letter_id = ANY(%s)"
                              " ORDER BY dead_letter_id", ([d1, d2],))
        return [tuple(r.values())[1:] for r in found]

    async with autocommit(db) as conn:
        await dead_letters.record_redrives(conn, [])
        await dead_letters.record_redrives(conn, [(d1, "new-command", None, "alice"), (d2, None, "running", "bob")])
    assert await state() == [("redriven", "new-command", "alice", None, True), ("dead", None, None, "running", False)]
    async with autocommit(db) as conn:
        await dead_letters.record_redrives(conn, [(d1, None, "redriven already", "carol")])
    assert (await state())[0] == ("redriven", "new-command", "alice", "redriven already", True)


# ================================================================ read_models

@covers("read_models.fence_and_read", "read_models.advance", "read_models.shards_behind")
async def test_the_projector_reads_past_its_watermark_only_under_its_fence(db: Pool) -> None:
    shard, owner, eid, idle = new_shard(), new_owner(), new_eid(), new_shard()
    await put_lease(db, read_models.ROLE, shard, owner, 2)
    async with autocommit(db) as conn:
        assert await read_models.shards_behind(conn, [shard, idle]) == set()
        await events.append_events(conn, [(eid, shard, n, "step.started", f"s{n}", None, None, "{}")
                                          for n in range(1, 6)])
        # never projected (no checkpoint row): behind from 0; a shard without events is not
        assert await read_models.shards_behind(conn, [shard, idle]) == {shard}
        assert await read_models.shards_behind(conn, []) == set()
    async with pipelined_transaction(db) as conn:
        got = await read_models.fence_and_read(conn, shard, owner, 2, 3)
    assert [(r["execution_id"], r["shard_seq"], r["event_type"], r["step"]) for r in got] == [
        (eid, n, "step.started", f"s{n}") for n in (1, 2, 3)]
    assert {"command_id", "result", "meta", "created_at"} <= set(got[0])
    checkpoint = "SELECT last_shard_seq, lag_ms, last_projected_at IS NOT NULL AS at FROM noetl.projection_checkpoint" \
                 " WHERE shard_id = %s"
    assert await sql1(db, checkpoint, (shard,)) == {"last_shard_seq": 0, "lag_ms": None, "at": False}
    async with pipelined_transaction(db) as conn:
        await read_models.advance(conn, shard, 3, 42)
    assert await sql1(db, checkpoint, (shard,)) == {"last_shard_seq": 3, "lag_ms": 42, "at": True}
    async with pipelined_transaction(db) as conn:
        assert [r["shard_seq"] for r in await read_models.fence_and_read(conn, shard, owner, 2, 10)] == [4, 5]
    async with pipelined_transaction(db) as conn:
        await read_models.advance(conn, shard, 5, 1)
    async with autocommit(db) as conn:
        assert await read_models.shards_behind(conn, [shard]) == set(), "projected up to its last event"
    async with pipelined_transaction(db) as conn:
        await read_models.advance(conn, shard, 3, 42)  # back where the rest of the test expects it
    for epoch in (1, 3):
        with pytest.raises(LeaseLost):
            async with pipelined_transaction(db) as conn:
                await read_models.fence_and_read(conn, shard, owner, epoch, 10)
    # the check probes an index entry per shard, whatever the log holds: 20,000 more events
    big, big_eid = new_shard(), new_eid()
    async with autocommit(db) as conn:
        await conn.execute("INSERT INTO noetl.event (execution_id, shard_id, shard_seq, event_type, meta)"
                           " SELECT %s, %s, n, 'step.started', '{}' FROM generate_series(1, 20000) n", (big_eid, big))
        await conn.execute("ANALYZE noetl.event")
        held = [big, shard, idle, *range(100_000, 100_061)]  # a projector holding 64 shards (61 never written)
        assert await read_models.shards_behind(conn, held) == {big, shard}
        cur = await conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {read_models._SHARDS_BEHIND}", (held,))
        plan = (await cur.fetchone())["QUERY PLAN"][0]["Plan"]

    def scans(node: dict[str, Any]) -> list[dict[str, Any]]:
        own = str(node.get("Relation Name") or node.get("Index Name") or "").startswith("event")
        return [*([node] if own else []),
                *(s for child in node.get("Plans", ()) for s in scans(child))]
    # a scan per shard and partition, none reading more than the one entry it looks for
    assert scans(plan) and all(s["Actual Rows"] <= 1 for s in scans(plan)), json.dumps(plan, indent=1)
    with pytest.raises(LeaseLost):
        async with transaction(db) as conn:
            await read_models.fence_and_read(conn, shard, new_owner(), 2, 10)


@covers("read_models.read_past", "read_models.advance_write", "read_models.save_views_writes", "leases.fence_write")
async def test_a_projection_batch_as_one_statement_gated_by_fence_and_watermark(db: Pool, catalog_id: int) -> None:
    """The projector's one-statement batch: the events past the watermark read without a
    fence (with the watermark they were read past), then the read models' upserts gated by
    the fence and by the watermark still being that one."""
    shard, owner, eid = new_shard(), new_owner(), new_eid()
    await put_lease(db, read_models.ROLE, shard, owner, 2)
    async with autocommit(db) as conn:
        assert await read_models.read_past(conn, shard, 10) == (-1, []), "no checkpoint row, no events"
        await events.append_events(conn, [(eid, shard, n, "step.started", f"s{n}", None, None, "{}")
                                          for n in range(1, 6)])
        watermark, got = await read_models.read_past(conn, shard, 3)
        assert watermark == -1 and [r["shard_seq"] for r in got] == [], "no checkpoint row: none read past it"
    async with pipelined_transaction(db) as conn:
        await read_models.fence_and_read(conn, shard, owner, 2, 1)  # makes the checkpoint row
        await read_models.advance(conn, shard, 1, 0)
    async with autocommit(db) as conn:
        watermark, got = await read_models.read_past(conn, shard, 3)
    assert watermark == 1 and [(r["execution_id"], r["shard_seq"], r["step"]) for r in got] == [
        (eid, n, f"s{n}") for n in (2, 3, 4)]
    assert {"event_type", "command_id", "result", "meta", "created_at"} <= set(got[0])
    view = ExecutionView(eid, shard, status="running", catalog_id=catalog_id, playbook_path="p/one",
                         playbook_version=1, last_shard_seq=4)
    view.step("s2").status = "running"
    writes = read_models.save_views_writes([view])
    assert len(writes) == 2 and read_models.save_views_writes([]) == []

    async def batch(*, epoch: int = 2, from_seq: int = 1) -> bool:
        async with autocommit(db) as conn:
            return await gated(conn, [leases.fence_write(read_models.ROLE, shard, owner, epoch),
                                      read_models.advance_write(shard, from_seq, 4, 7)], writes)

    checkpoint = "SELECT last_shard_seq, lag_ms FROM noetl.projection_checkpoint WHERE shard_id = %s"
    assert await batch(epoch=3) is False, "not our lease"
    assert await batch(from_seq=0) is False, "the watermark moved since it was read"
    assert await sql1(db, checkpoint, (shard,)) == {"last_shard_seq": 1, "lag_ms": 0}
    assert await sql(db, "SELECT 1 FROM noetl.execution WHERE execution_id = %s", (eid,)) == []
    assert await batch() is True
    assert await sql1(db, checkpoint, (shard,)) == {"last_shard_seq": 4, "lag_ms": 7}
    async with autocommit(db) as conn:
        loaded = (await read_models.load_views(conn, shard, [eid]))[eid]
    assert (loaded.status, loaded.playbook_path, loaded.last_shard_seq, loaded.steps["s2"].status) == (
        "running", "p/one", 4, "running")
    assert await batch() is False, "the same batch again: its watermark is gone"


@covers("read_models.save_views", "read_models.load_views")
async def test_views_round_trip_and_only_changed_steps_are_written(db: Pool, catalog_id: int) -> None:
    shard, e1, e2, e0 = new_shard(), new_eid(), new_eid(), new_eid()
    t = datetime(2026, 1, 1, 12, tzinfo=UTC)
    async with autocommit(db) as conn:
        await read_models.save_views(conn, [])
        fresh = await read_models.load_views(conn, shard, [e1])
        assert fresh == {e1: ExecutionView(e1, shard)}, "an execution not projected yet: an empty view"
        view = ExecutionView(e1, shard, status="running", catalog_id=catalog_id, playbook_path="p/x",
                             playbook_version=2, parent_execution_id=e0, rerun_of=e0, created_at=t, started_at=t,
                             last_shard_seq=5)
        a = view.step("a")
        a.status, a.visits, a.attempts, a.result_ref_id, a.started_at = "done", 1, 2, 99, t
        a.loop_total, a.loop_done, a.loop_failed = 10, 7, 1
        view.steps["b"] = StepView("b", status="running")  # not dirty: not written
        await read_models.save_views(conn, [view])
    assert await sql(db, "SELECT step FROM noetl.execution_step WHERE execution_id = %s", (e1,)) == [{"step": "a"}]
    async with autocommit(db) as conn:
        loaded = await read_models.load_views(conn, shard, [e1, e2])
    got = loaded[e1]
    assert (got.status, got.catalog_id, got.playbook_path, got.playbook_version, got.parent_execution_id,
            got.rerun_of, got.created_at, got.started_at, got.ended_at, got.last_shard_seq, got.error) == (
        "running", catalog_id, "p/x", 2, e0, e0, t, t, None, 5, None)
    assert list(got.steps) == ["a"]
    assert got.steps["a"] == StepView("a", "done", 1, 2, 99, None, t, None, 10, 7, 1)
    assert loaded[e2] == ExecutionView(e2, shard)
    view.status, view.ended_at, view.error, view.last_shard_seq = "failed", t, "boom", 9
    b = view.step("b")
    b.status = "failed"
    async with autocommit(db) as conn:
        await read_models.save_views(conn, [view])
        got = (await read_models.load_views(conn, shard, [e1]))[e1]
    assert (got.status, got.ended_at, got.error, got.last_shard_seq) == ("failed", t, "boom", 9)
    assert (sorted(got.steps), got.steps["b"].status) == (["a", "b"], "failed")


# ================================================================ checkpoints

@covers("checkpoints.seal_states")
async def test_seal_state_puts_the_engine_positions_beside_the_projection_and_the_latest_seal(db: Pool) -> None:
    role, shard = unique("engine"), new_shard()
    async with autocommit(db) as conn:
        assert (await checkpoints.seal_states(conn, role, [shard])).get(shard) is None
    await put_lease(db, role, shard, new_owner(), 1, event_seq=50, barrier_epoch=3, barrier_seq=40)
    async with autocommit(db) as conn:
        got = (await checkpoints.seal_states(conn, role, [shard])).get(shard) or {}
    assert {k: v for k, v in got.items() if k != "now"} == {
        "event_seq": 50, "barrier_epoch": 3, "barrier_seq": 40, "projected_seq": 0, "sealed_epoch": 0,
        "sealed_seq": 0, "sealed_at": None}
    assert isinstance(got["now"], datetime)
    await sql(db, "INSERT INTO noetl.projection_checkpoint (shard_id, last_shard_seq) VALUES (%s, 45)", (shard,))
    await sql(db, "INSERT INTO noetl.checkpoint (shard_id, epoch, last_shard_seq) VALUES (%s, 2, 30), (%s, 3, 40)",
              (shard, shard))  # the latest seal is the highest epoch's
    async with autocommit(db) as conn:
        got = (await checkpoints.seal_states(conn, role, [shard])).get(shard) or {}
    assert (got["projected_seq"], got["sealed_epoch"], got["sealed_seq"]) == (45, 3, 40)
    assert isinstance(got["sealed_at"], datetime)
    # the same rows for a set of shards at once; shards without an engine lease left out
    other = new_shard()
    async with autocommit(db) as conn:
        many = await checkpoints.seal_states(conn, role, [other, shard])
        assert await checkpoints.seal_states(conn, role, []) == {}
    assert list(many) == [shard]
    assert {k: v for k, v in many[shard].items() if k != "now"} == {k: v for k, v in got.items() if k != "now"}


@covers("checkpoints.seal_round", "leases.fence_when")
async def test_a_seal_round_seals_fenced_only_what_the_projection_passed(db: Pool) -> None:
    engine, role, shard, owner, e1 = unique("engine"), unique("ckpt"), new_shard(), new_owner(), new_eid()

    async def round_(who: int = owner, epoch: int = 1) -> dict[str, Any]:
        async with autocommit(db) as conn:
            return await checkpoints.seal_round(conn, engine, role, shard, who, epoch)

    async def touched() -> Any:
        return (await sql1(db, "SELECT updated_at FROM noetl.shard_lease WHERE role = %s AND shard_id = %s",
                           (role, shard)) or {})["updated_at"]

    await put_lease(db, role, shard, owner, 1)
    got = await round_()  # no engine lease row yet: the state is all NULL, nothing to seal
    assert (got["ours"], got["sealable"], got["sealed_now"], got["event_seq"]) == (True, False, False, None)
    await put_lease(db, engine, shard, new_owner(), 1, event_seq=50, barrier_epoch=3, barrier_seq=40)
    async with autocommit(db) as conn:
        await events.append_events(conn, [(e1, shard, 41, "step.enter", "a", None, None, "{}"),
                                          (e1, shard, 42, "step.enter", "b", None, None, "{}")])
    at = {r["shard_seq"]: r["created_at"] for r in await sql(
        db, "SELECT shard_seq, created_at FROM noetl.event WHERE shard_id = %s", (shard,))}
    await sql(db, "INSERT INTO noetl.projection_checkpoint (shard_id, last_shard_seq) VALUES (%s, 30)", (shard,))
    before = await touched()
    got = await round_()  # the projection has not passed the barrier: read, nothing written
    assert (got["ours"], got["sealable"], got["sealed_now"]) == (True, False, False)
    assert (got["event_seq"], got["barrier_epoch"], got["projected_seq"], got["sealed_epoch"]) == (50, 3, 30, 0)
    assert got["oldest_at"] == at[41] and await touched() == before
    # another member's round (or ours at an old epoch) never seals, however sealable
    await sql(db, "UPDATE noetl.projection_checkpoint SET last_shard_seq = 45 WHERE shard_id = %s", (shard,))
    for who, epoch in ((new_owner(), 1), (owner, 2)):
        got = await round_(who, epoch)
        assert (got["ours"], got["sealable"], got["sealed_now"]) == (False, True, False)
    assert await sql(db, "SELECT * FROM noetl.checkpoint WHERE shard_id = %s", (shard,)) == []
    got = await round_()  # passed: fenced (the lease row touched) and sealed in the one statement
    assert (got["ours"], got["sealable"], got["sealed_now"]) == (True, True, True)
    assert got["sealed_epoch"] == 0  # the state as read before the seal
    assert got["oldest_at"] == at[41]  # past seq 40, the new seal
    assert [(r["epoch"], r["last_shard_seq"]) for r in await sql(
        db, "SELECT epoch, last_shard_seq FROM noetl.checkpoint WHERE shard_id = %s", (shard,))] == [(3, 40)]
    assert await touched() > before
    got = await round_()  # sealed: nothing more to do
    assert (got["sealable"], got["sealed_now"], got["sealed_epoch"], got["sealed_seq"]) == (False, False, 3, 40)
    # a lease run out is not ours, and never seals the next barrier however passed
    await sql(db, "UPDATE noetl.shard_lease SET leased_until = now() - interval '1 second'"
                  " WHERE role = %s AND shard_id = %s", (role, shard))
    assert (await round_())["ours"] is False
    await sql(db, "UPDATE noetl.shard_lease SET barrier_epoch = 4, barrier_seq = 44 WHERE role = %s AND shard_id = %s",
              (engine, shard))
    got = await round_()
    assert (got["ours"], got["sealable"], got["sealed_now"]) == (False, True, False)
    assert [r["epoch"] for r in await sql(db, "SELECT epoch FROM noetl.checkpoint WHERE shard_id = %s", (shard,))] == [3]


@covers("checkpoints.MANIFEST", "checkpoints.PARTS", "checkpoints.TERMINAL_REF")
async def test_the_compactor_s_statements_summarise_an_execution(db: Pool, catalog_id: int) -> None:
    shard, eid = new_shard(), new_eid()
    t = datetime(2026, 1, 1, tzinfo=UTC)
    store = PostgresResultStore(db)
    r1 = await store.put({"n": 1}, execution_id=eid, step="a", command_id="c1", task="t", parent_ref_id=None)
    r2 = await store.put({"n": 2}, execution_id=eid, step="a", command_id="c2", task="t", parent_ref_id=r1.ref_id)
    view = ExecutionView(eid, shard, status="completed", catalog_id=catalog_id, playbook_path="p/m",
                         playbook_version=3, started_at=t, ended_at=t)
    a = view.step("a")
    a.status, a.visits, a.result_ref_id = "done", 2, r2.ref_id
    view.step("b").status = "skipped"
    final = {"status": "ok", "reference": r2.to_json()}
    async with autocommit(db) as conn:
        await read_models.save_views(conn, [view])
        await events.append_events(conn, [
            (eid, shard, 1, "step.started", "a", None, None, "{}"),
            (eid, shard, 2, "call.done", "a", "c1", json.dumps({"status": "ok"}), "{}"),
            (eid, shard, 3, "call.done", "a", "c2", json.dumps(final), "{}"),
            (eid, shard, 4, "call.done", "a", "c3", json.dumps({"status": "ok"}), json.dumps({"index": 0}))])
        ev = await sql(db, "SELECT min(event_id) AS lo, max(event_id) AS hi FROM noetl.event WHERE execution_id = %s",
                       (eid,))
        stats = [{"execution_id": eid, "event_count": 4, "event_types": {"step.started": 1, "call.done": 3},
                  "first_event_id": ev[0]["lo"], "last_event_id": ev[0]["hi"], "last_shard_seq": 4}]
        cur = await conn.execute(checkpoints.MANIFEST, {"stats": json.dumps(stats), "epoch": 7})
        assert await cur.fetchall() == [{"execution_id": eid, "created": True}]
        again = [{**stats[0], "event_count": 1, "event_types": {"call.done": 1}, "last_event_id": ev[0]["hi"] + 5,
                  "last_shard_seq": 9}]
        cur = await conn.execute(checkpoints.MANIFEST, {"stats": json.dumps(again), "epoch": 8})
        assert await cur.fetchall() == [{"execution_id": eid, "created": False}], "a revisit adds to it"
        cur = await conn.execute(checkpoints.PARTS, {"ids": [eid], "result_events": ["call.done", "call.error"]})
        parts = sorted(await cur.fetchall(), key=lambda r: r["chain_depth"])
        assert parts == [{"execution_id": eid, "terminal_ref_id": None, "chain_depth": 0},
                         {"execution_id": eid, "terminal_ref_id": r2.ref_id, "chain_depth": 2}]
        await conn.execute(checkpoints.TERMINAL_REF, {"ids": [eid], "refs": [r2.ref_id], "depths": [2]})
    m = await sql1(db, "SELECT * FROM noetl.manifest WHERE execution_id = %s", (eid,)) or {}
    assert {k: m[k] for k in ("shard_id", "status", "playbook_path", "playbook_version", "step_count", "ref_count",
                              "event_count", "event_types", "first_event_id", "last_event_id", "last_shard_seq",
                              "started_at", "ended_at", "compactor_epoch", "terminal_ref_id", "chain_depth")} == {
        "shard_id": shard, "status": "completed", "playbook_path": "p/m", "playbook_version": 3, "step_count": 2,
        "ref_count": 2, "event_count": 5, "event_types": {"step.started": 1, "call.done": 4},
        "first_event_id": ev[0]["lo"], "last_event_id": ev[0]["hi"] + 5, "last_shard_seq": 9, "started_at": t,
        "ended_at": t, "compactor_epoch": 7, "terminal_ref_id": r2.ref_id, "chain_depth": 2}
    found = await sql(db, "SELECT * FROM noetl.manifest_part WHERE execution_id = %s ORDER BY step", (eid,))
    assert [(p["step"], p["status"], p["visits"], p["event_type"], p["envelope"], p["terminal_ref_id"],
             p["chain_depth"], [c["ref_id"] for c in p["chain"]], p["event_count"]) for p in found] == [
        ("a", "done", 2, "call.done", final, r2.ref_id, 2, [r2.ref_id, r1.ref_id], 4),
        ("b", "skipped", 0, None, None, None, 0, [], 0)]


# ================================================================ limits

@covers("limits.set_limit", "limits.all_limits", "limits.limits_of", "limits.keys_of", "limits.delete_limit")
async def test_limits_are_set_listed_counted_and_deleted_with_their_slots(db: Pool) -> None:
    path, shard = f"{TAG}/limited", new_shard()
    e1, e2, e3 = new_eid(), new_eid(), new_eid()
    async with autocommit(db) as conn:
        first = await limits.set_limit(conn, path, "", 2)
        again = await limits.set_limit(conn, path, "", 5)
        keyed = await limits.set_limit(conn, path, "{{ workload.region }}", 1)
        assert (again["limit_id"], again["max_running"]) == (first["limit_id"], 5), "set again: the same limit"
        lid = first["limit_id"]
        assert [(r["limit_id"], r["key_template"], r["max_running"]) for r in await limits.limits_of(conn, path)] == [
            (lid, "", 5), (keyed["limit_id"], "{{ workload.region }}", 1)]
        assert {lid, keyed["limit_id"]} <= {r["limit_id"] for r in await limits.limits_of(conn, "")}
        assert await limits.limits_of(conn, f"{path}/none") == []
        every = {r["limit_id"]: r for r in await limits.all_limits(conn)}
        assert every[lid] == {"limit_id": lid, "path": path, "key_template": "", "max_running": 5}
        assert await limits.take_slot(conn, lid, "k", 5, e1, shard)
        assert await limits.take_slot(conn, lid, "k", 5, e2, shard)
        await limits.enqueue(conn, lid, "k2", e3, shard)
        assert await limits.keys_of(conn, [lid, keyed["limit_id"]]) == [
            {"limit_id": lid, "key": "k", "running": 2, "waiting": 0},
            {"limit_id": lid, "key": "k2", "running": 0, "waiting": 1}]
        assert await limits.delete_limit(conn, lid) is True
        assert await limits.delete_limit(conn, lid) is False
        assert [r["limit_id"] for r in await limits.limits_of(conn, path)] == [keyed["limit_id"]]
        assert await limits.keys_of(conn, [lid]) == [{"limit_id": lid, "key": "k2", "running": 0, "waiting": 1}], \
            "its slots go, its queue stays until each waiter's shard sweeps it"


@covers("limits.take_slot", "limits.give_back", "limits.enqueue", "limits.dequeue", "limits.waits", "limits.release")
async def test_take_slot_grants_in_submission_order_up_to_max_running(db: Pool) -> None:
    path, shard = f"{TAG}/ordered", new_shard()
    e1, e2, e3, e4, e5 = (new_eid() for _ in range(5))
    count = "SELECT count(*) AS n FROM noetl.concurrency_slot WHERE limit_id = %s AND key = 'k'"
    async with autocommit(db) as conn:
        lid = (await limits.set_limit(conn, path, "", 2))["limit_id"]

        async def take(eid: int) -> bool:
            got = await limits.take_slot(conn, lid, "k", 2, eid, shard)
            assert (await sql1(db, count, (lid,)) or {})["n"] <= 2, "never more than max_running"
            return got

        assert [await take(e) for e in (e1, e2, e3, e4)] == [True, True, False, False]
        assert await limits.waits(conn, e3) == [{"limit_id": lid, "key": "k", "path": path, "max_running": 2,
                                                "running": 2, "ahead": 0}]
        assert [w["ahead"] for w in await limits.waits(conn, e4)] == [1]
        await limits.give_back(conn, lid, "k", e1)
        assert await take(e4) is False, "e3 was submitted first"
        assert await take(e3) is True
        assert await take(e3) is True, "a slot held already"
        assert await limits.waits(conn, e3) == [], "a slot taken leaves the queue"
        assert await take(e4) is False
        await limits.release(conn, [])
        await limits.release(conn, [e2])
        assert await take(e4) is True
        for _ in range(2):
            await limits.enqueue(conn, lid, "k", e5, shard)
        assert [w["ahead"] for w in await limits.waits(conn, e5)] == [0]
        await limits.dequeue(conn, e5)
        assert await limits.waits(conn, e5) == []
        await limits.enqueue(conn, lid, "k", e5, shard)
        await limits.release(conn, [e3, e4, e5])
        assert await limits.waits(conn, e5) == []
    assert (await sql1(db, count, (lid,)) or {})["n"] == 0


@covers("limits.heads")
async def test_heads_are_the_queued_executions_that_may_start_now(db: Pool, catalog_id: int) -> None:
    sa, sb = new_shard(), new_shard()
    e1, e2, e3, e9 = (new_eid() for _ in range(4))
    async with autocommit(db) as conn:
        lid = (await limits.set_limit(conn, f"{TAG}/heads", "", 1))["limit_id"]
        gone = (await limits.set_limit(conn, f"{TAG}/gone", "", 1))["limit_id"]
        await limits.delete_limit(conn, gone)
        assert await limits.take_slot(conn, lid, "k", 1, e1, sa) is True
        assert await limits.take_slot(conn, lid, "k", 1, e2, sa) is False
        assert await limits.take_slot(conn, lid, "k", 1, e3, sb) is False
        await limits.enqueue(conn, gone, "k", e9, sb)
        assert await limits.heads(conn, shard=sa, limit=100) == [], "the queue's slot is taken"
        assert await limits.heads(conn, shard=sb, limit=100) == [(e9, sb)], "its limit is gone: it starts"
        await limits.give_back(conn, lid, "k", e1)
        assert await limits.heads(conn, shard=sa, limit=100) == [(e2, sa)]
        assert await limits.heads(conn, shard=sb, limit=100) == [(e9, sb)], "e3 is not the head of its queue"
        every = await limits.heads(conn, shard=None, limit=100_000)
        assert {(e2, sa), (e9, sb)} <= set(every) and (e3, sb) not in every
        await engine_state.save_states(conn, sa, [(ExecState(e2, sa, catalog_id), 1, None)])
        assert await limits.heads(conn, shard=sa, limit=100) == [], "started already"
        assert await limits.heads(conn, shard=sb, limit=1) == [(e9, sb)]


# ================================================================ catalog, credentials

@covers("catalog.insert", "catalog.lock_path")
async def test_catalog_insert_keeps_every_version_and_lock_path_serialises_a_path(db: Pool, pg_dsn: str) -> None:
    path = f"{TAG}/catalog"
    try_lock = "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0)) AS ok"
    at = datetime(2026, 1, 1, tzinfo=UTC)
    async with transaction(db) as conn, connect(pg_dsn) as other:
        await catalog.lock_path(conn, path)
        assert (await (await other.execute(try_lock, (f"catalog:{path}",))).fetchone() or {})["ok"] is False
        assert (await (await other.execute(try_lock, (f"catalog:{path}/x",))).fetchone() or {})["ok"] is True
        row = await catalog.insert(conn, path=path, version=1, kind="Playbook", name="one", content="a: 1",
                                   sha256="ab" * 32, doc={"a": 1, "at": at})
    assert {k: row[k] for k in ("path", "version", "kind", "name", "content", "content_sha256", "doc")} == {
        "path": path, "version": 1, "kind": "Playbook", "name": "one", "content": "a: 1", "content_sha256": "ab" * 32,
        "doc": {"a": 1, "at": str(at)}}
    assert isinstance(row["catalog_id"], int) and isinstance(row["created_at"], datetime)
    async with connect(pg_dsn) as other:
        assert (await (await other.execute(try_lock, (f"catalog:{path}",))).fetchone() or {})["ok"] is True
    async with transaction(db) as conn:
        two = await catalog.insert(conn, path=path, version=2, kind="Playbook", name="two", content="", sha256="",
                                   doc={})
    assert two["catalog_id"] > row["catalog_id"]
    with pytest.raises(Conflict):
        async with transaction(db) as conn:
            await catalog.insert(conn, path=path, version=1, kind="Playbook", name="dup", content="", sha256="",
                                 doc={})


@dataclass(frozen=True)
class Sealed:
    key_id: str
    wrapped_key: bytes
    nonce: bytes
    ciphertext: bytes


@covers("credentials.put", "credentials.reseal")
async def test_credentials_are_stored_sealed_and_resealed_without_plaintext(db: Pool) -> None:
    name, legacy = unique("cred"), unique("legacy")
    one, two = Sealed("k1", b"wk1", b"n1", b"c1"), Sealed("k2", b"wk2", b"n2", b"c2")
    read = "SELECT kind, data, key_id, wrapped_key, nonce, ciphertext FROM noetl.credential WHERE name = %s"
    async with autocommit(db) as conn:
        assert await credentials.put(conn, name, "postgres", one) is True
        assert await sql1(db, read, (name,)) == {"kind": "postgres", "data": None, "key_id": "k1",
                                                 "wrapped_key": b"wk1", "nonce": b"n1", "ciphertext": b"c1"}
        assert await credentials.put(conn, name, "http", two) is False, "replaced"
        assert await sql1(db, read, (name,)) == {"kind": "http", "data": None, "key_id": "k2", "wrapped_key": b"wk2",
                                                 "nonce": b"n2", "ciphertext": b"c2"}
    await sql(db, "INSERT INTO noetl.credential (name, kind, data) VALUES (%s, 'postgres', '{\"dsn\": \"x\"}')",
              (legacy,))
    async with autocommit(db) as conn:
        await credentials.reseal(conn, legacy, one)
        await credentials.reseal(conn, unique("none"), one)  # no such row: nothing happens
    assert await sql1(db, read, (legacy,)) == {"kind": "postgres", "data": None, "key_id": "k1",
                                               "wrapped_key": b"wk1", "nonce": b"n1", "ciphertext": b"c1"}


# ================================================================ schedules

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@covers("schedules.ScheduleStore.add", "schedules.ScheduleStore.get", "schedules.ScheduleStore.all",
        "schedules.ScheduleStore.pause", "schedules.ScheduleStore.resume", "schedules.ScheduleStore.delete",
        "schedules.spec_of")
async def test_the_api_s_schedule_changes(db: Pool) -> None:
    store = ScheduleStore(db, shard_count=16)
    name = unique("sched")
    row = await store.add(name=name, path="p/s", version=3, payload={"a": 1}, spec=Spec(interval_ms=60_000),
                          catch_up=CatchUp.ONCE, paused=False, created_by=7, now=T0)
    sid = row["schedule_id"]
    assert {k: row[k] for k in ("name", "shard_id", "catalog_path", "catalog_version", "payload", "cron",
                                "time_zone", "interval_ms", "catch_up", "paused", "next_tick", "created_by",
                                "last_tick", "last_execution_id")} == {
        "name": name, "shard_id": shard_for(sid, 16), "catalog_path": "p/s", "catalog_version": 3,
        "payload": {"a": 1}, "cron": None, "time_zone": "UTC", "interval_ms": 60_000, "catch_up": "once",
        "paused": False, "next_tick": T0 + timedelta(minutes=1), "created_by": 7, "last_tick": None,
        "last_execution_id": None}
    assert spec_of(row) == Spec(cron="", time_zone="UTC", interval_ms=60_000)
    assert spec_of({"cron": "0 * * * *", "time_zone": "Europe/Paris", "interval_ms": None}) == Spec(
        "0 * * * *", "Europe/Paris", 0)
    with pytest.raises(Conflict):
        await store.add(name=name, path="p/s", version=0, payload={}, spec=Spec(interval_ms=1000),
                        catch_up=CatchUp.ALL, paused=False, created_by=None)
    assert await store.get(name) == row
    assert name in {r["name"] for r in await store.all()}
    paused = await store.pause(name)
    assert paused["paused"] is True
    t1 = datetime(2026, 2, 1, 0, 0, 0, 123_456, tzinfo=UTC)
    resumed = await store.resume(name, now=t1)
    assert (resumed["paused"], resumed["next_tick"]) == (False, t1.replace(microsecond=123_000) + timedelta(minutes=1))
    assert (await store.resume(name, now=T0))["next_tick"] == resumed["next_tick"], "not paused: nothing moves"
    for call in (store.get, store.pause, store.resume):
        with pytest.raises(NotFound):
            await call(unique("none"))
    assert await store.delete(name) is True
    assert await store.delete(name) is False


@covers("schedules.ScheduleStore.fire_due", "schedules.ScheduleStore.next_due", "schedules.ScheduleStore.pending",
        "schedules.ScheduleStore.submitted", "schedules.ScheduleStore.refused", "schedules.ScheduleStore.ticks",
        "schedules.idempotency_key")
async def test_the_reaper_s_rounds_record_ticks_once_until_submitted(db: Pool) -> None:
    store = ScheduleStore(db, shard_count=16)
    shard, owner = new_shard(), new_owner()
    row = await store.add(name=unique("round"), path="p/r", version=0, payload={"b": 2}, spec=Spec(interval_ms=1000),
                          catch_up=CatchUp.ALL, paused=False, created_by=None, now=T0)
    sid = row["schedule_id"]
    await sql(db, "UPDATE noetl.schedule SET shard_id = %s WHERE schedule_id = %s", (shard, sid))
    await put_lease(db, "reaper", shard, owner, 1)
    at = T0 + timedelta(seconds=3.5)
    other = new_shard()  # no schedule there: left out of what is due and pending
    now, due = await store.next_due([shard, other])
    assert due == {shard: T0 + timedelta(seconds=1)} and now > at
    assert (await store.next_due([]))[1] == {}
    with pytest.raises(LeaseLost):
        await store.fire_due(shard, new_owner(), 1, grace_sec=5, now=at)
    assert await store.ticks(sid) == []
    got = await store.fire_due(shard, owner, 1, grace_sec=5, now=at)
    assert (got.fired, got.skipped, got.lag_sec, got.next_due, got.now) == (
        3, 0, [2.5, 1.5, 0.5], T0 + timedelta(seconds=4), at)
    assert (await store.fire_due(shard, owner, 1, grace_sec=5, now=at)).fired == 0, "next_tick moved past now"
    ticks = [T0 + timedelta(seconds=n) for n in (1, 2, 3)]
    assert [(t["tick"], t["shard_id"], t["epoch"], t["execution_id"]) for t in await store.ticks(sid)] == [
        (t, shard, 1, None) for t in ticks]
    assert (await store.next_due([shard]))[1] == {shard: T0 + timedelta(seconds=4)}
    pending = await store.pending([shard, other])
    assert list(pending) == [shard]
    assert [(p["schedule_id"], p["tick"], p["catalog_path"], p["catalog_version"], p["payload"], p["shard_id"])
            for p in pending[shard]] == [(sid, t, "p/r", 0, {"b": 2}, shard) for t in ticks]
    assert [p["tick"] for p in (await store.pending([shard], limit=1))[shard]] == ticks[:1]
    e1, e2 = new_eid(), new_eid()
    await store.submitted(sid, ticks[0], e1)
    await store.submitted(sid, ticks[0], e2)  # a retry answered again: the first execution stays
    await store.refused(sid, ticks[1], "x" * 3000)
    found = {t["tick"]: t for t in await store.ticks(sid)}
    assert (found[ticks[0]]["execution_id"], found[ticks[0]]["submitted_at"] is not None) == (e1, True)
    assert (found[ticks[1]]["execution_id"], len(found[ticks[1]]["error"])) == (None, 2000)
    assert [p["tick"] for p in (await store.pending([shard]))[shard]] == [ticks[2]]
    assert idempotency_key(sid, ticks[0]) == f"schedule/{sid}/{int(ticks[0].timestamp() * 1000)}"


# ================================================================ tokens

@covers("tokens.register", "tokens.revoke", "tokens.listed", "tokens.identity")
async def test_tokens_register_once_identify_while_live_and_revoke(db: Pool) -> None:
    name = unique("token")
    sha1, sha2 = (hashlib.sha256(uuid.uuid4().bytes).hexdigest() for _ in range(2))
    async with autocommit(db) as conn:
        first = await tokens.register(conn, name, "admin", sha1, "tester")
        assert isinstance(first, int)
        assert await tokens.register(conn, unique("again"), "read", sha1, None) is None, "a known token"
    with pytest.raises(Conflict):  # a live token of that name (the error comes out of the connection's block)
        async with autocommit(db) as conn:
            await tokens.register(conn, name, "read", sha2, None)
    async with autocommit(db) as conn:
        assert await tokens.identity(conn, sha1) == {"token_id": first, "name": name, "role": "admin"}
        assert await tokens.identity(conn, sha2) is None
        live = {r["token_id"]: r for r in await tokens.listed(conn, False)}
        assert {k: live[first][k] for k in ("name", "role", "created_by", "revoked_at")} == {
            "name": name, "role": "admin", "created_by": "tester", "revoked_at": None}
        assert await tokens.revoke(conn, name) is True
        assert await tokens.revoke(conn, name) is False
        assert await tokens.revoke(conn, str(first)) is False, "revoked already"
        assert await tokens.identity(conn, sha1) is None
        assert first not in {r["token_id"] for r in await tokens.listed(conn, False)}
        every = {r["token_id"]: r for r in await tokens.listed(conn, True)}
        assert isinstance(every[first]["revoked_at"], datetime)
        second = await tokens.register(conn, name, "read", sha2, None)
        assert second is not None and second > first, "a revoked token's name is free again"
        assert await tokens.revoke(conn, str(second)) is True, "by id"


@covers("tokens.register_sync")
async def test_register_sync_registers_on_a_blocking_connection_once(db: Pool, pg_dsn: str) -> None:
    name, sha = unique("cli"), hashlib.sha256(uuid.uuid4().bytes).hexdigest()

    def register_twice() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            tokens.register_sync(conn, name, "admin", sha, "dev up")
            tokens.register_sync(conn, name, "admin", sha, "dev up")

    await asyncio.to_thread(register_twice)
    found = await sql(db, "SELECT name, role, created_by FROM noetl.api_token WHERE token_sha256 = %s", (sha,))
    assert found == [{"name": name, "role": "admin", "created_by": "dev up"}]


@covers("tokens.runtime_secret")
async def test_runtime_secret_is_created_by_whoever_asks_first(db: Pool) -> None:
    name = unique("secret")
    async with autocommit(db) as conn:
        assert await tokens.runtime_secret(conn, name, b"first") == b"first"
        assert await tokens.runtime_secret(conn, name, b"second") == b"first"


# ================================================================ noetl_store._postgres

@covers(f"{STORE_MODULE}.PostgresResultStore.put", f"{STORE_MODULE}.PostgresResultStore.get",
        f"{STORE_MODULE}.PostgresResultStore.get_many", f"{STORE_MODULE}.PostgresResultStore.get_many_sized",
        f"{STORE_MODULE}.PostgresResultStore.chain", f"{STORE_MODULE}.PostgresResultStore.close",
        f"{STORE_MODULE}.loop_reference")
async def test_result_refs_and_payloads(db: Pool) -> None:
    """The db tier's rows (every tier's behaviour: tests/integration/test_result_store.py)."""
    eid = new_eid()
    store = PostgresResultStore(db)
    r1 = await store.put({"v": 1}, execution_id=eid, step="a", command_id="c1", task="t1", parent_ref_id=None)
    r2 = await store.put([1, 2], execution_id=eid, step="b", command_id="c2", task="t2", parent_ref_id=r1.ref_id)
    assert r1 == Reference(r1.ref_id, "db", f"pg://result_payload/{r1.ref_id}")
    row = await sql1(db, "SELECT r.*, p.data FROM noetl.result_ref r JOIN noetl.result_payload p USING (ref_id)"
                         " WHERE ref_id = %s", (r2.ref_id,)) or {}
    assert {k: row[k] for k in ("execution_id", "step", "command_id", "task", "tier", "uri", "parent_ref_id")} == {
        "execution_id": eid, "step": "b", "command_id": "c2", "task": "t2", "tier": "db", "uri": r2.uri,
        "parent_ref_id": r1.ref_id}
    assert (row["size_bytes"], row["sha256"]) == (len(row["data"]), hashlib.sha256(row["data"]).hexdigest())
    assert await store.get(r1.ref_id) == {"v": 1}
    missing = r2.ref_id + 1_000_000_000
    assert await store.get_many([r2.ref_id, r1.ref_id, missing]) == {r2.ref_id: [1, 2], r1.ref_id: {"v": 1}}
    assert await store.get_many_sized([r2.ref_id, missing]) == {r2.ref_id: ([1, 2], row["size_bytes"])}
    assert await store.chain(r2.ref_id) == [r2, r1]
    for call in (store.get, store.chain):
        with pytest.raises(NotFound):
            await call(missing)
    with pytest.raises(NotFound):
        await store.put(1, execution_id=eid, step="c", command_id="c3", task="t", parent_ref_id=missing)

    async with autocommit(db) as conn:
        await loops.store_loop_results(conn, [(eid, "i1", 0, "ok", r1.ref_id), (eid, "i1", 1, "error", None),
                                              (eid, "i1", 2, "ok", r2.ref_id)])
    async with transaction(db) as conn:
        ref = await loop_reference(conn, eid, "loop", f"loop://{eid}/i1", {"total": 3, "failed": 1})
    row = await sql1(db, "SELECT r.tier, r.uri, r.size_bytes, r.step, p.data FROM noetl.result_ref r"
                         " JOIN noetl.result_payload p USING (ref_id) WHERE ref_id = %s", (ref,)) or {}
    assert (row["tier"], row["uri"], row["step"], json.loads(row["data"])) == (
        "loop", f"loop://{eid}/i1", "loop", {"stats": {"total": 3, "failed": 1}})
    assert row["size_bytes"] == len(row["data"])
    assert await store.get(ref) == {"results": [{"v": 1}, None, [1, 2]], "stats": {"total": 3, "failed": 1}}
    await store.close()
