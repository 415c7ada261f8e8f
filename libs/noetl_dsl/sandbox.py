"""Jinja's immutable sandbox, with every operation that can explode bounded.

A template of a few bytes must not make the process allocate more than about
``template_value_size`` or spin in one C call (``{{ 3 ** (3 ** 16) }}`` took a minute,
at compile time, because Jinja folds constants). Each such operation is checked, from
the sizes of its operands, *before* it runs (:mod:`.sizes` holds the measures and the
per-render :class:`~.sizes.Guard`):

* operators ``**``, ``*``, ``+``, ``%`` are intercepted (so never folded at compile
  time): integer results against ``template_int_bits``, strings and sequences
  (repetition, concatenation, printf formatting) against ``template_value_size``;
* ``~`` concatenation, list/tuple/dict displays, ``{{ }}`` output (``finalize``):
  the printed size of what they build;
* ``{% for %}`` (and recursive ``loop(...)``): iterations against
  ``template_iterations``, each charging the literal text its body repeats;
* filters, methods and globals that take a size or repeat a value: ``center``,
  ``indent``, ``wordwrap``, ``join``, ``replace``, ``format``, ``batch``, ``slice``,
  ``sum``, ``urlize``, ``str.center/ljust/rjust/zfill/expandtabs/replace/join/
  translate/format``, ``int.to_bytes``, ``range``, ``lipsum``, ``dict``,
  ``namespace``; every filter that prints its input first measures it.

These checks are added by rewriting the template's syntax tree before it is compiled
(:class:`_Bounded`), so they hold whatever the expression.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jinja2
from jinja2 import nodes, pass_context
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

from noetl_common.limits import LimitExceeded, check_json_depth

from .sizes import Guard, Refused, current, power_bits, printf_size, spec_size

__all__ = ["BoundedSandbox", "bounded_fromjson", "bounded_sum", "bounded_tojson"]

_SEQUENCES = (str, bytes, bytearray, list, tuple)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with bounded operations (see the module docstring)."""

    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finalize = self._finalize_output
        self.globals.update(range=_range, lipsum=_lipsum, dict=_built_by(dict), namespace=_built_by(Namespace))
        for name, func in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, func)
        self.filters["sum"] = bounded_sum
        self.filters["tojson"] = bounded_tojson

    # ------------------------------------------------------------ compile

    def compile(self, source: Any, name: str | None = None, filename: str | None = None, raw: bool = False,
                defer_init: bool = False) -> Any:
        """Compile as usual after adding the checks to the syntax tree."""
        if isinstance(source, str):
            source = self.parse(source, name, filename)
        return super().compile(_Bounded().visit(source), name, filename, raw, defer_init)  # type: ignore[call-overload]

    # ------------------------------------------------------------ operators

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        guard = current()
        if operator == "**":
            if _is_int(left) and _is_int(right) and right > 0:
                guard.bits("`**` result", power_bits(left, right))
        elif operator == "*":
            _check_repeat(guard, left, right)
        elif operator == "+":
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
                size = guard.measure(left) + guard.measure(right)
                guard.value("`+` result", size)
                result = self.binop_table[operator](left, right)
                guard.remember(result, size)
                return result
        elif operator == "%" and isinstance(left, str | bytes):
            guard.value("`%` formatting result", printf_size(guard, left, right))
        return self.binop_table[operator](left, right)

    # ------------------------------------------------------------ nodes added by _Bounded

    def noetl_iterate(self, iterable: Any, literal: int = 0) -> _Counted:
        return _Counted(iterable, current(), literal)

    def noetl_built(self, value: Any) -> Any:
        guard = current()
        guard.value("a list or mapping display", guard.measure(value), at_least=True)
        return value

    def noetl_concat(self, *parts: Any) -> str:
        guard = current()
        guard.value("`~` concatenation", sum(guard.measure(p) for p in parts), at_least=True)
        return "".join(map(str, parts))

    def _finalize_output(self, value: Any) -> Any:
        guard = current()
        size = len(value) if type(value) is str else guard.measure(value)
        guard.value("`{{ }}` output", size, at_least=True)
        return value

    # ------------------------------------------------------------ methods

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if isinstance(obj, jinja2.Undefined):  # fails as it always did, naming what is undefined
            return super().call(context, obj, *args, **kwargs)
        owner = getattr(obj, "__self__", None)
        name = getattr(obj, "__name__", "")
        if isinstance(owner, str | bytes | bytearray) and name in _TEXT_METHODS:
            args = _TEXT_METHODS[name](current(), owner, *args, **kwargs)
        elif _is_int(owner) and name == "to_bytes":
            length = args[0] if args else kwargs.get("length", 1)
            if _is_int(length):
                current().value("int.to_bytes result", length)
        result = super().call(context, obj, *args, **kwargs)
        if name == "fromkeys":
            guard = current()
            guard.value("dict.fromkeys result", guard.measure(result), at_least=True)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` / ``format_map`` through a formatter that checks each field's
        width before formatting it and the total as it grows."""
        if not isinstance(value, types.MethodType | types.BuiltinMethodType) \
                or value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
            return None
        f_self = value.__self__
        formatter: SandboxedFormatter = (_BoundedEscapeFormatter(self, escape=f_self.escape)
                                         if isinstance(f_self, Markup) else _BoundedFormatter(self))
        is_map = value.__name__ == "format_map"
        str_type = type(f_self)

        @functools.wraps(value)
        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                return str_type(formatter.vformat(f_self, (), args[0]))
            return str_type(formatter.vformat(f_self, args, kwargs))

        return wrapper


class _BoundedFormatter(SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        guard = current()
        size = spec_size(guard, value, format_spec)
        self._built = getattr(self, "_built", 0) + size
        guard.value("str.format result", self._built, at_least=True)
        return super().format_field(value, format_spec)

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._built = len(format_string)
        return super().vformat(format_string, args, kwargs)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


# ---------------------------------------------------------------- the rewrite


class _Bounded(NodeTransformer):
    """Adds the checks to a template's syntax tree: loops count their iterations,
    ``~`` and container displays measure what they build."""

    def __init__(self) -> None:
        self._recursive: list[int] = []  # literal text of the enclosing recursive loops

    def visit_For(self, node: Any) -> nodes.Node:
        literal = _literal_text(node.body)
        self._recursive.append(literal if node.recursive else -1)
        try:
            node = self.generic_visit(node)
        finally:
            self._recursive.pop()
        node.iter = _env_call("noetl_iterate", node, node.iter, nodes.Const(literal))
        return node

    def visit_Call(self, node: Any) -> nodes.Node:
        node = self.generic_visit(node)
        recursive = [n for n in self._recursive if n >= 0]
        if recursive and isinstance(node.node, nodes.Name) and node.node.name == "loop" and node.args:
            node.args[0] = _env_call("noetl_iterate", node, node.args[0], nodes.Const(recursive[-1]))
        return node

    def visit_Concat(self, node: Any) -> nodes.Node:
        node = self.generic_visit(node)
        return _env_call("noetl_concat", node, *node.nodes)

    def visit_List(self, node: nodes.List) -> nodes.Node:
        return self._display(node, node.items)

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        return self._display(node, node.items) if node.ctx == "load" else self.generic_visit(node)

    def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
        return self._display(node, [part for pair in node.items for part in (pair.key, pair.value)])

    def _display(self, node: Any, items: list[nodes.Expr]) -> nodes.Node:
        constant = all(isinstance(item, nodes.Const) for item in items)
        node = self.generic_visit(node)
        return node if constant else _env_call("noetl_built", node, node)


def _env_call(method: str, at: nodes.Node, *args: nodes.Expr) -> nodes.Call:
    call = nodes.Call(nodes.EnvironmentAttribute(method), list(args), [], None, None)
    call.set_lineno(at.lineno or 1)
    return call


def _literal_text(body: list[nodes.Node]) -> int:
    """Characters of literal text a loop body outputs per iteration (nested loops
    count their own)."""
    total = 0
    stack: list[nodes.Node] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, nodes.TemplateData):
            total += len(node.data)
        elif not isinstance(node, nodes.For):
            stack.extend(node.iter_child_nodes())
    return total


class _Counted:
    """A loop's iterable, counting each iteration against the render's budget."""

    __slots__ = ("_guard", "_items", "_literal")

    def __init__(self, items: Any, guard: Guard, literal: int) -> None:
        self._items, self._guard, self._literal = items, guard, literal

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        guard, literal = self._guard, self._literal
        for item in self._items:
            guard.iterate(literal)
            yield item


# ---------------------------------------------------------------- operand checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_repeat(guard: Guard, left: Any, right: Any) -> None:
    """``*``: integer products by bits, sequence repetition by printed size."""
    if _is_int(left) and _is_int(right):
        guard.bits("`*` result", left.bit_length() + right.bit_length())
        return
    seq, times = (left, right) if isinstance(left, _SEQUENCES) else (right, left)
    if isinstance(seq, _SEQUENCES) and isinstance(times, int) and times > 1:
        guard.value("`*` repetition", len(seq) * times)  # items, before their sizes
        per = guard.measure(seq, cap=guard.value_size // times + 1)
        guard.value("`*` repetition", per * times)


def _width(value: Any) -> int:
    return value if _is_int(value) else 0


def _replaced_size(guard: Guard, text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(text, str | bytes | bytearray) or not isinstance(old, type(text)) \
            or not isinstance(new, str | bytes | bytearray):
        return guard.measure(text)
    growth = len(new) - len(old)
    if growth <= 0:
        return len(text)
    source: Any = text
    hits = source.count(old) if old else len(text) + 1
    if _is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * growth


def _joined_size(guard: Guard, sep: Any, items: list[Any]) -> int:
    return len(sep) * max(len(items) - 1, 0) + sum(guard.measure(i) for i in items)


def _text_join(guard: Guard, owner: Any, iterable: Any = (), *rest: Any, **kw: Any) -> tuple[Any, ...]:
    items = list(iterable)
    guard.value(f"{type(owner).__name__}.join result", _joined_size(guard, owner, items))
    return (items, *rest)


def _text_pad(name: str) -> Callable[..., tuple[Any, ...]]:
    def check(guard: Guard, owner: Any, *args: Any, **kw: Any) -> tuple[Any, ...]:
        width = args[0] if args else kw.get("width", 0)
        guard.value(f"{type(owner).__name__}.{name} result", max(len(owner), _width(width)))
        return args
    return check


def _text_expandtabs(guard: Guard, owner: Any, *args: Any, **kw: Any) -> tuple[Any, ...]:
    size = args[0] if args else kw.get("tabsize", 8)
    tab = "\t" if isinstance(owner, str) else b"\t"
    guard.value("expandtabs result", len(owner) + owner.count(tab) * max(_width(size), 0))
    return args


def _text_replace(guard: Guard, owner: Any, *args: Any, **kw: Any) -> tuple[Any, ...]:
    if len(args) >= 2:
        guard.value("replace result", _replaced_size(guard, owner, *args[:3]))
    return args


def _text_translate(guard: Guard, owner: Any, *args: Any, **kw: Any) -> tuple[Any, ...]:
    table = args[0] if args else None
    if isinstance(table, Mapping):
        widest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        guard.value("translate result", len(owner) * max(widest, 1))
    return args


_TEXT_METHODS: dict[str, Callable[..., tuple[Any, ...]]] = {
    "center": _text_pad("center"), "ljust": _text_pad("ljust"), "rjust": _text_pad("rjust"),
    "zfill": _text_pad("zfill"), "expandtabs": _text_expandtabs, "replace": _text_replace,
    "join": _text_join, "translate": _text_translate,
}


# ---------------------------------------------------------------- globals


def _range(*args: int) -> range:
    guard = current()
    try:
        rng = range(*args)
        length = len(rng)
    except OverflowError:
        length = guard.limits.template_iterations + 1
    if length > guard.limits.template_iterations:
        raise guard.refuse("range", length, "template_iterations", unit="items")
    return rng


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # Jinja's parameter names
    current().value("lipsum text", _width(n) * _width(max) * 16)
    return generate_lorem_ipsum(n, html, min, max)


def _built_by(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        result = factory(*args, **kwargs)
        guard = current()
        guard.value(f"{getattr(factory, '__name__', 'value').lower()}(...) result", guard.measure(result), at_least=True)
        return result
    return build


# ---------------------------------------------------------------- filters

# Filters that print their input, so measure it first (then their output).
_PRINTING = frozenset({
    "capitalize", "center", "e", "escape", "filesizeformat", "forceescape", "format", "indent", "lower",
    "pprint", "replace", "safe", "string", "striptags", "title", "trim", "truncate", "upper", "urlencode",
    "urlize", "wordcount", "wordwrap", "xmlattr",
})


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` behind the checks for ``name``; marked ``pass_context`` so Jinja never
    runs it at compile time on constant arguments."""
    special = _SPECIAL_FILTERS.get(name)
    if special is None and name not in _PRINTING:
        return func
    passed = getattr(getattr(func, "jinja_pass_arg", None), "name", None)

    @pass_context
    @functools.wraps(func)
    def bounded(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        guard = current()
        if name in _PRINTING:
            guard.value(f"input of filter {name}", guard.measure(value), at_least=True)
        if special is not None:
            value, args = special(guard, value, *args, **kwargs)
        first: tuple[Any, ...] = {"context": (context,), "eval_context": (context.eval_ctx,),
                                  "environment": (context.environment,)}.get(passed or "", ())
        result = func(*first, value, *args, **kwargs)
        if isinstance(result, str | list):
            guard.value(f"filter {name} result", len(result))
        return result

    return bounded


def _f_center(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    width = args[0] if args else kw.get("width", 80)
    guard.value("filter center result", max(guard.measure(value), _width(width)))
    return value, args


def _f_indent(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    width = args[0] if args else kw.get("width", 4)
    pad = len(width) if isinstance(width, str) else _width(width)
    text = str(value)
    guard.value("filter indent result", len(text) + pad * (text.count("\n") + 1))
    return value, args


def _f_wordwrap(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    text = str(value)
    width = args[0] if args else kw.get("width", 79)
    wrap = args[2] if len(args) > 2 else kw.get("wrapstring")
    lines = len(text) // max(_width(width), 1) + text.count("\n") + 1
    guard.value("filter wordwrap result", len(text) + lines * len(wrap if isinstance(wrap, str) else "\n"))
    return value, args


def _f_join(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    items = list(value)
    sep = args[0] if args else kw.get("d", "")
    guard.value("filter join result", _joined_size(guard, str(sep), items))
    return items, args


def _f_replace(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    if len(args) >= 2:
        guard.value("filter replace result", _replaced_size(guard, str(value), *args[:3]))
    return value, args


def _f_format(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    guard.value("filter format result", printf_size(guard, str(value), kw or args))
    return value, args


def _f_urlize(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    text = str(value)
    extra = sum(len(v) for v in (kw.get("target"), kw.get("rel"), *args[2:4]) if isinstance(v, str))
    words = text.count(" ") + text.count("\n") + 1
    guard.value("filter urlize result", 3 * len(text) + words * (extra + 64))
    return value, args


def _f_batch(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    count = args[0] if args else kw.get("linecount", 1)
    fill = args[1] if len(args) > 1 else kw.get("fill_with")
    if fill is not None and _is_int(count):
        guard.value("filter batch fill", max(count - 1, 0) * max(guard.measure(fill), 1))
    return value, args


def _f_slice(guard: Guard, value: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[Any, ...]]:
    count = args[0] if args else kw.get("slices", 1)
    fill = args[1] if len(args) > 1 else kw.get("fill_with")
    if _is_int(count):
        if count > guard.limits.template_iterations:
            raise guard.refuse("filter slice count", count, "template_iterations")
        if fill is not None:
            guard.value("filter slice fill", count * max(guard.measure(fill), 1))
    return value, args


_SPECIAL_FILTERS: dict[str, Callable[..., tuple[Any, tuple[Any, ...]]]] = {
    "center": _f_center, "indent": _f_indent, "wordwrap": _f_wordwrap, "join": _f_join,
    "replace": _f_replace, "format": _f_format, "urlize": _f_urlize, "batch": _f_batch, "slice": _f_slice,
}


@pass_context
def bounded_sum(context: Context, iterable: Iterable[Any], attribute: str | int | None = None,
                start: Any = 0) -> Any:
    """Jinja's ``sum``, linear for lists and tuples (``sum`` copies the running list
    at every step: quadratic in one C call)."""
    guard = current()
    if attribute is not None:
        getter = jinja2.filters.make_attrgetter(context.environment, attribute)
        iterable = map(getter, iterable)
    if not isinstance(start, list | tuple):
        return sum(iterable, start)
    out = list(start)
    for item in iterable:
        if type(item) is not type(start):
            raise TypeError(f'can only concatenate {type(start).__name__} (not "{type(item).__name__}")'
                            f" to {type(start).__name__}")
        out.extend(item)
        if len(out) > guard.value_size:
            guard.value("filter sum result", len(out), at_least=True)
    guard.value("filter sum result", guard.measure(out), at_least=True)
    return out if isinstance(start, list) else tuple(out)


@pass_context
def bounded_tojson(context: Context, value: Any) -> str:
    guard = current()
    guard.value("input of filter tojson", guard.measure(value), at_least=True)
    text = json.dumps(value, default=str)
    guard.value("filter tojson result", len(text))
    return text


@pass_context
def bounded_fromjson(context: Context, value: Any) -> Any:
    guard = current()
    try:
        check_json_depth(value, guard.limits, what="filter fromjson input")
    except LimitExceeded as exc:
        raise Refused(exc) from None
    return json.loads(value)

