"""What a template operation would build, known before it is built.

One :class:`Guard` is active per render (a context variable, so threads and tasks each
have their own). It holds the limits and what the render has spent so far:

* ``template_value_size``: no single value an operation builds (a string, a list, the
  printed form of a structure) may exceed it, in characters or items;
* ``template_int_bits``: no integer may be wider;
* ``template_iterations``: loop iterations over the whole render;
* ``template_render_size``: everything the render builds, added up (values, output,
  the literal text a loop repeats), which bounds the work of a loop that builds
  values, not only their memory.

Sizes are *printed* sizes, measured by :func:`Guard.measure` without printing: a list
holding the same 10 MB string a hundred times is 1 GB once printed, although it holds
one string. Measuring memoises per object, so a structure that shares its parts
(``[[x] * 10] * 10 ...``) costs its distinct objects to measure, never its expansion,
and the last values measured are remembered across operations (a loop that keeps
extending the same list measures the new part only).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

import jinja2
from jinja2.utils import Namespace

from noetl_common.config import LimitSettings
from noetl_common.limits import LimitExceeded, defaults, exceeded

__all__ = ["Guard", "Refused", "activate", "configure", "configured", "current", "deactivate", "printf_size"]

_RECENT = 64  # values whose size a guard remembers


class Refused(jinja2.exceptions.SecurityError):
    """A template operation refused by a limit; ``error`` names it."""

    def __init__(self, error: LimitExceeded) -> None:
        self.error = error
        super().__init__(str(error))


class Guard:
    """The limits of one render and what it has spent."""

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        self.value_size = limits.template_value_size
        self.render_size = limits.template_render_size
        self.iterations = 0
        self.built = 0
        self._recent: OrderedDict[int, tuple[Any, int]] = OrderedDict()

    # ------------------------------------------------------------ refusals

    def refuse(self, what: str, actual: int, setting: str, *, unit: str = "", at_least: bool = False) -> Refused:
        limit = int(getattr(self.limits, setting))
        return Refused(exceeded(what, actual, setting, limit, unit=unit, at_least=at_least))

    def value(self, what: str, size: int, *, at_least: bool = False) -> None:
        """A value of ``size`` characters/items is about to be built: refuse it when too
        big, else charge it to the render."""
        if size > self.value_size:
            unit = "characters or items"
            raise self.refuse(what, size, "template_value_size", unit=unit, at_least=at_least)
        self.built += size
        if self.built > self.render_size:
            self.charge(0)

    def bits(self, what: str, bits: int) -> None:
        if bits > self.limits.template_int_bits:
            raise self.refuse(what, bits, "template_int_bits", unit="bits")
        self.charge(bits // 8)

    def charge(self, size: int) -> None:
        self.built += size
        if self.built > self.render_size:
            raise self.refuse("what one template render built in total", self.built, "template_render_size",
                              unit="characters or items", at_least=True)

    def iterate(self, literal: int) -> None:
        """One loop iteration, whose body repeats ``literal`` characters of text."""
        self.iterations += 1
        if self.iterations > self.limits.template_iterations:
            raise self.refuse("one template render's loop iteration count", self.iterations, "template_iterations",
                              at_least=True)
        if literal:
            self.charge(literal)

    # ------------------------------------------------------------ sizes

    def remember(self, value: Any, size: int) -> None:
        """Note the measured size of a value just built (kept alive while remembered,
        so its id cannot be reused meanwhile)."""
        if _leaf_size(value) is None:
            self._recent[id(value)] = (value, size)
            if len(self._recent) > _RECENT:
                self._recent.popitem(last=False)

    def _known(self, value: Any) -> int | None:
        hit = self._recent.get(id(value))
        if hit is not None and hit[0] is value:
            self._recent.move_to_end(id(value))
            return hit[1]
        return None

    def measure(self, value: Any, cap: int | None = None) -> int:
        """The printed size of ``value`` (characters; a container's items and
        separators), computed without printing it and without recursion. Stops early
        (returning more than ``cap``, the value limit by default) once it is too big."""
        leaf = _leaf_size(value)
        if leaf is not None:
            return leaf
        cap = self.value_size if cap is None else cap
        known = self._known(value)
        if known is not None:
            return known
        sizes: dict[int, int] = {}
        stack: list[Any] = [value]
        while stack:
            item = stack[-1]
            key = id(item)
            if key in sizes and sizes[key] >= 0:
                stack.pop()
                continue
            children = _children(item)
            if key not in sizes:  # first visit: measure the containers below first
                sizes[key] = -1
                for child in children:
                    if _leaf_size(child) is None and id(child) not in sizes and self._known(child) is None:
                        stack.append(child)
                continue
            total = _own_size(item)
            for child in children:
                size = _leaf_size(child)
                if size is None:
                    size = self._known(child)
                if size is None:
                    size = max(sizes.get(id(child), 0), 0)  # -1: a cycle, printed as [...]
                total += size
                if total > cap:
                    return total
            sizes[key] = total
            stack.pop()
        size = sizes[id(value)]
        self.remember(value, size)
        return size


_GUARD: ContextVar[Guard | None] = ContextVar("noetl_template_guard", default=None)
_configured: LimitSettings = defaults()


def configure(limits: LimitSettings | None) -> None:
    """The limits of every later render in this process (None: the defaults)."""
    global _configured
    _configured = limits or defaults()


def configured() -> LimitSettings:
    return _configured


def current() -> Guard:
    """The active render's guard; outside a render (a constant folded while compiling,
    a template used directly), a fresh one with the configured limits."""
    guard = _GUARD.get()
    return guard if guard is not None else Guard(_configured)


def activate(guard: Guard) -> Any:
    """Make ``guard`` the active one; returns the token to :func:`deactivate` with."""
    return _GUARD.set(guard)


def deactivate(token: Any) -> None:
    _GUARD.reset(token)


def _leaf_size(value: Any) -> int | None:
    """The printed size of a value that holds no other values; None for containers."""
    kind = type(value)
    if kind is str:  # the common cases first, by identity (isinstance on ABCs is slow)
        return len(value)
    if kind is int:
        return value.bit_length() * 77 // 256 + 2  # decimal digits: bits * log10(2)
    if kind is list or kind is dict or kind is tuple:
        return None
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 77 // 256 + 2  # decimal digits: bits * log10(2)
    if isinstance(value, float):
        return 24
    if isinstance(value, Mapping | list | tuple | set | frozenset | Namespace):
        return None
    return 0 if isinstance(value, jinja2.Undefined) else 32


def _children(value: Any) -> list[Any]:
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # type: ignore[attr-defined]
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    return list(value)


def _own_size(value: Any) -> int:
    """Brackets and separators of a container, without its items."""
    count = len(value._Namespace__attrs) if isinstance(value, Namespace) else len(value)  # type: ignore[attr-defined]
    return 2 + (4 if isinstance(value, Mapping | Namespace) else 2) * count


# ---------------------------------------------------------------- estimates

_PRINTF = re.compile(r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<prec>\*|\d*))?[hlL]?(?P<conv>.)",
                     re.DOTALL)
_NUMERIC = frozenset("diouxXeEfFgG")


def printf_size(guard: Guard, fmt: str | bytes, args: Any) -> int:
    """An upper estimate of ``fmt % args`` (printf-style): the format's text plus, per
    conversion, the wider of its width and its value (precision included)."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    if isinstance(args, tuple):
        positional, mapping = list(args), None
    elif isinstance(args, Mapping):
        positional, mapping = [], args
    else:
        positional, mapping = [args], None
    total = len(text)
    index = 0

    def take() -> Any:
        nonlocal index
        index += 1
        return positional[index - 1] if index <= len(positional) else None

    for match in _PRINTF.finditer(text):
        conv = match["conv"]
        if conv == "%":
            continue
        width = _star(take()) if match["width"] == "*" else int(match["width"] or 0)
        prec = _star(take()) if match["prec"] == "*" else int(match["prec"] or 0)
        key = match["key"]
        arg = _lookup(mapping, key) if key is not None else take()
        total += max(width, field_size(guard, arg, prec, conv in _NUMERIC))
    return total


def field_size(guard: Guard, value: Any, precision: int, numeric: bool) -> int:
    """How wide one formatted value can print (before padding to a width)."""
    if numeric:
        # %f / {:f} of a large float prints every integral digit (up to 309)
        digits = 330 if isinstance(value, float) else guard.measure(value)
        return digits + precision + 8
    size = guard.measure(value)
    return min(size, precision) if precision else size


def _star(value: Any) -> int:
    return abs(value) if isinstance(value, int) else 0


def _lookup(mapping: Mapping[str, Any] | None, key: str) -> Any:
    try:
        return mapping[key] if mapping is not None else None
    except (KeyError, TypeError):
        return None


_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<prec>\d+))?(?P<type>[a-zA-Z%])?")


def spec_size(guard: Guard, value: Any, spec: str) -> int:
    """An upper estimate of ``format(value, spec)`` (``str.format`` fields)."""
    match = _SPEC.fullmatch(spec)
    if match is None:  # a type's own mini-language (dates): text from the spec and the value
        return guard.measure(value) + 8 * len(spec)
    numeric = bool(match["type"]) and match["type"] in "eEfFgGn%dbcoxX"
    width = int(match["width"] or 0)
    return max(width, field_size(guard, value, int(match["prec"] or 0), numeric))


def power_bits(base: int, exponent: int) -> int:
    """Bits of ``base ** exponent`` for integers (exponent >= 0), without computing it."""
    magnitude = abs(base)
    if magnitude <= 1 or exponent <= 0:
        return 1
    if exponent.bit_length() > 64:  # beyond any limit (and beyond a float)
        return 1 << 64
    return math.ceil(exponent * math.log2(magnitude)) + 1
