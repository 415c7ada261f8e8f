"""The render scope of a command (what its templates may read), built from
``Command.context_json`` and ``spec_json`` (formats in docs/ARCHITECTURE.md).

    workload keys at top level and under ``workload`` (and ``vars``, upstream's name);
    each earlier step's result by step name; ``ctx``; ``execution_id`` (and upstream's
    ``job.uuid``); ``event``; ``iter`` and its keys (the loop iterator's value under its
    own name).

Earlier step results are resolved from the result store only for the step names the
command's templates reference (python ``code`` included: code holding ``{{ }}`` is
rendered before it runs, as upstream renders the whole tool config). Steps that exist but have no result read as
None.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from noetl_common.errors import NotFound
from noetl_dsl.templates import (
    RenderContext,
    TemplateError,
    add_upstream_names,
    is_template,
    referenced_names,
)
from noetl_store import ResultStore

logger = logging.getLogger(__name__)

# base64 code is not scanned; python `code` is (a template in it is rendered, as upstream does)
CODE_FIELDS = frozenset({"code_b64", "code_base64"})
RESERVED = ("workload", "ctx", "execution_id", "event", "iter")


def _template_strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        if is_template(value):
            yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if key not in CODE_FIELDS:
                yield from _template_strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _template_strings(item)


def template_names(spec: Mapping[str, Any]) -> set[str]:
    """Top-level names read by the templates of a command spec (tool, input, workbook).
    A template that does not parse is skipped here; rendering reports it."""
    names: set[str] = set()
    for text in _template_strings({k: spec.get(k) for k in ("tool", "input", "workbook")}):
        try:
            names |= referenced_names(text)
        except TemplateError:
            continue
    return names


def _reference_id(entry: Any) -> int | None:
    if not isinstance(entry, Mapping):
        return None
    ref = entry.get("reference")
    if isinstance(ref, Mapping) and ref.get("ref_id") is not None:
        return int(ref["ref_id"])
    return None


async def build_scope(context: Mapping[str, Any], spec: Mapping[str, Any], store: ResultStore,
                      names: set[str] | None = None) -> RenderContext:
    """The RenderContext for a command. Raises NotFound when a referenced result is not
    in the store, and the store's errors (Unavailable, ...) when it cannot be read."""
    workload = context.get("workload") or {}
    workload_ref = context.get("workload_ref")
    if isinstance(workload_ref, Mapping) and workload_ref.get("ref_id"):
        # a workload too large to ride in every claim: read (and cached) from the store
        workload = await store.get(int(workload_ref["ref_id"]))
    steps = context.get("steps") or {}
    if not isinstance(workload, Mapping) or not isinstance(steps, Mapping):
        raise ValueError("context_json: `workload` and `steps` must be objects")
    wanted = template_names(spec) if names is None else names
    known = {str(s) for s in context.get("known_steps") or ()} | {str(s) for s in steps}

    refs: dict[str, int] = {}
    inline: dict[str, Any] = {}
    for step in wanted & set(steps):
        ref_id = _reference_id(steps[step])
        if ref_id is not None:
            refs[step] = ref_id
        elif isinstance(steps[step], Mapping) and "value" in steps[step]:
            inline[step] = steps[step]["value"]
    resolved = await store.get_many(refs.values()) if refs else {}
    missing = sorted(f"{step} (ref {ref_id})" for step, ref_id in refs.items() if ref_id not in resolved)
    if missing:
        raise NotFound(f"result of {', '.join(missing)} not found in the result store")

    data: dict[str, Any] = dict(workload)
    data.update(inline)
    data.update({step: resolved[ref_id] for step, ref_id in refs.items()})
    iter_scope = context.get("iter")
    if isinstance(iter_scope, Mapping):
        data.update(iter_scope)
    if "loop_index" in context:
        data["loop_index"] = context["loop_index"]
    data.update(workload=dict(workload), ctx=dict(context.get("ctx") or {}),
                execution_id=context.get("execution_id"), event=dict(context.get("event") or {}),
                iter=dict(iter_scope) if isinstance(iter_scope, Mapping) else {})
    add_upstream_names(data, workload, context.get("execution_id"))
    return RenderContext(data, known=known)
