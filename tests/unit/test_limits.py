"""noetl_common.limits: one shape for every refusal, and nesting depth measured without
recursion (JSON text before decoding, decoded values)."""

from __future__ import annotations

import json

import pytest

from noetl_common import limits
from noetl_common.config import LimitSettings
from noetl_common.errors import InvalidInput, PlaybookInvalid
from noetl_common.limits import LimitExceeded, PlaybookLimitExceeded


def test_message_names_what_value_setting_and_limit() -> None:
    err = limits.exceeded("playbook", 20971520, "playbook_bytes", 1048576, unit="bytes")
    assert str(err) == "playbook is 20971520 bytes; limit NOETL_LIMIT_PLAYBOOK_BYTES=1048576"
    assert isinstance(err, InvalidInput) and not isinstance(err, PlaybookInvalid)
    assert (err.setting, err.env, err.limit, err.actual) == ("playbook_bytes", "NOETL_LIMIT_PLAYBOOK_BYTES",
                                                             1048576, 20971520)
    deep = limits.exceeded("payload nesting depth", 101, "nesting_depth", 100, at_least=True)
    assert str(deep) == "payload nesting depth is at least 101; limit NOETL_LIMIT_NESTING_DEPTH=100"


def test_playbook_flavour_is_also_playbook_invalid() -> None:
    err = limits.exceeded("workflow", 10001, "playbook_steps", 10000, unit="steps", path="workflow")
    assert isinstance(err, PlaybookLimitExceeded) and isinstance(err, PlaybookInvalid)
    assert isinstance(err, LimitExceeded)
    assert err.path == "workflow"
    assert str(err) == err.message == "workflow is 10001 steps; limit NOETL_LIMIT_PLAYBOOK_STEPS=10000"


def test_check_uses_the_given_settings_or_the_defaults() -> None:
    limits.check(10_000, "playbook_steps", None, "workflow")
    with pytest.raises(LimitExceeded, match="NOETL_LIMIT_PLAYBOOK_STEPS=10000"):
        limits.check(10_001, "playbook_steps", None, "workflow")
    small = LimitSettings.model_construct(playbook_steps=5)
    with pytest.raises(LimitExceeded, match="workflow is 6 steps; limit NOETL_LIMIT_PLAYBOOK_STEPS=5"):
        limits.check(6, "playbook_steps", small, "workflow", unit="steps")


def test_env_name_rejects_unknown_settings() -> None:
    assert limits.env_name("yaml_nodes") == "NOETL_LIMIT_YAML_NODES"
    with pytest.raises(ValueError):
        limits.env_name("nope")


def test_defaults_do_not_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOETL_LIMIT_NESTING_DEPTH", "9")
    assert limits.defaults().nesting_depth == 100


@pytest.mark.parametrize("text, depth", [
    ("1", 0), ('"[[["', 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4),
    (r'["\"[[[", "\\", [["x\\"]]]]', 3),   # brackets inside strings, escaped quotes and backslashes
    ("[[[", 3),                            # truncated: the depth seen so far
    ('["unterminated [[[[', 1),            # a string never closed runs to the end
    ('["\\', 1),                          # ... even when the text ends inside an escape
])
def test_json_depth(text: str, depth: int) -> None:
    assert limits.json_depth(text) == depth
    assert limits.json_depth(text.encode()) == depth


def test_json_depth_matches_the_decoder_on_nested_documents() -> None:
    value: object = "leaf"
    for i in range(50):
        value = [value, {"k": i, "s": "]]}}"}] if i % 2 else {"a": value}
    text = json.dumps(value)
    assert limits.json_depth(text) == 50
    limits.check_depth(json.loads(text), LimitSettings.model_construct(nesting_depth=50))
    with pytest.raises(LimitExceeded):
        limits.check_depth(json.loads(text), LimitSettings.model_construct(nesting_depth=49))


def test_a_10000_level_payload_is_refused_before_decoding() -> None:
    text = "[" * 10_000 + "]" * 10_000
    with pytest.raises(LimitExceeded) as info:
        limits.check_json_depth(text)
    assert str(info.value) == "payload nesting depth is 10000; limit NOETL_LIMIT_NESTING_DEPTH=100"
    with pytest.raises(LimitExceeded, match="result nesting depth"):
        limits.check_json_depth(text.encode(), what="result")
    ok = "[" * 100 + "]" * 100
    limits.check_json_depth(ok)
    limits.check_json_depth('{"a": "' + "[" * 5000 + '"}')  # brackets in a string are text


def test_json_depth_is_linear_on_hostile_quotes() -> None:
    # An unterminated string of escaped quotes: a string pattern retried from every quote
    # would be quadratic; a string never closed runs to the end of the text instead.
    text = "[" * 200 + '"' + '\\"' * 500_000
    assert limits.json_depth(text) == 200
    with pytest.raises(LimitExceeded):
        limits.check_json_depth(text)


def test_check_depth_of_decoded_values_is_iterative() -> None:
    deep: object = 1
    for _ in range(100_000):  # far past the recursion limit
        deep = [deep]
    with pytest.raises(LimitExceeded, match="value nesting depth is at least 101"):
        limits.check_depth(deep)
    limits.check_depth({"a": [{"b": (1, 2)}], "c": "[[["})
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(LimitExceeded):
        limits.check_depth(cyclic)


def test_check_depth_path_makes_a_playbook_error() -> None:
    nine: object = 1
    for _ in range(9):
        nine = [nine]
    with pytest.raises(PlaybookLimitExceeded) as info:
        limits.check_depth(nine, LimitSettings.model_construct(nesting_depth=8), what="playbook", path="")
    assert info.value.path == ""
    assert str(info.value) == "playbook nesting depth is at least 9; limit NOETL_LIMIT_NESTING_DEPTH=8"
