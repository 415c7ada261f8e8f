"""Checks that can be made at submit time, before anything is written.

* Every credential a task names statically (literal, or rendered from the workload
  alone) must exist.
* Every sub-playbook a task names by a literal ``path`` must be in the catalog
  (``playbook_refs``; the lookup is the submitter's).
* Every name a task's input (or other rendered field) reads must be something that
  can exist at run time: a workload key, a step, a task of the same pipeline, a
  variable a policy or ``set`` of the same pipeline defines, a loop iterator, or one
  of the runtime's own names. Anything else is a typo that would fail the step later.
* The same for what the engine renders when a step is done: the step's ``set`` and its
  arcs' ``when`` / ``set`` may read workload keys, steps and the engine's names
  (``STEP_NAMES``: ``ctx``, ``workload``, ``execution_id``, ``event``, ``output``, the
  step's own result, ``result`` (its data) and upstream's ``vars`` / ``job``), so a playbook never fails at its last step, after an hour of
  work, on a name nothing defines.

The names listed here are the ones the runtime defines (``TASK_NAMES``: the worker's
render scope and its pipelines; ``STEP_NAMES``: the engine's routing scope); a unit
test checks both against the scopes themselves.
"""

from __future__ import annotations

from typing import Any

from noetl_common.errors import PlaybookInvalid
from noetl_dsl import Playbook, referenced_names, static_auth_refs
from noetl_dsl.model import workbook_entry_task
from noetl_dsl.templates import _ENV, is_template

# What a task's fields may read besides workload keys, steps, tasks and set variables:
# the worker's scope (``noetl_worker.scope``, ``pipeline``) and the keychain.
TASK_NAMES = frozenset({
    "ctx", "workload", "execution_id", "event", "iter", "_prev", "_task", "_attempt", "loop_index",
    "keychain", "vars", "job",
}) | frozenset(_ENV.globals)
# A task's own `set` also reads `output` (its raw result); its policy rules read the
# envelope as `output` (rules are not checked here: see UNRENDERED).
TASK_SET_NAMES = TASK_NAMES | {"output"}
# What a step's `set` and its arcs' `when` / `set` may read besides workload keys and
# steps: the engine's routing scope (``noetl_flow.router``).
STEP_NAMES = frozenset({"ctx", "workload", "execution_id", "event", "output", "result", "vars", "job"}) \
    | frozenset(_ENV.globals)

# Fields of a task that are not rendered by the runtime (base64 code is data, policy rules
# are evaluated with `output` in scope and checked the same way). Python `code` is rendered
# when it holds a template (as upstream renders the whole tool config), so it is checked.
UNRENDERED = frozenset({"code_b64", "code_base64", "kind", "name", "libs"})


def defined_names(playbook: Playbook, workload: dict[str, Any]) -> set[str]:
    names = set(workload) | set(playbook.step_names) | TASK_NAMES
    for step in playbook.workflow:
        if step.loop is not None and step.loop.iterator:
            names.add(step.loop.iterator)
        for task in step.tasks:
            if task.name is not None:
                names.add(task.name)
            names |= _set_keys(task.raw)
    return names


def _set_keys(task: dict[str, Any]) -> set[str]:
    keys: set[str] = set()
    for source in [task.get("set") or {}]:
        keys |= {k.split(".", 1)[0] for k in source if isinstance(k, str)}
    rules = ((task.get("spec") or {}).get("policy") or {}).get("rules") or []
    for rule in rules if isinstance(rules, list) else []:
        if not isinstance(rule, dict):
            continue
        then = rule.get("then") or (rule.get("else") or {}).get("then") or {}
        keys |= {k.split(".", 1)[0] for k in (then.get("set") or {}) if isinstance(k, str)}
    return keys


def playbook_refs(playbook: Playbook) -> list[tuple[str, str, int]]:
    """(field path, catalog path, version) of every sub-playbook task (``kind: playbook``,
    in steps and the workbook) whose ``path`` is a literal; templated paths are checked
    when they run."""
    refs: list[tuple[str, str, int]] = []
    for where, task in _tasks(playbook):
        path = task.get("path")
        if task.get("kind") != "playbook" or not isinstance(path, str) or not path.strip() or is_template(path):
            continue
        version = task.get("version")
        refs.append((f"{where}.path", path.strip(), version if isinstance(version, int) else 0))
    return refs


def _tasks(playbook: Playbook) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i, step in enumerate(playbook.workflow):
        raw = step.raw_tool
        if isinstance(raw, list):
            out += [(f"workflow[{i}].tool[{j}]", t) for j, t in enumerate(raw) if isinstance(t, dict)]
        elif isinstance(raw, dict):
            out.append((f"workflow[{i}].tool", raw))
    for i, entry in enumerate(playbook.workbook):
        task = workbook_entry_task(entry) if isinstance(entry, dict) else None
        if task is not None:
            out.append((f"workbook[{i}].tool" if "tool" in entry else f"workbook[{i}]", task))
    return out


def check_templates(playbook: Playbook, workload: dict[str, Any]) -> None:
    allowed = defined_names(playbook, workload)
    with_output = allowed | TASK_SET_NAMES
    routing = set(workload) | set(playbook.step_names) | STEP_NAMES
    problems: list[tuple[str, str]] = []
    for i, step in enumerate(playbook.workflow):
        base = f"workflow[{i}]"
        if step.input:
            _check(f"{base}.input", step.input, allowed, problems)
        raw = step.raw_tool
        tasks = raw if isinstance(raw, list) else [raw]
        for j, task in enumerate(tasks):
            if not isinstance(task, dict):
                continue
            where = f"{base}.tool[{j}]" if isinstance(raw, list) else f"{base}.tool"
            fields = {k: v for k, v in task.items() if k not in UNRENDERED and k not in ("spec", "set")}
            _check(where, fields, allowed, problems)
            if isinstance(task.get("set"), dict):
                _check(f"{where}.set", task["set"], with_output, problems)
        _check_routing(base, step, routing, problems)
    if problems:
        path, _ = problems[0]
        raise PlaybookInvalid(path, "; ".join(f"{p}: {m}" for p, m in problems))


def _check_routing(base: str, step: Any, allowed: set[str], problems: list[tuple[str, str]]) -> None:
    """A step's own ``set`` and its arcs' ``when`` / ``set`` (rendered by the engine)."""
    if step.set:
        _check(f"{base}.set", step.set, allowed, problems)
    for k, arc in enumerate(step.arcs):
        if arc.when is not None:
            _check(f"{base}.next.arcs[{k}].when", arc.when, allowed, problems)
        if arc.set:
            _check(f"{base}.next.arcs[{k}].set", arc.set, allowed, problems)


def _check(path: str, value: Any, allowed: set[str], problems: list[tuple[str, str]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _check(f"{path}.{k}", v, allowed, problems)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check(f"{path}[{i}]", v, allowed, problems)
    elif isinstance(value, str):
        unknown = sorted(referenced_names(value) - allowed)
        if unknown:
            problems.append((path, f"template {value.strip()!r} reads undefined variable(s) {', '.join(unknown)}"))


def credential_refs(playbook: Playbook, workload: dict[str, Any]) -> list[tuple[str, str]]:
    return static_auth_refs(playbook, workload)
