"""A loop's collection and its iterations' results: ``noetl.loop_item``, ``noetl.loop_result``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from noetl_common.vocab import ResultStatus

from ._conn import GUARD, Column, Conn, Write, columns, run

LOOP_ITEMS_CHUNK = 10_000


async def store_loop_items(conn: Conn, execution_id: int, instance: str,
                           items: list[Any]) -> None:
    """A loop's collection, rendered once at entry, one row per item (a ``Column``
    array per chunk: the engine's transaction runs in pipeline mode, where COPY is not available)."""
    for start in range(0, len(items), LOOP_ITEMS_CHUNK):
        chunk = items[start:start + LOOP_ITEMS_CHUNK]
        await conn.execute(
            "INSERT INTO noetl.loop_item (execution_id, loop_instance, idx, item)"
            " SELECT %b, %b, %b + i.ord - 1, i.item::jsonb FROM unnest(%t::text[]) WITH ORDINALITY AS i(item, ord)",
            (execution_id, instance, start, Column(json.dumps(item, default=str) for item in chunk)))


class IterationKey(NamedTuple):
    execution_id: int
    instance: str
    idx: int


class IterationResult(NamedTuple):
    """An accepted iteration result: its status (``ResultStatus``) and reference."""

    execution_id: int
    instance: str
    idx: int
    status: str
    ref_id: int | None


async def store_loop_results(conn: Conn, rows: Iterable[IterationResult]) -> None:
    await run(conn, store_loop_results_write(rows))


def store_loop_results_write(rows: Iterable[IterationResult]) -> Write | None:
    """``store_loop_results``' statement (None: no rows)."""
    rows = list(rows)
    if not rows:
        return None
    return Write(
        "INSERT INTO noetl.loop_result (execution_id, loop_instance, idx, status, ref_id)"
        f" SELECT * FROM unnest(%t::bigint[], %t::text[], %t::int[], %t::text[], %t::bigint[]) WHERE {GUARD}"
        " ON CONFLICT DO NOTHING", columns(rows, 5))


async def loop_results(conn: Conn, execution_id: int, instance: str) -> dict[int, int | None]:
    """{index: ref_id} of a loop instance's accepted iteration results."""
    cur = await conn.execute(
        "SELECT idx, ref_id FROM noetl.loop_result WHERE execution_id = %s AND loop_instance = %s",
        (execution_id, instance))
    return {int(r["idx"]): r["ref_id"] for r in await cur.fetchall()}


async def ok_ranges(conn: Conn, execution_id: int, instance: str) -> list[tuple[int, int]]:
    """The successful iterations of a loop instance as [start, end) index ranges (islands:
    O(ranges) rows whatever the collection's size)."""
    cur = await conn.execute(
        "SELECT min(idx) AS lo, max(idx) + 1 AS hi FROM (SELECT idx, idx - row_number() OVER (ORDER BY idx) AS g"
        f" FROM noetl.loop_result WHERE execution_id = %s AND loop_instance = %s AND status = '{ResultStatus.OK}') x"
        " GROUP BY g ORDER BY lo", (execution_id, instance))
    return [(int(r["lo"]), int(r["hi"])) for r in await cur.fetchall()]


async def copy_loop(conn: Conn, source: int, source_instance: str, execution_id: int,
                    instance: str) -> None:
    """A rerun's resumed loop: the original instance's items, and its successful iteration
    results (references: the payloads stay the original's), into the new instance."""
    await conn.execute(
        "INSERT INTO noetl.loop_item (execution_id, loop_instance, idx, item)"
        " SELECT %s, %s, idx, item FROM noetl.loop_item WHERE execution_id = %s AND loop_instance = %s"
        " ON CONFLICT DO NOTHING", (execution_id, instance, source, source_instance))
    await conn.execute(
        "INSERT INTO noetl.loop_result (execution_id, loop_instance, idx, status, ref_id)"
        " SELECT %s, %s, idx, status, ref_id FROM noetl.loop_result WHERE execution_id = %s AND loop_instance = %s"
        f" AND status = '{ResultStatus.OK}' ON CONFLICT DO NOTHING", (execution_id, instance, source, source_instance))


async def clear_loop_results(conn: Conn, rows: Sequence[IterationKey]) -> None:
    """Take back failed iteration results a redrive re-issues ((execution, instance, index))."""
    if rows:
        await conn.execute(
            "DELETE FROM noetl.loop_result l USING unnest(%t::bigint[], %t::text[], %t::int[]) AS x(e, li, ix)"
            f" WHERE l.execution_id = x.e AND l.loop_instance = x.li AND l.idx = x.ix AND l.status = '{ResultStatus.ERROR}'",
            columns(list(rows), 3))
