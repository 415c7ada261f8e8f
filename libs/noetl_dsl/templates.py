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
* Compiled templates are cached (bounded LRU); checking a template's syntax or the
  names it reads parses it without compiling it.
* Operations that could explode are bounded (``sandbox.py``) by the limits given to
  :func:`configure` (each role calls it once at start; the defaults otherwise): a
  refused one is a TemplateError naming the setting, its value and what was asked.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.utils import missing

from noetl_common.config import LimitSettings
from noetl_common.errors import NoetlError
from noetl_common.limits import LimitExceeded

from . import sizes
from .sandbox import BoundedSandbox, bounded_fromjson, bounded_tojson

_MARKERS = ("{{", "{%", "{#")


class TemplateError(NoetlError):
    """A template failed to render. ``template`` is its source text; ``limit`` the
    broken limit when one refused it."""

    def __init__(self, template: str, message: str, limit: LimitExceeded | None = None) -> None:
        self.template = template
        self.message = message
        self.limit = limit
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


class _Env(BoundedSandbox):
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
    env.filters["tojson"] = bounded_tojson
    env.filters["to_json"] = bounded_tojson
    env.filters["fromjson"] = bounded_fromjson
    env.filters["from_json"] = bounded_fromjson
    env.globals["now"] = _now
    return env


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat()


_ENV = _make_env()


def configure(limits: LimitSettings | None = None) -> None:
    """Set the limits every later render of this process checks (``NOETL_LIMIT_TEMPLATE_*``
    and ``nesting_depth`` for ``fromjson``; None: the defaults). Called once at a role's
    start, before it renders anything."""
    sizes.configure(limits)


def is_template(value: Any) -> bool:
    return isinstance(value, str) and any(m in value for m in _MARKERS)


# Nodes whose compilation can fail on a template that parses (an unknown filter or
# test, a macro's ``caller`` argument, assigning to ``loop``).
_COMPILE_CHECKED = (nodes.Filter, nodes.Test, nodes.Macro, nodes.CallBlock, nodes.For)


@lru_cache(maxsize=4096)
def _syntax(source: str) -> tuple[frozenset[str], bool, bool]:
    """(undeclared names, whether the source is exactly one ``{{ expression }}``,
    whether compiling it can still fail), from parsing alone; TemplateError when it
    does not parse."""
    try:
        ast = _ENV.parse(source)
        names = frozenset(meta.find_undeclared_variables(ast))
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(source, f"syntax error: {exc.message} (line {exc.lineno})") from exc
    except RecursionError as exc:
        raise TemplateError(source, "syntax error: the template nests too deeply to be parsed") from exc
    except Exception as exc:  # e.g. an integer literal beyond Python's digit limit
        raise TemplateError(source, f"syntax error: {type(exc).__name__}: {exc}") from exc
    body = ast.body
    single = len(body) == 1 and isinstance(body[0], nodes.Output) and len(body[0].nodes) == 1 \
        and not isinstance(body[0].nodes[0], nodes.TemplateData)
    stripped = source.strip()
    single = single and stripped.startswith("{{") and stripped.endswith("}}") and stripped.count("{{") == 1
    return names, single, next(ast.find_all(_COMPILE_CHECKED), None) is not None


def check_syntax(source: str) -> None:
    """TemplateError when ``source`` is not a valid template. Compiles it only when
    that can still fail (parsing is ~10x cheaper than compiling)."""
    if _syntax(source)[2]:
        _parse(source)


@lru_cache(maxsize=4096)
def _parse(source: str) -> tuple[jinja2.Template | None, Any, frozenset[str]]:
    """(full template, compiled single expression or None, undeclared names)."""
    names, single, _ = _syntax(source)
    try:
        expr = None
        if single:
            expr = _ENV.compile_expression(source.strip()[2:-2].strip(), undefined_to_none=False)
        return _ENV.from_string(source), expr, names
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(source, f"syntax error: {exc.message} (line {exc.lineno})") from exc
    except (RecursionError, MemoryError, SyntaxError) as exc:
        raise TemplateError(source, f"cannot compile: {type(exc).__name__}: {exc}") from exc


def referenced_names(value: Any) -> set[str]:
    """Top-level variable names a (possibly nested) template value reads."""
    found: set[str] = set()
    for text in _strings(value):
        if is_template(text):
            found |= _syntax(text)[0]
    return found


def attribute_reads(value: Any, root: str) -> set[str] | None:
    """The attributes a (possibly nested) template value reads of the top-level name
    ``root`` (``root.x`` and ``root['x']``), or None when some template uses ``root`` any
    other way (``root[var]``, ``root`` passed whole): then any attribute may be read.
    Templates that do not parse read nothing (rendering reports them)."""
    found: set[str] = set()
    for text in _strings(value):
        if not is_template(text) or root not in text:
            continue
        reads = _text_attribute_reads(text, root)
        if reads is None:
            return None
        found |= reads
    return found


@lru_cache(maxsize=4096)
def _text_attribute_reads(text: str, root: str) -> frozenset[str] | None:
    try:
        if root not in _syntax(text)[0]:
            return frozenset()
        ast = _ENV.parse(text)
    except (TemplateError, jinja2.TemplateSyntaxError, RecursionError):
        return frozenset()
    reads = _attribute_reads(ast, root)
    return None if reads is None else frozenset(reads)


def _attribute_reads(ast: nodes.Node, root: str) -> set[str] | None:
    wrapped: set[int] = set()
    found: set[str] = set()
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        inner = getattr(node, "node", None)
        if isinstance(inner, nodes.Name) and inner.name == root and inner.ctx == "load":
            arg = getattr(node, "arg", None)
            if isinstance(node, nodes.Getattr):
                found.add(node.attr)
            elif isinstance(arg, nodes.Const) and isinstance(arg.value, str):
                found.add(arg.value)
            else:
                return None
            wrapped.add(id(inner))
    for name in ast.find_all(nodes.Name):
        if name.name == root and name.ctx == "load" and id(name) not in wrapped:
            return None
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


def add_upstream_names(data: dict[str, Any], workload: Mapping[str, Any], execution_id: Any) -> None:
    """Names upstream NoETL's render contexts define besides the workload: ``vars`` (the
    workload) and ``job`` (``{uuid, execution_id, id}``: the execution id), unless a
    workload key or a step already has the name."""
    data.setdefault("vars", dict(workload))
    data.setdefault("job", {"uuid": execution_id, "execution_id": execution_id, "id": execution_id})


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
    guard = sizes.Guard(sizes.configured())
    token = sizes.activate(guard)
    try:
        if expr is not None:
            return _plain(expr(**scope))
        assert template is not None
        return _generate(template, scope, guard)
    except jinja2.UndefinedError as exc:
        raise TemplateError(source, f"undefined: {exc.message}") from exc
    except sizes.Refused as exc:
        raise TemplateError(source, str(exc), exc.error) from exc
    except jinja2.TemplateError as exc:
        raise TemplateError(source, str(exc)) from exc
    except TemplateError:
        raise
    except Exception as exc:
        raise TemplateError(source, f"{type(exc).__name__}: {exc}") from exc
    finally:
        sizes.deactivate(token)


def render_text(source: str, ctx: Mapping[str, Any]) -> str:
    """Render to a string always (SQL, URLs, code): native values are stringified."""
    if not is_template(source):
        return source
    template, _expr, names = _parse(source)
    scope = ctx.for_template(names) if isinstance(ctx, RenderContext) else {n: ctx[n] for n in names if n in ctx}
    guard = sizes.Guard(sizes.configured())
    token = sizes.activate(guard)
    try:
        assert template is not None
        return _generate(template, scope, guard)
    except jinja2.UndefinedError as exc:
        raise TemplateError(source, f"undefined: {exc.message}") from exc
    except sizes.Refused as exc:
        raise TemplateError(source, str(exc), exc.error) from exc
    except jinja2.TemplateError as exc:
        raise TemplateError(source, str(exc)) from exc
    except Exception as exc:
        raise TemplateError(source, f"{type(exc).__name__}: {exc}") from exc
    finally:
        sizes.deactivate(token)


def _generate(template: jinja2.Template, scope: dict[str, Any], guard: sizes.Guard) -> str:
    """The template's text (``Template.render``), refused as soon as it grows beyond
    the value limit."""
    parts: list[str] = []
    size = 0
    limit = guard.value_size
    try:
        chunks = template.root_render_func(template.new_context(scope))
        # Counted a few chunks at a time (per chunk costs ~10% of a render): each chunk
        # was already checked and charged when it was made.
        while batch := list(itertools.islice(chunks, 32)):
            size += sum(map(len, batch))
            if size > limit:
                raise guard.refuse("template output", size, "template_value_size", unit="characters", at_least=True)
            parts.extend(batch)
    except sizes.Refused:
        raise
    except Exception:
        template.environment.handle_exception()  # re-raises with the template's lines in the traceback
    return "".join(parts)


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
