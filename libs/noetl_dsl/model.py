"""The playbook model: NoETL's canonical DSL (``apiVersion: noetl.io/v2``) as pydantic v2
models.

Every model keeps unknown keys (``extra="allow"``): upstream fields such as ``desc``,
``spec``, ``assert``, ``executor``, ``keychain`` and ``labels`` survive a round trip even
though the runtime does not interpret them. The models check types only; the rules that
need the whole document (names resolve, tools are complete, templates parse) live in
``validate.py``, which is the only supported way to build a :class:`Playbook` from YAML.

    Playbook
    ├── metadata: Metadata            name, path
    ├── workload: dict                default inputs, merged with the submitted payload
    ├── workbook: [dict]              named tasks that ``kind: workbook`` tools run
    └── workflow: [Step]
        ├── tool: dict | [dict]       one task, or a pipeline of tasks (-> Step.tasks)
        ├── loop: Loop                in / iterator / spec.mode / cursor
        └── next: Next                spec.mode + arcs: [Arc(step, when, set)]
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

NextMode = Literal["exclusive", "inclusive"]
LoopMode = Literal["sequential", "parallel", "cursor"]

END_STEP = "end"
START_STEP = "start"


class _Model(BaseModel):
    """Base: unknown keys kept, populated by field name or alias, immutable."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)


def _with_raw(data: Any) -> Any:
    """Before-validator helper: remember the input mapping as ``raw`` unless given."""
    if isinstance(data, dict) and "raw" not in data:
        return {**data, "raw": dict(data)}
    return data


class Arc(_Model):
    """One outgoing edge: go to ``step`` when ``when`` holds, applying ``set`` first."""

    step: str = Field(min_length=1)
    when: str | bool | None = None
    set: dict[str, Any] | None = None

    @field_validator("when", mode="before")
    @classmethod
    def _when_type(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str | bool):
            raise ValueError(f"when must be a template string or a boolean (got {type(value).__name__})")
        return value


class NextSpec(_Model):
    mode: NextMode = "exclusive"


class Next(_Model):
    """Routing after a step: ``exclusive`` takes the first arc whose ``when`` holds,
    ``inclusive`` takes every such arc (fan-out)."""

    spec: NextSpec = Field(default_factory=NextSpec)
    arcs: list[Arc] = Field(default_factory=list)

    @field_validator("spec", mode="before")
    @classmethod
    def _spec_none(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("arcs", mode="before")
    @classmethod
    def _arcs_none(cls, value: Any) -> Any:
        return [] if value is None else value

    @property
    def mode(self) -> NextMode:
        return self.spec.mode


def normalise_next(value: Any) -> Any:
    """Accept the shorthands ``next: name``, ``next: [name | {step: ...}]`` and
    ``next: {step: ...}``; return the canonical ``{spec, arcs}`` mapping (or the value
    unchanged when it is none of these, so type errors surface)."""
    if isinstance(value, str):
        return {"arcs": [{"step": value}]}
    if isinstance(value, list):
        return {"arcs": [{"step": a} if isinstance(a, str) else a for a in value]}
    if isinstance(value, dict) and "arcs" not in value and "step" in value:
        return {"arcs": [value]}
    return value


class LoopSpec(_Model):
    """``max_in_flight``: a positive integer, or a template the engine renders when the
    loop starts (``'{{ workload.concurrency | int }}'``, as upstream's Python reference
    allows); a template that renders to anything but a positive integer fails the step."""

    mode: LoopMode = "sequential"
    max_in_flight: int | str | None = None
    policy: dict[str, Any] | None = None

    @field_validator("max_in_flight", mode="before")
    @classmethod
    def _width(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            if isinstance(value, bool):
                raise ValueError("max_in_flight must be a positive integer or a template")
            return value
        if isinstance(value, str) and "{{" in value:
            return value
        try:
            width = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"max_in_flight must be a positive integer or a template, got {value!r}") from None
        if width < 1 or (width != value and not isinstance(value, str)):
            raise ValueError(f"max_in_flight must be a positive integer or a template, got {value!r}")
        return width


class Loop(_Model):
    """Run the step's tool once per item of ``in`` (bound to ``iterator``), or per
    item a ``cursor`` claims."""

    in_: Any = Field(default=None, alias="in")
    iterator: str | None = None
    spec: LoopSpec = Field(default_factory=LoopSpec)
    cursor: dict[str, Any] | None = None

    @field_validator("spec", mode="before")
    @classmethod
    def _spec_none(cls, value: Any) -> Any:
        return {} if value is None else value

    @property
    def mode(self) -> LoopMode:
        return self.spec.mode

    @property
    def max_in_flight(self) -> int | str | None:
        """An int, a template (rendered when the loop starts) or None."""
        return self.spec.max_in_flight


class Task(_Model):
    """One tool invocation. ``raw`` is the task exactly as written (unrendered, and
    without the default name a task may have been given)."""

    kind: str
    name: str | None = None
    input: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None
    set: dict[str, Any] | None = None
    raw: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _fill_raw(cls, data: Any) -> Any:
        return _with_raw(data)

    @property
    def policy_rules(self) -> list[Any]:
        """``spec.policy.rules`` (raw), or an empty list."""
        policy = (self.spec or {}).get("policy")
        rules = policy.get("rules") if isinstance(policy, dict) else None
        return list(rules) if isinstance(rules, list) else []


class Step(_Model):
    """A workflow node: run ``tool`` (optionally in a ``loop``), then route by ``next``."""

    step: str = Field(min_length=1)
    desc: str | None = None
    tool: Any = None
    input: dict[str, Any] | None = None
    loop: Loop | None = None
    next: Next | None = None
    set: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None

    @field_validator("next", mode="before")
    @classmethod
    def _next_forms(cls, value: Any) -> Any:
        value = normalise_next(value)
        if value is not None and not isinstance(value, dict):
            raise ValueError("next must be a mapping with 'arcs', a step name, or a list of arcs")
        return value

    @property
    def name(self) -> str:
        return self.step

    @property
    def raw_tool(self) -> Any:
        """The tool as written: one task mapping, or a list of them."""
        return self.tool

    @property
    def is_pipeline(self) -> bool:
        return isinstance(self.tool, list)

    @cached_property
    def tasks(self) -> list[Task]:
        """The tool as a list of tasks. A single unnamed tool is named after the step;
        unnamed pipeline tasks are ``task_<index>``."""
        if isinstance(self.tool, dict):
            return [_task(self.tool, self.step)]
        if isinstance(self.tool, list):
            return [_task(t, f"task_{i}") for i, t in enumerate(self.tool)]
        return []

    @property
    def arcs(self) -> list[Arc]:
        return list(self.next.arcs) if self.next is not None else []

    @property
    def next_mode(self) -> NextMode:
        return self.next.spec.mode if self.next is not None else "exclusive"


def _task(raw: dict[str, Any], default_name: str) -> Task:
    name = raw.get("name") or default_name
    return Task.model_validate({**raw, "name": name, "raw": raw})


class Metadata(_Model):
    name: str = Field(min_length=1)
    path: str | None = None


class Playbook(_Model):
    """A whole playbook. ``raw`` is the original mapping (as parsed from YAML)."""

    apiVersion: str
    kind: Literal["Playbook"] = "Playbook"
    metadata: Metadata
    workload: dict[str, Any] = Field(default_factory=dict)
    workbook: list[dict[str, Any]] = Field(default_factory=list)
    workflow: list[Step] = Field(min_length=1)
    raw: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _fill_raw(cls, data: Any) -> Any:
        return _with_raw(data)

    @field_validator("apiVersion")
    @classmethod
    def _api_version(cls, value: str) -> str:
        if not value.startswith("noetl.io/"):
            raise ValueError(f"apiVersion must start with 'noetl.io/' (got {value!r})")
        return value

    @field_validator("workload", "workbook", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return {} if info.field_name == "workload" else []
        return value

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def path(self) -> str:
        """The catalog path: ``metadata.path``, else ``metadata.name``."""
        return self.metadata.path or self.metadata.name

    @cached_property
    def _steps_by_name(self) -> dict[str, Step]:
        return {s.step: s for s in self.workflow}

    @property
    def step_names(self) -> list[str]:
        return [s.step for s in self.workflow]

    @cached_property
    def _step_positions(self) -> dict[str, int]:
        return {s.step: i for i, s in reversed(list(enumerate(self.workflow)))}

    def step_index(self, name: str) -> int:
        """The position of the step called ``name`` in ``workflow`` (its first, when
        names repeat); KeyError when there is none."""
        return self._step_positions[name]

    @property
    def start_step(self) -> str:
        """The step named ``start`` if there is one, else the first step."""
        return START_STEP if START_STEP in self._steps_by_name else self.workflow[0].step

    def step(self, name: str) -> Step:
        """The step called ``name``; KeyError when there is none."""
        try:
            return self._steps_by_name[name]
        except KeyError:
            raise KeyError(f"playbook {self.name!r} has no step {name!r}") from None

    def has_step(self, name: str) -> bool:
        return name in self._steps_by_name

    @cached_property
    def _workbook_by_name(self) -> dict[Any, dict[str, Any]]:
        entries: dict[Any, dict[str, Any]] = {}
        for entry in self.workbook:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                entries.setdefault(entry["name"], entry)
        return entries

    def workbook_task(self, name: str) -> dict[str, Any] | None:
        """The task mapping of workbook entry ``name`` (its ``tool``; for entries written
        without ``tool``, the entry itself minus ``name``), or None."""
        entry = self._workbook_by_name.get(name)
        return None if entry is None else workbook_entry_task(entry)


def workbook_entry_task(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The runnable task of one workbook entry, or None when it has none."""
    tool = entry.get("tool")
    if isinstance(tool, dict):
        return tool
    if tool is None and "kind" in entry:
        return {k: v for k, v in entry.items() if k != "name"}
    return None
