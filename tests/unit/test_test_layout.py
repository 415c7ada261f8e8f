"""The test tree imports its modules by basename (rootdir-relative, no packages): two
test files with one name in different directories stop the whole collection."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique_across_directories() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "__init__.py" and path.name != "conftest.py":
            seen[path.name].append(str(path.relative_to(TESTS)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
