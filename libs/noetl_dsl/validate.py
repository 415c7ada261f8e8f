"""Parse and validate playbooks. Every problem is collected with its field path
(``workflow[1].tool.command``) and reported in one :class:`PlaybookInvalid`, whose
``path`` is the first problem's path and whose message lists them all.

Also the two submit-time helpers the api needs: :func:`merged_workload` and
:func:`static_auth_refs`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from noetl_common.config import LimitSettings
from noetl_common.errors import PlaybookInvalid
from noetl_common.limits import check, check_depth, defaults, env_name

from .checks import (
    TOOL_KINDS,
    Problems,
    add_pydantic_errors,
    check_step,
    check_templates,
    check_tool,
    validate_part,
)
from .credrefs import check_keychain, playbook_refs, static_name
from .model import Playbook, Step, workbook_entry_task
from .placement import check_placement
from .yamlload import load_yaml

__all__ = ["TOOL_KINDS", "load_playbook", "load_yaml", "merged_workload", "parse_playbook", "static_auth_refs"]

def parse_playbook(text: str, *, supported_kinds: frozenset[str] | None = None,
                   limits: LimitSettings | None = None) -> Playbook:
    """Parse YAML text into a validated :class:`Playbook`; PlaybookInvalid otherwise
    (a ``PlaybookLimitExceeded`` when it is beyond ``limits``, the defaults when None:
    size, YAML nodes after alias expansion, nesting depth, steps)."""
    limits = limits or defaults()
    try:
        try:
            doc = load_yaml(text, limits)
        except yaml.MarkedYAMLError as exc:
            raise PlaybookInvalid("", f"malformed YAML: {_yaml_problem(exc)}") from exc
        except yaml.YAMLError as exc:
            raise PlaybookInvalid("", f"malformed YAML: {exc}") from exc
        return load_playbook(doc, supported_kinds=supported_kinds, limits=limits)
    except RecursionError as exc:
        raise _too_deep(limits) from exc


_TASK_KEYS = frozenset({"type", "kind", "command", "query", "code", "url", "endpoint", "task"})


def _with_default_tool(item: Any) -> Any:
    """A step written with neither ``tool`` nor ``loop`` (upstream's plain ``- step: end``,
    routing only) runs the ``noop`` tool, as upstream runs it: nothing, then its ``next``.
    A step holding a task's own keys (``type``, ``kind``, ``command``, ...: a task written
    on the step, or the noetl.io/v1 step form) is not one: it is refused naming them."""
    if (isinstance(item, dict) and "step" in item and "tool" not in item and "loop" not in item
            and not _TASK_KEYS.intersection(item)):
        return {**item, "tool": {"kind": "noop"}}
    return item


def _too_deep(limits: LimitSettings) -> PlaybookInvalid:
    return PlaybookInvalid("", "playbook nests too deeply to be parsed (Python's recursion limit was reached within"
                               f" {env_name('nesting_depth')}={limits.nesting_depth}: lower it)")


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """``context (line, column): problem (line, column)``, each part when PyYAML gave it."""
    parts = [f"{text}{_at(mark)}" for text, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark))
             if text]
    return ": ".join(parts) or f"cannot parse{_at(exc.problem_mark or exc.context_mark)}"


def _at(mark: Any) -> str:
    return "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"


def load_playbook(doc: Any, *, supported_kinds: frozenset[str] | None = None,
                  limits: LimitSettings | None = None) -> Playbook:
    """Validate an already-parsed document (a mapping) into a :class:`Playbook`, within
    ``limits`` (nesting depth, steps; the defaults when None)."""
    if not isinstance(doc, dict):
        got = "an empty document" if doc is None else type(doc).__name__
        raise PlaybookInvalid("", f"a playbook must be a mapping (got {got})")
    limits = limits or defaults()
    check_depth(doc, limits, what="playbook", path="")
    workflow = doc.get("workflow")
    if isinstance(workflow, list):
        check(len(workflow), "playbook_steps", limits, "workflow", unit="steps", path="workflow")
        workflow = [_with_default_tool(item) for item in workflow]
        doc = {**doc, "workflow": workflow}
    try:
        problems = Problems()
        _check_header(doc, problems)
        for path, message in check_keychain(doc.get("keychain")):
            problems.add(path, message)
        workbook_names = _check_workbook(doc.get("workbook"), problems, supported_kinds)
        _check_workflow(workflow, problems, workbook_names, supported_kinds)
        check_placement(doc, problems.add)
        problems.raise_if_any()
        try:
            return Playbook.model_validate({**doc, "raw": doc})
        except ValidationError as exc:  # every rule above should have caught it first
            add_pydantic_errors(problems, "", exc)
            problems.raise_if_any()
            raise  # pragma: no cover
    except RecursionError as exc:
        raise _too_deep(limits) from exc


def _check_header(doc: dict[str, Any], problems: Problems) -> None:
    api = doc.get("apiVersion")
    if api is None:
        problems.add("apiVersion", "apiVersion is required (e.g. 'noetl.io/v2')")
    elif not isinstance(api, str) or not api.startswith("noetl.io/"):
        problems.add("apiVersion", f"apiVersion must start with 'noetl.io/' (got {api!r})")
    elif api == "noetl.io/v1":
        problems.add("apiVersion", "apiVersion 'noetl.io/v1' (the first DSL: `type:` steps, `iterator` "
                                   "steps with `collection`/`element`) is not supported: this runtime runs "
                                   "'noetl.io/v2' playbooks (a step's task under `tool:` with `kind:`, "
                                   "loops under `loop:`, routing in `next`)")
    kind = doc.get("kind")
    if kind is None:
        problems.add("kind", "kind is required (expected 'Playbook')")
    elif kind != "Playbook":
        problems.add("kind", f"kind must be 'Playbook' (got {kind!r})")
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        problems.add("metadata", "metadata is required and must be a mapping with a 'name'")
    else:
        name = meta.get("name")
        if not isinstance(name, str) or not name.strip():
            problems.add("metadata.name", f"playbook name is required and must be a non-empty string (got {name!r})")
        path = meta.get("path")
        if path is not None and (not isinstance(path, str) or not path.strip()):
            problems.add("metadata.path", f"path must be a non-empty string (got {path!r})")
    workload = doc.get("workload")
    if workload is not None and not isinstance(workload, dict):
        problems.add("workload", f"workload must be a mapping (got {type(workload).__name__})")


def _check_workbook(workbook: Any, problems: Problems, supported: frozenset[str] | None) -> set[str]:
    """Check the workbook entries; return the names they define."""
    names: dict[str, int] = {}
    if workbook is None:
        return set()
    if not isinstance(workbook, list):
        problems.add("workbook", f"workbook must be a list of named tasks (got {type(workbook).__name__})")
        return set()
    for i, entry in enumerate(workbook):
        base = f"workbook[{i}]"
        if not isinstance(entry, dict):
            problems.add(base, f"workbook entry must be a mapping (got {type(entry).__name__})")
            continue
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            problems.add(f"{base}.name", f"workbook entry name is required (got {name!r})")
        elif name in names:
            problems.add(f"{base}.name", f"duplicate workbook entry '{name}' (also workbook[{names[name]}])")
        else:
            names[name] = i
    wb_names = set(names)
    for i, entry in enumerate(workbook):
        if not isinstance(entry, dict):
            continue
        base = f"workbook[{i}]"
        label = f"workbook entry '{entry.get('name')}'"
        task = workbook_entry_task(entry)
        if task is None:
            problems.add(f"{base}.tool", f"tool is required ({label})")
        else:
            where = f"{base}.tool" if "tool" in entry else base
            check_tool(task, where, label, problems, wb_names, supported)
        check_templates(entry, base, problems)
    return wb_names


def _check_workflow(workflow: Any, problems: Problems, wb_names: set[str],
                    supported: frozenset[str] | None) -> None:
    if not isinstance(workflow, list) or not workflow:
        if workflow is None:
            got = "it is missing"
        elif isinstance(workflow, list):
            got = "it is empty"
        else:
            got = f"got {type(workflow).__name__}"
        problems.add("workflow", f"workflow must be a non-empty list of steps ({got})")
        return
    names: dict[str, int] = {}
    for i, item in enumerate(workflow):
        if isinstance(item, dict) and isinstance(item.get("step"), str) and item["step"].strip():
            names.setdefault(item["step"], i)
    step_names = set(names)
    for i, item in enumerate(workflow):
        base = f"workflow[{i}]"
        if not isinstance(item, dict):
            problems.add(base, f"step must be a mapping (got {type(item).__name__})")
            continue
        name = item.get("step")
        typed = Problems()
        validate_part(Step, item, base, typed)
        if name is None or (isinstance(name, str) and not name.strip()):
            problems.add(f"{base}.step", "step name is required")
            typed.items = [(p, m) for p, m in typed.items if p != f"{base}.step"]
        elif isinstance(name, str) and names.get(name, i) != i:
            problems.add(f"{base}.step", f"duplicate step name '{name}' (also workflow[{names[name]}])")
        problems.items.extend(typed.items)
        check_step(item, base, problems, step_names, wb_names, supported)
        check_templates(item, base, problems)


def merged_workload(playbook: Playbook, payload: Mapping[str, Any] | None) -> dict[str, Any]:
    """The playbook's workload deep-merged with the submitted payload (payload wins;
    nested mappings merge recursively, anything else is replaced)."""
    return _deep_merge(copy.deepcopy(playbook.workload), payload or {})


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            base[key] = _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def static_auth_refs(playbook: Playbook, workload: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(field path, credential name) for every credential the playbook names whose name is
    known before the run (``credrefs``: task ``auth`` / ``credential``, cursor ``auth``,
    keychain entries; a literal, or a template that reads only workload keys)."""
    refs: list[tuple[str, str]] = []
    for ref in playbook_refs(playbook):
        name = static_name(ref.raw, workload)
        if name is not None:
            refs.append((ref.path, name))
    return refs
