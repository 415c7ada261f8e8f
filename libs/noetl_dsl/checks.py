"""The validation rules for one step, one tool and one template tree. Each rule adds
``(field path, message)`` problems to a :class:`Problems`; nothing here raises except
:meth:`Problems.raise_if_any`. Rules read the raw mappings defensively, so a type error
that pydantic reports does not also crash or repeat here.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError

from noetl_common.errors import PlaybookInvalid

from . import templates
from .model import Task, normalise_next

TOOL_KINDS: frozenset[str] = frozenset({"python", "http", "postgres", "duckdb", "noop", "workbook", "playbook"})

# Upstream NoETL tool kinds this runtime does not run, and what to use instead
# (docs/CONFORMANCE.md "Tool kinds"): named in the refusal.
NOT_BUILT: dict[str, str] = {
    "secrets": "read a stored credential where it is used: `auth`/`credential` on the task, or a keychain entry",
    "shell": "a python task can run the command (subprocess) in its sandbox",
    "rhai": "use a python task",
}
_PYTHON_CODE_KEYS = ("code", "code_b64", "code_base64", "script")
_SQL_KEYS = ("command", "query")
# what else gives a task its SQL: `script:` (any kind), duckdb's `commands` (text or list) / `sql`
_SQL_SOURCES = {"postgres": ("script",), "duckdb": ("script", "commands", "sql")}
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


class Problems:
    """Collected ``(path, message)`` pairs, in the order they were found."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if not self.items:
            return
        listed = "; ".join(f"{p}: {m}" if p else m for p, m in self.items)
        raise PlaybookInvalid(self.items[0][0], listed)


def join_path(path: str, part: str | int) -> str:
    """``workflow`` + 1 -> ``workflow[1]``; + ``tool`` -> ``.tool``; + ``ctx.x`` -> ``["ctx.x"]``."""
    if isinstance(part, int):
        return f"{path}[{part}]"
    if _PLAIN_KEY.match(part):
        return f"{path}.{part}" if path else part
    return f'{path}["{part}"]'


def add_pydantic_errors(problems: Problems, prefix: str, exc: ValidationError) -> None:
    """Translate pydantic's errors (loc tuples) into field-path problems."""
    for err in exc.errors(include_url=False):
        path = prefix
        for part in err["loc"]:
            path = join_path(path, part)
        problems.add(path, _pydantic_message(err))


def _pydantic_message(err: Any) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return "field is required"
    if kind == "literal_error":
        return f"invalid value {err['input']!r} (expected {ctx.get('expected', '')})"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return str(err["msg"])


def validate_part(model: type[BaseModel], data: Any, prefix: str, problems: Problems) -> bool:
    """Run ``model``'s type checks over ``data``; report failures under ``prefix``."""
    try:
        model.model_validate(data)
    except ValidationError as exc:
        add_pydantic_errors(problems, prefix, exc)
        return False
    return True


def check_templates(value: Any, path: str, problems: Problems) -> None:
    """Every template string under ``value`` must parse."""
    if isinstance(value, str):
        if templates.is_template(value):
            try:
                templates.check_syntax(value)
            except templates.TemplateError as exc:
                problems.add(path, f"invalid template: {exc.message}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_templates(item, join_path(path, str(key)), problems)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_templates(item, join_path(path, i), problems)


def check_step(item: dict[str, Any], base: str, problems: Problems, step_names: set[str],
               wb_names: set[str], supported: frozenset[str] | None) -> None:
    """Tool, routing and loop rules for one workflow step (its raw mapping)."""
    label = f"step '{item.get('step')}'"
    if "case" in item:
        # routing the drafts before v10 wrote as `case: [{when, then: {next, set, result}}]`;
        # ignoring it would run a different flow than the author's, so it is refused
        problems.add(f"{base}.case", f"`case:` ({label}) is the pre-v10 routing form, not supported: route with "
                                     "`next: {arcs: [{step, when, set}]}` (an arc's `when` reads the step's "
                                     "result as `output`, `event.name` is 'call.done' / 'call.error')")
    if "tool" not in item and isinstance(item.get("type"), str):
        problems.add(f"{base}.type", f"`type: {item['type']}` on {label} is the noetl.io/v1 step form: put the "
                                     f"task under `tool:` with `kind: {item['type']}`")
    else:
        check_tool(item.get("tool"), f"{base}.tool", label, problems, wb_names, supported, step=item)
    _check_next(item.get("next"), base, label, problems, step_names)
    loop = item.get("loop")
    if isinstance(loop, dict):
        _check_loop(loop, f"{base}.loop", label, problems)


def _check_next(raw: Any, base: str, label: str, problems: Problems, step_names: set[str]) -> None:
    nxt = normalise_next(raw)
    arcs = nxt.get("arcs") if isinstance(nxt, dict) else None
    if not isinstance(arcs, list):
        return
    for k, arc in enumerate(arcs):
        target = arc.get("step") if isinstance(arc, dict) else None
        if isinstance(target, str) and target and target not in step_names:
            problems.add(_arc_path(raw, base, k), f"arc targets unknown step '{target}' ({label})")


def _arc_path(raw: Any, base: str, k: int) -> str:
    """Where arc ``k`` is written, for each ``next`` form."""
    if isinstance(raw, str):
        return f"{base}.next"
    if isinstance(raw, list):
        return f"{base}.next[{k}]" if isinstance(raw[k], str) else f"{base}.next[{k}].step"
    if isinstance(raw, dict) and "arcs" not in raw:
        return f"{base}.next.step"
    return f"{base}.next.arcs[{k}].step"


def _check_loop(loop: dict[str, Any], base: str, label: str, problems: Problems) -> None:
    items = loop.get("in")
    has_cursor = loop.get("cursor") is not None
    if items is None and not has_cursor:
        problems.add(f"{base}.in", f"loop requires 'in' (a list or a template) or a 'cursor' ({label})")
    elif items is not None and not isinstance(items, list) and not templates.is_template(items):
        problems.add(f"{base}.in", f"loop 'in' must be a list or a template string, got {items!r} ({label})")
    iterator = loop.get("iterator")
    if not has_cursor and (iterator is None or (isinstance(iterator, str) and not iterator.strip())):
        problems.add(f"{base}.iterator", f"loop requires 'iterator' (the name each item is bound to) ({label})")
    spec = loop.get("spec")
    if isinstance(spec, dict) and spec.get("mode") == "cursor" and not has_cursor:
        problems.add(f"{base}.cursor", f"loop mode 'cursor' requires a 'cursor' mapping ({label})")


def check_tool(tool: Any, path: str, label: str, problems: Problems, wb_names: set[str],
               supported: frozenset[str] | None, *, step: dict[str, Any] | None = None) -> None:
    """A tool is one task mapping or a non-empty pipeline (list) of uniquely named tasks."""
    if tool is None:
        problems.add(path, f"tool is required ({label})")
    elif isinstance(tool, dict):
        _check_task(tool, path, label, problems, wb_names, supported, step)
    elif isinstance(tool, list):
        if not tool:
            problems.add(path, f"tool is required ({label}): the pipeline is empty")
        seen: dict[str, int] = {}
        for j, task in enumerate(tool):
            _check_task(task, f"{path}[{j}]", label, problems, wb_names, supported, step)
            name = (task.get("name") or f"task_{j}") if isinstance(task, dict) else None
            if not isinstance(name, str):
                continue
            if name in seen:
                problems.add(f"{path}[{j}].name",
                             f"duplicate task name '{name}' in the pipeline ({label}, also {path}[{seen[name]}])")
            else:
                seen[name] = j
    else:
        problems.add(path, f"tool must be a task mapping or a list of them ({label}, got {type(tool).__name__})")


def _check_task(task: Any, path: str, label: str, problems: Problems, wb_names: set[str],
                supported: frozenset[str] | None, step: dict[str, Any] | None) -> None:
    if not isinstance(task, dict):
        problems.add(path, f"task must be a mapping ({label}, got {type(task).__name__})")
        return
    kind = task.get("kind")
    if kind is None:
        hint = ", found 'type': the canonical key is 'kind'" if "type" in task else ""
        problems.add(f"{path}.kind", f"tool kind is required ({label}{hint})")
        return
    if not isinstance(kind, str) or kind not in TOOL_KINDS:
        hint = f" (upstream NoETL's '{kind}' is not built here: {NOT_BUILT[kind]})" \
            if isinstance(kind, str) and kind in NOT_BUILT else ""
        problems.add(f"{path}.kind",
                     f"unknown tool kind '{kind}' (expected one of: {', '.join(sorted(TOOL_KINDS))}){hint}")
        return
    if supported is not None and kind not in supported:
        problems.add(f"{path}.kind", f"tool kind '{kind}' is not supported by this runtime "
                                     f"(supported: {', '.join(sorted(supported))})")
    validate_part(Task, task, path, problems)
    _check_kind_fields(kind, task, path, label, problems, wb_names, step)


def _filled(task: dict[str, Any], keys: tuple[str, ...]) -> bool:
    return any(isinstance(task.get(k), str) and task[k].strip() for k in keys)


def _given(task: dict[str, Any], keys: tuple[str, ...]) -> bool:
    """A key holding text, a non-empty list (duckdb `commands`) or a mapping (`script:`)."""
    return _filled(task, keys) or any(isinstance(task.get(k), list | dict) and task[k] for k in keys)


def _check_kind_fields(kind: str, task: dict[str, Any], path: str, label: str, problems: Problems,
                       wb_names: set[str], step: dict[str, Any] | None) -> None:
    if kind == "python" and not _given(task, _PYTHON_CODE_KEYS):
        problems.add(f"{path}.code", f"python tool requires 'code' (or 'code_b64' / 'script') ({label})")
    elif kind in ("postgres", "duckdb") and not _given(task, _SQL_KEYS + _SQL_SOURCES[kind]):
        misplaced = [k for k in _SQL_KEYS if step is not None and k in step]
        hint = f", found '{misplaced[0]}' on the step itself: it belongs under 'tool'" if misplaced else ""
        problems.add(f"{path}.command",
                     f"{kind} tool requires 'command' or 'query': no sql command provided ({label}{hint})")
    elif kind == "http" and not _filled(task, ("url", "endpoint")):
        problems.add(f"{path}.url", f"http tool requires 'url' (or 'endpoint') ({label})")
    elif kind == "playbook" and not _filled(task, ("path",)):
        problems.add(f"{path}.path", f"playbook tool requires 'path' (the sub-playbook's catalog path) ({label})")
    elif kind == "workbook":
        name = task.get("name")
        if not isinstance(name, str) or not name.strip():
            problems.add(f"{path}.name", f"workbook tool requires 'name' (the workbook task to run) ({label})")
        elif name not in wb_names:
            known = f"workbook has: {', '.join(sorted(wb_names))}" if wb_names else "the playbook has no workbook"
            problems.add(f"{path}.name", f"unknown workbook task '{name}' ({label}, {known})")
