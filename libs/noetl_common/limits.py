"""What one request may cost, checked the same way by every role.

Every refusal is a :class:`LimitExceeded` (an ``InvalidInput``, so ``INVALID_ARGUMENT``
on the wire) built by :func:`exceeded`, whose message always has one shape: what was
measured, its value, the setting and the setting's value::

    playbook is 20971520 bytes; limit NOETL_LIMIT_PLAYBOOK_BYTES=1048576

The settings are :class:`~noetl_common.config.LimitSettings`; functions here take them
(or a value of them) as an argument and never read the environment. ``None`` means the
defaults (:func:`defaults`).

Nesting depth is checked without recursion, so a 10,000-level document never reaches a
recursive decoder: :func:`check_json_depth` scans JSON text (strings and escapes
respected, O(n), before ``json.loads``) and :func:`check_depth` walks a decoded value.
Depth counts containers: ``1`` and ``"x"`` are 0 deep, ``[]`` and ``{}`` 1, ``[[1]]`` 2.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

from .config import LimitSettings
from .errors import InvalidInput, PlaybookInvalid

__all__ = [
    "LimitExceeded",
    "PlaybookLimitExceeded",
    "check",
    "check_depth",
    "check_json_depth",
    "defaults",
    "env_name",
    "exceeded",
    "json_depth",
]

_PREFIX = str(LimitSettings.model_config.get("env_prefix", "NOETL_LIMIT_"))


def defaults() -> LimitSettings:
    """The default limits, without reading the environment."""
    return LimitSettings.model_construct()


def env_name(setting: str) -> str:
    """``playbook_bytes`` -> ``NOETL_LIMIT_PLAYBOOK_BYTES``; ValueError for an unknown setting."""
    if setting not in LimitSettings.model_fields:
        raise ValueError(f"unknown limit setting {setting!r}")
    return f"{_PREFIX}{setting.upper()}"


class LimitExceeded(InvalidInput):
    """A request is beyond a limit. ``setting`` is the LimitSettings field
    (``playbook_bytes``), ``env`` its variable, ``limit`` its value, ``actual`` what was
    measured (a lower bound when the measurement stopped early)."""

    def __init__(self, what: str, actual: int, setting: str, limit: int, *, unit: str = "",
                 at_least: bool = False) -> None:
        self.what = what
        self.actual = actual
        self.setting = setting
        self.env = env_name(setting)
        self.limit = limit
        self.unit = unit
        amount = f"at least {actual}" if at_least else str(actual)
        # Not super(): a subclass may also derive from PlaybookInvalid (another __init__).
        InvalidInput.__init__(self, f"{what} is {amount}{' ' + unit if unit else ''}; limit {self.env}={limit}")


class PlaybookLimitExceeded(LimitExceeded, PlaybookInvalid):
    """A playbook beyond a limit: both a :class:`LimitExceeded` and a ``PlaybookInvalid``
    (``path`` is where in the playbook, ``""`` for the whole document)."""

    def __init__(self, path: str, what: str, actual: int, setting: str, limit: int, *, unit: str = "",
                 at_least: bool = False) -> None:
        LimitExceeded.__init__(self, what, actual, setting, limit, unit=unit, at_least=at_least)
        self.path = path
        self.message = str(self)


def exceeded(what: str, actual: int, setting: str, limit: int, *, unit: str = "", at_least: bool = False,
             path: str | None = None) -> LimitExceeded:
    """The error for a broken limit (raise it). With ``path`` it is a
    :class:`PlaybookLimitExceeded` located there."""
    if path is not None:
        return PlaybookLimitExceeded(path, what, actual, setting, limit, unit=unit, at_least=at_least)
    return LimitExceeded(what, actual, setting, limit, unit=unit, at_least=at_least)


def check(actual: int, setting: str, limits: LimitSettings | None, what: str, *, unit: str = "",
          path: str | None = None) -> None:
    """Raise :func:`exceeded` when ``actual`` is above the ``setting`` of ``limits``."""
    limit = int(getattr(limits or defaults(), setting))
    if actual > limit:
        raise exceeded(what, actual, setting, limit, unit=unit, path=path)


# A JSON string, escapes respected; one never closed runs to the end of the text (the
# text is not JSON then, and the decoder will say so), so no match is ever retried from
# a later quote and a pass is O(n) whatever the input.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_BSTRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NOT_BBRACKET = re.compile(rb"[^\[\]{}]+")
_STEP: dict[str | int, int] = {"[": 1, "{": 1, "]": -1, "}": -1, 91: 1, 123: 1, 93: -1, 125: -1}


def json_depth(text: str | bytes) -> int:
    """The deepest container nesting of JSON text, measured without decoding it: strings
    removed, then a running sum over the brackets left (O(n), at C speed)."""
    if isinstance(text, str):
        brackets: str | bytes = _NOT_BRACKET.sub("", _STRING.sub("", text))
    else:
        brackets = _NOT_BBRACKET.sub(b"", _BSTRING.sub(b"", text))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json_depth(text: str | bytes, limits: LimitSettings | None = None, *, what: str = "payload",
                     path: str | None = None) -> None:
    """Refuse JSON text nested deeper than ``nesting_depth`` (call before ``json.loads``)."""
    limit = (limits or defaults()).nesting_depth
    opens = text.count("[") + text.count("{") if isinstance(text, str) else text.count(b"[") + text.count(b"{")
    if opens <= limit:  # no more brackets than the limit: cannot nest deeper
        return
    depth = json_depth(text)
    if depth > limit:
        raise exceeded(f"{what} nesting depth", depth, "nesting_depth", limit, path=path)


def check_depth(value: Any, limits: LimitSettings | None = None, *, what: str = "value",
                path: str | None = None) -> None:
    """Refuse a decoded value (mappings, lists, tuples) nested deeper than ``nesting_depth``.
    Iterative; a value that contains itself is refused too (its depth is unbounded)."""
    limit = (limits or defaults()).nesting_depth
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        depth += 1
        if depth > limit:
            raise exceeded(f"{what} nesting depth", depth, "nesting_depth", limit, at_least=True, path=path)
        stack.extend((child, depth) for child in children if isinstance(child, Mapping | list | tuple))
