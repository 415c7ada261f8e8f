"""``Column``: batch columns sent as Postgres array literals (noetl_common.db) come back
from real Postgres exactly as they went in, for every element type the runtime sends, and
an element it cannot write is refused before anything reaches the server."""

from __future__ import annotations

import enum
import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from noetl_common.db import Column, Pool, array_literal, columns

pytestmark = pytest.mark.integration

AWKWARD = ['', ' ', 'NULL', 'null', '"', '\\', '\\"', '{', '}', '{}', ',', "'", 'a,b', ' lead', 'trail ',
           '\t\n\r', 'é', '😀', '{"k": "v\\"q", "n": [1, 2]}', '\\x00', 'a"b\\c{d}e,f']


async def round_trip(pool: Pool, values: list[Any], cast: str) -> list[Any]:
    async with pool.connection() as conn:
        cur = await conn.execute(f"SELECT v FROM unnest(%t::{cast}) WITH ORDINALITY AS u(v, o) ORDER BY o",
                                 (Column(values),))
        return [r["v"] for r in await cur.fetchall()]


async def test_text_elements_come_back_unchanged(pool: Pool) -> None:
    rng = random.Random(16)
    alphabet = list('ab "\\{},\'\t\nNUL é😀')
    generated = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))) for _ in range(300)]
    for values in (AWKWARD, [*AWKWARD, None, *AWKWARD], generated, [None], []):
        assert await round_trip(pool, values, "text[]") == values


async def test_json_text_cast_to_jsonb_keeps_its_structure(pool: Pool) -> None:
    docs = ['{"a": "quote \\" and backslash \\\\", "b": [1, {"c": null}]}', '"just a string"', "null", "[]"]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT v FROM unnest(%t::text[]::jsonb[]) WITH ORDINALITY AS u(v, o) ORDER BY o",
                                 (Column(docs),))
        got = [r["v"] for r in await cur.fetchall()]
    assert got == [{"a": 'quote " and backslash \\', "b": [1, {"c": None}]}, "just a string", None, []]


async def test_numbers_bools_and_times(pool: Pool) -> None:
    big = [0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]
    assert await round_trip(pool, big, "bigint[]") == big
    assert await round_trip(pool, [1, None, 3], "int[]") == [1, None, 3]
    assert await round_trip(pool, [True, False, None], "bool[]") == [True, False, None]
    floats = [0.1, -2.5e-300, 1e300, 3.0]
    assert await round_trip(pool, floats, "float8[]") == floats
    inf = await round_trip(pool, [float("inf"), float("-inf")], "float8[]")
    assert inf == [float("inf"), float("-inf")]
    stamps = [datetime(2026, 11, 28, 21, 0, 0, 123456, tzinfo=UTC),
              datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=-7))), None]
    assert await round_trip(pool, stamps, "timestamptz[]") == stamps


async def test_enums_are_written_as_their_values(pool: Pool) -> None:
    class Number(enum.IntEnum):
        SEVEN = 7

    class Word(enum.StrEnum):
        QUOTED = 'say "hi"'

    assert await round_trip(pool, [Number.SEVEN, 8], "int[]") == [7, 8]
    assert await round_trip(pool, [Word.QUOTED, "plain"], "text[]") == ['say "hi"', "plain"]


async def test_columns_of_a_batch_feed_unnest(pool: Pool) -> None:
    rows = [(1, "a", None), (2, 'b"\\', 5)]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT * FROM unnest(%t::bigint[], %t::text[], %t::int[]) AS u(a, b, c)",
                                 columns(rows, 3))
        assert [tuple(r.values()) for r in await cur.fetchall()] == rows
        cur = await conn.execute("SELECT count(*) AS n FROM unnest(%t::bigint[], %t::text[]) AS u(a, b)",
                                 columns([], 2))
        assert (await cur.fetchone())["n"] == 0  # type: ignore[index]


def test_an_element_it_cannot_write_is_refused_naming_its_type() -> None:
    for bad in (b"bytes", {"a": 1}, [1, 2], object()):
        with pytest.raises(TypeError, match=f"cannot hold a {type(bad).__name__}"):
            array_literal(["fine", bad])


async def test_a_nul_in_text_is_refused_by_postgres_not_split(pool: Pool) -> None:
    with pytest.raises(psycopg.DataError):
        await round_trip(pool, ["a\0b", "c"], "text[]")
