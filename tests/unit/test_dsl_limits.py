"""Playbooks beyond a limit are refused before anything is built from them, naming the
setting and its value: size, YAML nodes after alias expansion (billion laughs),
nesting depth (also through aliases), recursive aliases, steps. Ordinary anchors and
aliases keep working."""

from __future__ import annotations

import itertools
import json
import time
import tracemalloc

import pytest
import yaml

from noetl_common.config import LimitSettings
from noetl_common.errors import PlaybookInvalid
from noetl_common.limits import PlaybookLimitExceeded
from noetl_dsl import load_playbook, load_yaml, parse_playbook, validate

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t}\n"


def limits(**kw: int) -> LimitSettings:
    return LimitSettings.model_construct(**kw)


def billion_laughs(levels: int = 9, width: int = 10) -> str:
    names = "abcdefghijklmnop"[:levels]
    lines = ["a: &a [" + ",".join(['"lol"'] * width) + "]"]
    for prev, cur in itertools.pairwise(names):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_billion_laughs_is_refused_at_once_with_bounded_memory() -> None:
    text = billion_laughs()
    assert len(text.encode()) < 430  # the 426-byte document of issue 11 (10 x 9 levels)
    tracemalloc.start()
    try:
        with pytest.raises(PlaybookLimitExceeded) as info:
            parse_playbook(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = info.value
    assert (err.setting, err.limit, err.path) == ("yaml_nodes", 200_000, "")
    assert str(err).startswith("playbook after alias expansion is at least ")
    assert str(err).endswith(" YAML nodes; limit NOETL_LIMIT_YAML_NODES=200000")
    assert peak < 2 * 1024 * 1024  # nothing was expanded
    with pytest.raises(PlaybookLimitExceeded):
        load_yaml(text)  # what the catalog calls before storing json.dumps(doc)


def test_a_big_scalar_repeated_by_aliases_is_measured_in_characters() -> None:
    text = "a: &a " + "x" * 50_000 + "\nb: [" + ",".join(["*a"] * 30) + "]\n"
    with pytest.raises(PlaybookLimitExceeded) as info:
        load_yaml(text)
    assert info.value.setting == "playbook_bytes"
    assert "after alias expansion is at least" in str(info.value)
    assert "characters of scalars; limit NOETL_LIMIT_PLAYBOOK_BYTES=1048576" in str(info.value)


def test_ordinary_anchors_and_aliases_still_work() -> None:
    text = HEADER + """\
workload: {base: &base {retries: 3, url: "http://x"}}
workflow:
- step: start
  tool: &noop {kind: noop}
  next: [{step: b}]
- step: b
  tool: *noop
  input:
    <<: *base
    extra: [*base, *base]
"""
    pb = parse_playbook(text)
    assert pb.step("b").tool == {"kind": "noop"}
    assert pb.step("b").input == {"retries": 3, "url": "http://x", "extra": [{"retries": 3, "url": "http://x"}] * 2}
    assert load_yaml(text) == yaml.safe_load(text)


@pytest.mark.parametrize("text", [
    "a: 1\nb: [1, 2, {c: d}]\n", "- x\n- y\n", "", "42\n", "k: !!str 12\nt: 2001-12-14\n",
    "? [a, b]\n: 1\n", "a: &x 1\nb: *x\n", "x: |\n  text\n  more\n",
])
def test_same_values_as_safe_load(text: str) -> None:
    try:
        expected = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # e.g. an unhashable key: the same error either way
        with pytest.raises(type(exc)):
            load_yaml(text)
        return
    assert load_yaml(text) == expected


@pytest.mark.parametrize("text, error", [
    ("a: &x 1\nb: &x 2\n", "found duplicate anchor 'x'; first occurrence \\(line 1, column 4\\): "
                          "second occurrence \\(line 2, column 4\\)"),
    ("a: *nope\n", "found undefined alias 'nope' \\(line 1, column 4\\)"),
    ("--- 1\n--- 2\n", "expected a single document in the stream \\(line 1, column 5\\): "
                      "but found another document \\(line 2, column 1\\)"),
    ("a: [1\n", "while parsing a flow sequence \\(line 1, column 4\\): did not find expected ',' or ']'"),
])
def test_malformed_yaml_names_context_and_problem(text: str, error: str) -> None:
    with pytest.raises(PlaybookInvalid, match=error):
        parse_playbook(text)


def test_recursive_alias_is_refused() -> None:
    with pytest.raises(PlaybookInvalid, match=r"recursive alias \*x \(line 1, column 8\)"):
        parse_playbook("a: &x [*x]\n")


def test_size_is_checked_before_parsing() -> None:
    text = HEADER + "workload: {pad: '" + "x" * (1024 * 1024) + "'}\n"
    started = time.perf_counter()
    with pytest.raises(PlaybookLimitExceeded) as info:
        parse_playbook(text)
    assert time.perf_counter() - started < 5
    size = len(text.encode())
    assert str(info.value) == f"playbook is {size} bytes; limit NOETL_LIMIT_PLAYBOOK_BYTES=1048576"
    # multi-byte characters count as bytes
    with pytest.raises(PlaybookLimitExceeded, match="playbook is 3077 bytes"):
        load_yaml("x: '" + "é" * 1536 + "'", limits(playbook_bytes=3000))


@pytest.mark.parametrize("text", [
    "[" * 500_000 + "]" * 500_000,   # libyaml's own composer crashes the process on this one
    "- " * 300_000 + "x\n",          # block sequences nest too
    "a:\n" + "".join(" " * i + "b:\n" for i in range(1, 200)) + " " * 200 + "c: 1\n",
])
def test_deep_nesting_is_refused_while_parsing(text: str) -> None:
    with pytest.raises(PlaybookLimitExceeded) as info:
        parse_playbook(text)
    assert str(info.value) == "playbook nesting depth is at least 101; limit NOETL_LIMIT_NESTING_DEPTH=100"


def test_nesting_through_aliases_counts_the_expanded_depth() -> None:
    deep = "[" * 60 + "1" + "]" * 60
    text = f"a: &a {deep}\nb: " + "[" * 50 + "*a" + "]" * 50 + "\n"
    with pytest.raises(PlaybookLimitExceeded, match=r"alias \*a expanded\) is 111; limit NOETL_LIMIT_NESTING_DEPTH"):
        load_yaml(text)
    load_yaml(text, limits(nesting_depth=120, yaml_nodes=1000, playbook_bytes=10_000))


def test_recursion_error_anywhere_becomes_a_playbook_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Python's stack, not the nesting limit, stopped a recursive step of validation: a
    # PlaybookInvalid naming the setting, never an internal error.
    def recurse(*_args: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(validate, "_check_workflow", recurse)
    with pytest.raises(PlaybookInvalid, match="NOETL_LIMIT_NESTING_DEPTH=100: lower it"):
        parse_playbook(steps(1))


def steps(n: int) -> str:
    return HEADER + "workflow:\n" + "".join(f"- {{step: s{i}, tool: {{kind: noop}}}}\n" for i in range(n))


def test_step_count_is_limited() -> None:
    parse_playbook(steps(5), limits=limits(playbook_steps=5))
    with pytest.raises(PlaybookLimitExceeded) as info:
        parse_playbook(steps(6), limits=limits(playbook_steps=5))
    assert info.value.path == "workflow"
    assert str(info.value) == "workflow is 6 steps; limit NOETL_LIMIT_PLAYBOOK_STEPS=5"


def test_load_playbook_checks_depth_and_steps_of_a_parsed_document() -> None:
    doc = json.loads(json.dumps(yaml.safe_load(steps(3))))
    load_playbook(doc)
    with pytest.raises(PlaybookLimitExceeded, match="NOETL_LIMIT_PLAYBOOK_STEPS=2"):
        load_playbook(doc, limits=limits(playbook_steps=2))
    nested: object = 1
    for _ in range(200):
        nested = [nested]
    with pytest.raises(PlaybookLimitExceeded, match="playbook nesting depth is at least 101"):
        load_playbook({**doc, "workload": {"x": nested}})


def test_a_nesting_limit_above_the_yaml_parsers_own_bound_is_still_refused_cleanly() -> None:
    # libyaml 0.2.6 stops at 1,000 open levels whatever nesting_depth says: a PlaybookInvalid
    # (naming that bound, or ours when an older libyaml lets the composer count), never a crash.
    with pytest.raises(PlaybookInvalid, match="nest"):
        parse_playbook("[" * 500_000 + "]" * 500_000, limits=limits(nesting_depth=5000))
