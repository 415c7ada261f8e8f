"""The cursor slot runtime and the driver registry, with an in-memory driver (the
postgres driver runs the same runtime in tests/integration/test_cursor_runtime.py).

The in-memory driver is also the proof that a backend plugs in through
``register_driver`` alone: neither the runtime nor the engine knows about it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from waiting import until_set

from noetl_common.errors import Unavailable
from noetl_proto.v1 import messages_pb2
from noetl_store import MemoryResultStore, envelope_from_proto
from noetl_worker.cursor import CURSOR_KIND, run_cursor_slot
from noetl_worker.cursor_drivers import CursorDriver, CursorDrivers, CursorError, CursorSpec, Row
from noetl_worker.tools import Tools


class CountingStore(MemoryResultStore):
    def __init__(self) -> None:
        super().__init__()
        self.puts: list[tuple[str, Any]] = []

    async def put(self, value: Any, **kw: Any) -> Any:
        self.puts.append((kw["task"], value))
        return await super().put(value, **kw)


class MemoryDriver:
    """Rows from a shared list; logs claim / report / commit / rollback in order."""

    kind = "memory"

    def __init__(self, rows: list[Row], log: list[tuple[str, Any]]) -> None:
        self.rows = rows
        self.log = log

    @asynccontextmanager
    async def claim(self, statement: str) -> AsyncIterator[Row | None]:
        row = self.rows[0] if self.rows else None
        self.log.append(("claim", row))
        try:
            yield row
        except BaseException:
            self.log.append(("rollback", row))
            raise
        if row is not None:
            self.rows.pop(0)
        self.log.append(("commit", row))


class MemoryFactory:
    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows
        self.log: list[tuple[str, Any]] = []
        self.opened: list[CursorSpec] = []
        self.closed = False

    async def open(self, spec: CursorSpec, secrets: Any = None) -> CursorDriver:
        self.opened.append(spec)
        return MemoryDriver(self.rows, self.log)

    async def close(self) -> None:
        self.closed = True


def slot_command(tool: Any, *, slot: int = 0, resume: Any = None, kind: str = "memory",
                 claim: str = "next") -> messages_pb2.Command:
    context = {"execution_id": 77, "workload": {"tag": "W"}, "ctx": {}, "steps": {}, "known_steps": [],
               "event": {}, "iter": {"_index": slot}, "loop_index": slot, "resume": resume,
               "loop": {"instance": "s:1", "index": slot, "iterator": "rec", "mode": "cursor"},
               "cursor": {"kind": kind, "auth": "cred", "claim": claim, "options": {"pool_size": 2}}}
    return messages_pb2.Command(command_id=f"77:s:1:{slot}", execution_id=77, shard_id=1, step="s", attempt=1,
                                kind=CURSOR_KIND, spec_json=json.dumps({"step": "s", "tool": tool}),
                                context_json=json.dumps(context))


def tools_with(factory: MemoryFactory) -> Tools:
    drivers = CursorDrivers()
    drivers.register_driver("memory", factory)
    return Tools(cursors=drivers)


ECHO = {"name": "echo", "kind": "noop",
        "input": {"id": "{{ rec.id }}", "same": "{{ iter.rec.id }}", "n": "{{ iter._index }}",
                  "slot": "{{ loop_index }}", "tag": "{{ tag }}"}}


async def test_rows_run_in_claim_order_and_counts_are_the_value() -> None:
    factory = MemoryFactory([{"id": 1}, {"id": 2}, {"id": 3}])
    seen: list[Any] = []
    tool = [ECHO, {"name": "keep", "kind": "noop", "input": {"v": "{{ echo }}"},
                   "set": {"ctx.last_id": "{{ echo.id }}"}}]
    store = CountingStore()

    async def report(row: Row, counts: dict[str, int]) -> None:
        seen.append(row)

    result = await run_cursor_slot(slot_command(tool, slot=2), store, tools_with(factory), report=report,
                                   worker_id="w")
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "ok", env
    assert env["context"] == {"processed": 3, "succeeded": 3, "failed": 0}
    assert await store.get(env["reference"]["ref_id"]) == {"processed": 3, "succeeded": 3, "failed": 0}
    assert seen == [{"id": 1}, {"id": 2}, {"id": 3}]
    assert json.loads(result.set_json) == {"ctx": {"last_id": 3}, "iter": {}}
    assert factory.opened[0] == CursorSpec("memory", "cred", "next", {"pool_size": 2})
    # Only the slot's counts are stored, never a row's task results.
    assert store.puts == [("cursor", {"processed": 3, "succeeded": 3, "failed": 0})]


async def test_iter_scope_of_a_row() -> None:
    factory = MemoryFactory([{"id": 5}])
    captured: list[Any] = []

    class Capture(Tools):
        async def run_task(self, task: Any, scope: Any, **kw: Any) -> Any:
            captured.append((dict(scope["iter"]), scope["rec"], scope["loop_index"], kw["call"].key))
            return await super().run_task(task, scope, **kw)

    tools = Capture(cursors=tools_with(factory).cursors)
    result = await run_cursor_slot(slot_command([ECHO], slot=1), MemoryResultStore(), tools)
    assert envelope_from_proto(result.envelope)["context"]["processed"] == 1
    iter_scope, rec, slot, key = captured[0]
    assert iter_scope == {"rec": {"id": 5}, "_index": 0} and rec == {"id": 5} and slot == 1
    assert key.startswith("77:s:1:1#row:") and key.endswith("#echo")


async def test_progress_is_reported_before_the_claim_commits() -> None:
    factory = MemoryFactory([{"id": 1}, {"id": 2}])

    async def report(row: Row, counts: dict[str, int]) -> None:
        factory.log.append(("report", row))

    await run_cursor_slot(slot_command([ECHO]), MemoryResultStore(), tools_with(factory), report=report)
    assert factory.log == [
        ("claim", {"id": 1}), ("report", {"id": 1}), ("commit", {"id": 1}),
        ("claim", {"id": 2}), ("report", {"id": 2}), ("commit", {"id": 2}),
        ("claim", None), ("commit", None)]


async def test_unrecorded_claim_is_rolled_back_and_retried() -> None:
    factory = MemoryFactory([{"id": 1}])
    failures = [Unavailable("api down")]
    slept: list[float] = []

    async def report(row: Row, counts: dict[str, int]) -> None:
        if failures:
            raise failures.pop()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    result = await run_cursor_slot(slot_command([ECHO]), MemoryResultStore(), tools_with(factory), report=report,
                                   sleep=sleep)
    assert envelope_from_proto(result.envelope)["context"]["processed"] == 1
    assert factory.log[:3] == [("claim", {"id": 1}), ("rollback", {"id": 1}), ("claim", {"id": 1})]
    assert slept and slept[0] > 0


async def test_resume_row_runs_first() -> None:
    factory = MemoryFactory([{"id": 2}])
    order: list[Any] = []

    class Record(Tools):
        async def run_task(self, task: Any, scope: Any, **kw: Any) -> Any:
            order.append(scope["rec"]["id"])
            return await super().run_task(task, scope, **kw)

    tools = Record(cursors=tools_with(factory).cursors)
    result = await run_cursor_slot(slot_command([ECHO], resume={"id": 1}), MemoryResultStore(), tools)
    assert order == [1, 2]
    assert envelope_from_proto(result.envelope)["context"] == {"processed": 2, "succeeded": 2, "failed": 0}


async def test_a_resumed_slot_takes_over_the_counts_reported_with_its_row() -> None:
    """Each row is reported with the slot's counts before it; a re-issued attempt gets
    them back with the row (``resume_counts``) and goes on counting from there, so the
    slot's value covers the rows of every attempt (the loop's stats do not lose the rows a
    killed worker had finished)."""
    factory = MemoryFactory([{"id": 4}, {"id": 5}])
    command = slot_command([ECHO], resume={"id": 3})
    context = json.loads(command.context_json)
    context["resume_counts"] = {"processed": 2, "succeeded": 1, "failed": 1}
    command.context_json = json.dumps(context)
    reports: list[tuple[Any, Any]] = []
    indexes: list[tuple[int, int]] = []

    async def report(row: Row, counts: dict[str, int]) -> None:
        reports.append((row, dict(counts)))

    class Record(Tools):
        async def run_task(self, task: Any, scope: Any, **kw: Any) -> Any:
            indexes.append((scope["rec"]["id"], scope["iter"]["_index"]))
            return await super().run_task(task, scope, **kw)

    tools = Record(cursors=tools_with(factory).cursors)
    result = await run_cursor_slot(command, MemoryResultStore(), tools, report=report)
    assert envelope_from_proto(result.envelope)["context"] == {"processed": 5, "succeeded": 4, "failed": 1}
    assert reports == [({"id": 4}, {"processed": 3, "succeeded": 2, "failed": 1}),
                       ({"id": 5}, {"processed": 4, "succeeded": 3, "failed": 1})]
    assert indexes == [(3, 2), (4, 3), (5, 4)]  # the resumed row keeps the index it had


async def test_counts_before_each_row_are_reported_with_it() -> None:
    factory = MemoryFactory([{"id": 1}, {"id": 2}])
    tool = [{"name": "t", "kind": "noop", "input": {"x": "{{ rec.id }}"},
             "spec": {"policy": {"rules": [{"when": "{{ rec.id == 1 }}", "then": {"do": "fail"}}]}}}]
    reports: list[tuple[Any, Any]] = []

    async def report(row: Row, counts: dict[str, int]) -> None:
        reports.append((row, dict(counts)))

    await run_cursor_slot(slot_command(tool), MemoryResultStore(), tools_with(factory), report=report)
    assert reports == [({"id": 1}, {"processed": 0, "succeeded": 0, "failed": 0}),
                       ({"id": 2}, {"processed": 1, "succeeded": 0, "failed": 1})]


async def test_failed_rows_are_counted_and_the_slot_moves_on() -> None:
    factory = MemoryFactory([{"id": 1}, {"id": 2}, {"id": 3}])
    tool = [{"name": "t", "kind": "noop", "input": {"x": "{{ rec.id }}"},
             "spec": {"policy": {"rules": [{"when": "{{ rec.id == 2 }}", "then": {"do": "fail"}}]}}}]
    result = await run_cursor_slot(slot_command(tool), MemoryResultStore(), tools_with(factory))
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "ok"
    assert env["context"] == {"processed": 3, "succeeded": 2, "failed": 1,
                              "last_error": "task 't' failed by policy"}


async def test_unknown_cursor_kind_fails_the_slot_clearly() -> None:
    result = await run_cursor_slot(slot_command([ECHO], kind="mysql"), MemoryResultStore(),
                                   tools_with(MemoryFactory([])))
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "error" and env["error"]["code"] == "CURSOR_ERROR"
    assert env["error"]["message"] == "unknown cursor kind 'mysql' (this worker has drivers for: memory)"


async def test_claim_error_fails_the_slot_with_counts_so_far() -> None:
    class Broken(MemoryFactory):
        async def open(self, spec: CursorSpec, secrets: Any = None) -> CursorDriver:
            rows = self.rows

            class Driver(MemoryDriver):
                @asynccontextmanager
                async def claim(self, statement: str) -> AsyncIterator[Row | None]:
                    if not rows:
                        raise CursorError("relation \"gone\" does not exist")
                    yield rows.pop(0)

            return Driver(self.rows, self.log)

    result = await run_cursor_slot(slot_command([ECHO]), MemoryResultStore(), tools_with(Broken([{"id": 1}])))
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "error" and env["error"]["code"] == "CURSOR_ERROR"
    assert "does not exist" in env["error"]["message"]
    assert env["context"] == {"processed": 1, "succeeded": 1, "failed": 0}
    assert env["reference"] is not None


async def test_missing_cursor_spec_is_an_error() -> None:
    command = slot_command([ECHO])
    context = json.loads(command.context_json)
    context["cursor"] = {"kind": "memory", "claim": "  "}
    command.context_json = json.dumps(context)
    env = envelope_from_proto((await run_cursor_slot(command, MemoryResultStore(),
                                                     tools_with(MemoryFactory([])))).envelope)
    assert env["status"] == "error" and "needs a `claim` statement" in env["error"]["message"]


async def test_stop_cancels_the_slot_and_rolls_back_the_claim() -> None:
    factory = MemoryFactory([{"id": 1}])
    reporting = asyncio.Event()

    async def report(row: Row, counts: dict[str, int]) -> None:
        reporting.set()
        await asyncio.Event().wait()  # the api never answers; the command is stopped meanwhile

    task = asyncio.ensure_future(run_cursor_slot(slot_command([ECHO]), MemoryResultStore(), tools_with(factory),
                                                 report=report))
    await until_set(reporting, timeout=5, what="the slot reporting its claimed row")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert factory.log == [("claim", {"id": 1}), ("rollback", {"id": 1})]
    assert factory.rows == [{"id": 1}]


def test_registry_lookup_and_options() -> None:
    drivers = CursorDrivers()
    factory = MemoryFactory([])
    drivers.register_driver("Memory", factory)
    assert drivers.lookup("memory") is factory and drivers.kinds == ["memory"]
    with pytest.raises(CursorError, match="unknown cursor kind 'redis'"):
        drivers.lookup("redis")
    spec = CursorSpec.from_json({"claim": "x", "auth": "a"})
    assert spec.kind == "postgres" and spec.pool_size == 8
    with pytest.raises(CursorError, match="pool_size must be at least 1"):
        _ = CursorSpec.from_json({"claim": "x", "options": {"pool_size": 0}}).pool_size


async def test_registry_close_closes_factories() -> None:
    drivers = CursorDrivers()
    factory = MemoryFactory([])
    drivers.register_driver("memory", factory)
    await Tools(cursors=drivers).close()
    assert factory.closed
