"""Jinja2 rendering with NoETL's semantics.

* A string that is exactly one ``{{ expression }}`` renders to the expression's native
  value (``'{{ initial_value }}'`` -> ``100``, ``'{{ workload }}'`` -> a dict). Anything
  else renders to a string. Strings are never re-parsed as literals.
* Unknown top-level names are errors that name the template; names the caller declares
  as *known but absent* (steps that have not run) render as None, so
  ``{{ a.x if a else b.x }}`` works on the branch that did not run.
* Missing attributes and keys of known values are lenient, as upstream NoETL playbooks
  expect (``{{ step.data }}`` on a result without ``data``): chained access stays
  undefined, a whole-value expression renders to None and text renders it empty,
  ``| default(...)`` and ``is defined`` work; comparing or computing with an undefined
  value is an error naming the template.
* Compiled templates are cached (bounded LRU).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing

from noetl_common.errors import NoetlError

_MARKERS = ("{{", "{%", "{#")


class TemplateError(NoetlError):
    """A template failed to render. ``template`` is its source text."""

    def __init__(self, template: str, message: str) -> None:
        self.template = template
        self.message = message
        short = template if len(template) <= 200 else template[:197] + "..."
        super().__init__(f"template {short!r}: {message}")


class _Undefined(jinja2.ChainableUndefined):
    """Strict for unknown top-level names (any use but ``default``/``is defined`` fails,
    naming the variable); lenient for a missing attribute or key of a known value (the
    chain stays undefined, prints empty, is falsy). Comparing or computing with either
    is an error."""

    __slots__ = ()

    def _top(self) -> bool:
        return self._undefined_obj is missing

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or self._top():
            return self._fail_with_undefined_error()
        return self

    def __getitem__(self, _name: Any) -> Any:
        if self._top():
            return self._fail_with_undefined_error()
        return self

    def __str__(self) -> str:
        if self._top():
            self._fail_with_undefined_error()
        return ""

    def __bool__(self) -> bool:
        if self._top():
            self._fail_with_undefined_error()
        return False

    def __iter__(self) -> Any:
        if self._top():
            self._fail_with_undefined_error()
        return iter(())

    # ``{{ typo == 'x' }}`` must not quietly be False (a `when` that never fires).
    def __eq__(self, other: object) -> bool:
        if self._top():
            self._fail_with_undefined_error()
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = jinja2.ChainableUndefined.__hash__

    __lt__ = __le__ = __gt__ = __ge__ = jinja2.StrictUndefined.__lt__  # type: ignore[assignment]


def _tojson(value: Any) -> str:
    return json.dumps(value, default=str)


class _Env(ImmutableSandboxedEnvironment):
    """``{{ result.items }}`` means the key ``items`` when a mapping has it (playbooks
    read result fields that shadow dict methods); attributes are the fallback."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, Mapping):
            try:
                return obj[attribute]
            except (KeyError, TypeError):
                pass
        return super().getattr(obj, attribute)


def _make_env() -> jinja2.Environment:
    env = _Env(undefined=_Undefined, autoescape=False, keep_trailing_newline=True)
    env.filters["tojson"] = _tojson
    env.filters["to_json"] = _tojson
    env.filters["fromjson"] = json.loads
    env.filters["from_json"] = json.loads
    env.globals["now"] = _now
    return env


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat()


_ENV = _make_env()


def is_template(value: Any) -> bool:
    return isinstance(value, str) and any(m in value for m in _MARKERS)


@lru_cache(maxsize=4096)
def _parse(source: str) -> tuple[jinja2.Template | None, Any, frozenset[str]]:
    """(full template, compiled single expression or None, undeclared names)."""
    try:
        ast = _ENV.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(source, f"syntax error: {exc.message} (line {exc.lineno})") from exc
    names = frozenset(meta.find_undeclared_variables(ast))
    expr = None
    body = ast.body
    if len(body) == 1 and isinstance(body[0], nodes.Output) and len(body[0].nodes) == 1 \
            and not isinstance(body[0].nodes[0], nodes.TemplateData):
        stripped = source.strip()
        if stripped.startswith("{{") and stripped.endswith("}}") and stripped.count("{{") == 1:
            expr = _ENV.compile_expression(stripped[2:-2].strip(), undefined_to_none=False)
    return _ENV.from_string(ast), expr, names


def referenced_names(value: Any) -> set[str]:
    """Top-level variable names a (possibly nested) template value reads."""
    found: set[str] = set()
    for text in _strings(value):
        if is_template(text):
            found |= _parse(text)[2]
    return found


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


class RenderContext(dict[str, Any]):
    """The names a template may read. ``known`` lists names that exist in the playbook
    but have no value yet (steps not run): they read as None instead of failing."""

    def __init__(self, values: Mapping[str, Any] | None = None, known: Iterable[str] = ()) -> None:
        super().__init__(values or {})
        self.known = frozenset(known)

    def for_template(self, names: Iterable[str]) -> dict[str, Any]:
        out = {}
        for n in names:
            if n in self:
                out[n] = self[n]
            elif n in self.known:
                out[n] = None
        return out


def render(value: Any, ctx: Mapping[str, Any]) -> Any:
    """Render every template string inside ``value`` (dicts and lists recursively)."""
    if isinstance(value, str):
        return render_str(value, ctx) if is_template(value) else value
    if isinstance(value, Mapping):
        return {k: render(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, ctx) for v in value]
    return value


def render_str(source: str, ctx: Mapping[str, Any]) -> Any:
    template, expr, names = _parse(source)
    scope = ctx.for_template(names) if isinstance(ctx, RenderContext) else {n: ctx[n] for n in names if n in ctx}
    try:
        if expr is not None:
            return _plain(expr(**scope))
        assert template is not None
        return template.render(**scope)
    except jinja2.UndefinedError as exc:
        raise TemplateError(source, f"undefined: {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise TemplateError(source, str(exc)) from exc
    except TemplateError:
        raise
    except Exception as exc:
        raise TemplateError(source, f"{type(exc).__name__}: {exc}") from exc


def render_text(source: str, ctx: Mapping[str, Any]) -> str:
    """Render to a string always (SQL, URLs, code): native values are stringified."""
    if not is_template(source):
        return source
    template, _expr, names = _parse(source)
    scope = ctx.for_template(names) if isinstance(ctx, RenderContext) else {n: ctx[n] for n in names if n in ctx}
    try:
        assert template is not None
        return template.render(**scope)
    except jinja2.UndefinedError as exc:
        raise TemplateError(source, f"undefined: {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise TemplateError(source, str(exc)) from exc


def truthy(value: Any) -> bool:
    """How a rendered ``when`` decides: strings 'false', 'none', '0', '' are false."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "none", "null", "0", "no")
    return bool(value)


def evaluate_when(source: Any, ctx: Mapping[str, Any]) -> bool:
    """A missing ``when`` is true; otherwise the rendered value's truthiness."""
    if source is None:
        return True
    if isinstance(source, bool):
        return source
    return truthy(render(source, ctx))


def _plain(value: Any) -> Any:
    """A whole-value expression that is undefined renders to None when it is a missing
    attribute, and fails when it is an unknown top-level name."""
    if isinstance(value, _Undefined) and value._top():
        value._fail_with_undefined_error()
    if isinstance(value, jinja2.runtime.Undefined):
        return None
    return value


def set_path(target: dict[str, Any], path: str, value: Any) -> None:
    """``a.b.c`` -> ``target["a"]["b"]["c"] = value``, creating dicts on the way (how
    ``set: {ctx.a.b: ...}`` keys are applied, by the engine and by task policies)."""
    parts = path.split(".")
    node = target
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value
