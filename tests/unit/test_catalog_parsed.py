"""The api's parse cache of inline playbook texts (Catalog.parsed / remember): a client
submitting the same YAML again is not parsed again; any other text is; the cache is bounded
in entries and in the size of the texts it keeps."""

from __future__ import annotations

from noetl_api.catalog import PARSED_TEXT_BYTES, PARSED_TEXTS, Catalog, parse

TEXT = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: cached, path: tests/cached}
workload: {n: 1}
workflow:
  - step: start
    tool: {kind: python, code: "result = n"}
"""


def _catalog() -> Catalog:
    return Catalog(pool=None)  # type: ignore[arg-type]  # parsed/remember touch no database


def test_the_same_text_is_parsed_once_and_any_change_is_a_new_text() -> None:
    cat = _catalog()
    assert cat.parsed(TEXT) is None
    playbook = parse(TEXT)
    cat.remember(TEXT, playbook)
    assert cat.parsed(TEXT) is playbook
    assert cat.parsed(TEXT + "\n") is None  # one more byte: another text
    assert cat.parsed(TEXT.replace("n: 1", "n: 2")) is None


def test_the_cache_is_bounded_least_recently_used_first() -> None:
    cat = _catalog()
    texts = [TEXT.replace("tests/cached", f"tests/cached{i}") for i in range(PARSED_TEXTS + 1)]
    for t in texts[:PARSED_TEXTS]:
        cat.remember(t, parse(t))
    assert cat.parsed(texts[0]) is not None  # used: now the most recent
    cat.remember(texts[-1], parse(texts[-1]))
    assert cat.parsed(texts[0]) is not None
    assert cat.parsed(texts[1]) is None  # the least recently used went
    assert sum(cat.parsed(t) is not None for t in texts) == PARSED_TEXTS


def test_a_text_above_the_size_bound_is_not_kept() -> None:
    cat = _catalog()
    big = TEXT + "#" * PARSED_TEXT_BYTES + "\n"
    cat.remember(big, parse(big))
    assert cat.parsed(big) is None
