"""Where a playbook names stored credentials, and which of them a step may read.

A credential is named by (``raw`` is a name or a template rendering to one):

    a task's ``auth`` or ``credential``        auth: pg_local / credential: "{{ workload.db }}"
      or, when it is a mapping, its ``credential`` / ``key`` / ``name``
                                               auth: {type: bearer, credential: api_token}
    a step's ``loop.cursor.auth``              (the same forms)
    a ``keychain`` entry (NoETL's playbook-level block), read in templates as
    ``{{ keychain.<entry>.<field> }}``:
        keychain:
          - name: api                          the alias templates read
            kind: credential                   (the default; the only kind this runtime has)
            credential: api_token              the stored credential (``auth`` is accepted too)

    or an alias map of them (the duckdb tool: a DuckDB secret per alias)
                                               auth: {pg_db: {credential: pg_local}}

A mapping ``auth`` that holds connection fields itself (``dsn``, ``host``: an inline
postgres connection) names no stored credential.

A reference is *static* when its name is known before the run: a literal, or a template
that reads only workload keys (rendered with the execution's workload). Otherwise it is
*dynamic* (it reads a loop item, a step result, ``ctx``...). What a step may read
(:func:`step_grant`, enforced by the api when a worker asks for a credential):

    every credential its own static references name (tasks of the step, the workbook
    tasks it calls, its cursor, the keychain entries its templates read), and, when one
    of them is dynamic, any credential the playbook names statically anywhere.

So a credential chosen at run time must still be named in the playbook, e.g. as a
keychain entry. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import templates
from .model import Playbook, workbook_entry_task

CREDENTIAL_FIELDS = ("auth", "credential")
REF_KEYS = ("credential", "key", "name")
INLINE_CONNECTION_KEYS = ("dsn", "host", "conninfo", "url")
KEYCHAIN = "keychain"
KEYCHAIN_KINDS = frozenset({"credential"})
CODE_FIELDS = frozenset({"code_b64", "code_base64"})  # base64 python code: never rendered (`code` is)


@dataclass(frozen=True, slots=True)
class CredentialRef:
    """One place a playbook names a stored credential."""

    path: str  # field path, e.g. ``workflow[0].tool.auth``, ``keychain[1].credential``
    raw: str  # the name, or a template rendering to it


@dataclass(frozen=True, slots=True)
class Grant:
    """What the commands of one step may read (module docstring)."""

    names: frozenset[str]
    dynamic: bool  # some reference of the step is chosen at run time

    def allows(self, name: str, playbook_names: frozenset[str]) -> bool:
        return name in self.names or (self.dynamic and name in playbook_names)


def reference_of(value: Any) -> str | None:
    """The credential a field's value names (a name/template, or a mapping naming one);
    None for an inline connection or anything else."""
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, Mapping):
        if any(value.get(k) for k in INLINE_CONNECTION_KEYS):
            return None
        for key in REF_KEYS:
            ref = value.get(key)
            if isinstance(ref, str) and ref.strip():
                return ref
    return None


def _ref_path(value: Any, path: str) -> str:
    if isinstance(value, Mapping):
        for key in REF_KEYS:
            if isinstance(value.get(key), str) and value[key].strip():
                return f"{path}.{key}"
    return path


def alias_refs(value: Any, path: str, *, names: bool = False) -> list[CredentialRef]:
    """The credentials of an alias map ``{alias: {credential: name}}`` (the duckdb tool's
    several credentials; with ``names``, ``{alias: name}`` too). Empty for anything else."""
    if not isinstance(value, Mapping) or reference_of(value) is not None:
        return []
    refs = []
    for alias, item in value.items():
        raw = reference_of(item) if isinstance(item, Mapping) else item if names and isinstance(item, str) else None
        if raw is not None and raw.strip():
            refs.append(CredentialRef(_ref_path(item, f"{path}.{alias}"), raw))
    return refs


def task_refs(task: Mapping[str, Any], path: str) -> list[CredentialRef]:
    """The credentials one task names through ``auth`` / ``credential`` (a name, a mapping
    naming one, or an alias map: :func:`alias_refs`)."""
    refs = []
    for field in CREDENTIAL_FIELDS:
        if field in task:
            raw = reference_of(task[field])
            if raw is not None:
                refs.append(CredentialRef(_ref_path(task[field], f"{path}.{field}"), raw))
            else:
                refs.extend(alias_refs(task[field], f"{path}.{field}", names=task.get("kind") == "duckdb"))
    if task.get("kind") == "duckdb" and "credentials" in task:  # upstream's older spelling of an alias map
        refs.extend(alias_refs(task["credentials"], f"{path}.credentials", names=True))
    return refs


def keychain_entries(playbook: Playbook) -> dict[str, tuple[int, dict[str, Any]]]:
    """Alias -> (index, entry) of the playbook's keychain block (entries already validated)."""
    block = playbook.raw.get(KEYCHAIN) or []
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, entry in enumerate(block if isinstance(block, list) else []):
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            out.setdefault(entry["name"], (i, entry))
    return out


def keychain_ref(index: int, entry: Mapping[str, Any]) -> CredentialRef | None:
    for field in ("credential", "auth"):
        raw = reference_of(entry.get(field))
        if raw is not None:
            return CredentialRef(_ref_path(entry[field], f"keychain[{index}].{field}"), raw)
    return None


def check_keychain(block: Any) -> list[tuple[str, str]]:
    """(path, problem) for a keychain block this runtime cannot use."""
    if block is None:
        return []
    if not isinstance(block, list):
        return [(KEYCHAIN, f"keychain must be a list of entries (got {type(block).__name__})")]
    problems: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(block):
        base = f"keychain[{i}]"
        if not isinstance(entry, dict):
            problems.append((base, f"keychain entry must be a mapping (got {type(entry).__name__})"))
            continue
        name = entry.get("name")
        if not isinstance(name, str) or not name.isidentifier():
            problems.append((f"{base}.name", f"keychain entry name must be an identifier (got {name!r})"))
        elif name in seen:
            problems.append((f"{base}.name", f"duplicate keychain entry '{name}' (also keychain[{seen[name]}])"))
        else:
            seen[name] = i
        kind = entry.get("kind", "credential")
        if kind not in KEYCHAIN_KINDS:
            problems.append((f"{base}.kind", f"keychain kind {kind!r} is not supported by this runtime (supported:"
                                             " credential: a stored credential by name)"))
        elif keychain_ref(i, entry) is None:
            problems.append((f"{base}.credential", "a keychain entry of kind credential needs `credential`"
                                                   " (the name of a stored credential)"))
        else:
            for field in ("credential", "auth"):
                raw = reference_of(entry.get(field))
                if raw is not None and templates.is_template(raw):
                    try:
                        templates.check_syntax(raw)
                    except templates.TemplateError as exc:
                        problems.append((f"{base}.{field}", str(exc)))
    return problems


def _tool_tasks(tool: Any, path: str) -> Iterable[tuple[str, dict[str, Any]]]:
    if isinstance(tool, dict):
        yield path, tool
    elif isinstance(tool, list):
        for j, task in enumerate(tool):
            yield from _tool_tasks(task, f"{path}[{j}]")


def _workbook_tasks(playbook: Playbook) -> dict[str, tuple[str, dict[str, Any]]]:
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for i, entry in enumerate(playbook.workbook):
        task = workbook_entry_task(entry) if isinstance(entry, dict) else None
        if task is not None and isinstance(entry.get("name"), str):
            out[entry["name"]] = (f"workbook[{i}].tool" if "tool" in entry else f"workbook[{i}]", task)
    return out


def _step_tasks(playbook: Playbook, step_name: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, task) of the step's tasks and of the workbook tasks they call (directly or
    through other workbook tasks; a templated workbook name may call any of them)."""
    step = playbook.step(step_name)
    base = f"workflow[{playbook.step_index(step_name)}]"
    tasks = list(_tool_tasks(step.raw_tool, f"{base}.tool"))
    workbook = _workbook_tasks(playbook)
    seen: set[str] = set()
    queue = [task for _, task in tasks]
    while queue:
        task = queue.pop()
        if task.get("kind") != "workbook":
            continue
        name = task.get("name")
        called = list(workbook) if not isinstance(name, str) or templates.is_template(name) else [name]
        for wb in called:
            if wb in workbook and wb not in seen:
                seen.add(wb)
                tasks.append(workbook[wb])
                queue.append(workbook[wb][1])
    return tasks


def step_refs(playbook: Playbook, step_name: str) -> list[CredentialRef]:
    """Every credential reference the commands of ``step_name`` may use."""
    if not playbook.has_step(step_name):
        return []
    step = playbook.step(step_name)
    tasks = _step_tasks(playbook, step_name)
    refs = [ref for path, task in tasks for ref in task_refs(task, path)]
    cursor = step.loop.cursor if step.loop is not None else None
    if isinstance(cursor, Mapping) and "auth" in cursor:
        raw = reference_of(cursor["auth"])
        if raw is not None:
            base = f"workflow[{playbook.step_index(step_name)}]"
            refs.append(CredentialRef(_ref_path(cursor["auth"], f"{base}.loop.cursor.auth"), raw))
    if isinstance(cursor, Mapping) and "auth" not in cursor:  # `credential:` is accepted where `auth:` is
        cred = reference_of(cursor.get("credential"))
        if cred is not None:
            where = f"workflow[{playbook.step_names.index(step_name)}].loop.cursor.credential"
            refs.append(CredentialRef(_ref_path(cursor["credential"], where), cred))
    reads = keychain_reads(playbook, step_name)
    for alias, (i, entry) in keychain_entries(playbook).items():
        if reads is None or alias in reads:
            ref = keychain_ref(i, entry)
            if ref is not None:
                refs.append(ref)
    return refs


def keychain_reads(playbook: Playbook, step_name: str) -> set[str] | None:
    """The keychain aliases the templates of a step read (its tool, its input and the
    workbook tasks it calls); None when a template reads ``keychain`` dynamically (then:
    any of them)."""
    step = playbook.step(step_name)
    values = [step.input or {}, [{k: v for k, v in task.items() if k not in CODE_FIELDS}
                                 for _, task in _step_tasks(playbook, step_name)]]
    return templates.attribute_reads(values, KEYCHAIN)


def playbook_refs(playbook: Playbook) -> list[CredentialRef]:
    """Every credential reference anywhere in the playbook (each once)."""
    refs: dict[tuple[str, str], CredentialRef] = {}
    for name in playbook.step_names:
        for ref in step_refs(playbook, name):
            refs.setdefault((ref.path, ref.raw), ref)
    for path, task in _workbook_tasks(playbook).values():
        for ref in task_refs(task, path):
            refs.setdefault((ref.path, ref.raw), ref)
    for i, entry in keychain_entries(playbook).values():
        kc = keychain_ref(i, entry)
        if kc is not None:
            refs.setdefault((kc.path, kc.raw), kc)
    return list(refs.values())


def static_name(raw: str, workload: Mapping[str, Any]) -> str | None:
    """The name a reference gives before the run (a literal, or a template reading only
    workload keys, rendered with ``workload``); None when it is chosen at run time."""
    if not templates.is_template(raw):
        return raw.strip() or None
    scope = templates.RenderContext({**workload, "workload": dict(workload)})
    try:
        if not templates.referenced_names(raw) <= set(scope):
            return None
        value = templates.render_str(raw, scope)
    except templates.TemplateError:
        return None
    if isinstance(value, Mapping):
        value = reference_of(value)
    return value.strip() if isinstance(value, str) and value.strip() else None


def step_grant(playbook: Playbook, step_name: str, workload: Mapping[str, Any]) -> Grant:
    names: set[str] = set()
    dynamic = False
    for ref in step_refs(playbook, step_name):
        name = static_name(ref.raw, workload)
        if name is None:
            dynamic = True
        else:
            names.add(name)
    return Grant(frozenset(names), dynamic)


def playbook_names(playbook: Playbook, workload: Mapping[str, Any]) -> frozenset[str]:
    """Every credential the playbook names statically (module docstring)."""
    return frozenset(n for ref in playbook_refs(playbook) if (n := static_name(ref.raw, workload)) is not None)


__all__ = ["CREDENTIAL_FIELDS", "KEYCHAIN", "KEYCHAIN_KINDS", "CredentialRef", "Grant", "alias_refs", "check_keychain",
           "keychain_entries", "keychain_reads", "keychain_ref", "playbook_names", "playbook_refs",
           "reference_of", "static_name", "step_grant", "step_refs", "task_refs"]
