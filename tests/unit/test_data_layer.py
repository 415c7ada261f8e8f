"""The data layer owns its tables: every INSERT, UPDATE or DELETE of a ``noetl.*`` table in
the runtime's source is in the one module ``noetl_db.OWNERS`` names for that table."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from noetl_db import OWNERS

ROOT = Path(__file__).resolve().parents[2]
WRITE = re.compile(r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+noetl\.([a-z_]+)", re.IGNORECASE)


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = rel.with_suffix("").parts
    start = next(i for i, p in enumerate(parts) if p.startswith("noetl_"))
    return ".".join(parts[start:])


def writers() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for base in ("libs", "services"):
        for path in (ROOT / base).rglob("*.py"):
            if "noetl_proto" in path.parts:
                continue
            for table in WRITE.findall(path.read_text()):
                found[table.lower()].add(_module(path))
    return found


def test_every_table_is_written_by_its_owner_only() -> None:
    found = writers()
    assert found, "the scan found no statements: its pattern or paths are wrong"
    wrong = {t: sorted(m - {OWNERS.get(t, "?")}) for t, m in found.items() if m - {OWNERS.get(t, "?")}}
    assert not wrong, f"tables written outside their owner module (noetl_db.OWNERS): {wrong}"


def test_every_table_of_the_schema_has_an_owner() -> None:
    schema = "\n".join(p.read_text() for p in (ROOT / "libs/noetl_common/migrations").glob("*.sql"))
    tables = {t.lower() for t in re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?noetl\.([a-z_]+)", schema, re.I)}
    assert tables, "no CREATE TABLE found in the migrations"
    assert not tables - set(OWNERS) - {"event_default"}, f"tables without an owner: {sorted(tables - set(OWNERS))}"
