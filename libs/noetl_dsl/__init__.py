"""NoETL's playbook DSL: the model, validation with field paths, graph helpers and
Jinja rendering. Pure, no I/O."""

from .checks import TOOL_KINDS
from .graph import predecessors, reachable_from, successors
from .model import Arc, Loop, Next, Playbook, Step, Task
from .placement import Placement, placements
from .templates import (
    RenderContext,
    TemplateError,
    evaluate_when,
    is_template,
    referenced_names,
    render,
    render_str,
    render_text,
)
from .validate import load_playbook, load_yaml, merged_workload, parse_playbook, static_auth_refs

__all__ = [
    "TOOL_KINDS",
    "Arc",
    "Loop",
    "Next",
    "Placement",
    "Playbook",
    "RenderContext",
    "Step",
    "Task",
    "TemplateError",
    "evaluate_when",
    "is_template",
    "load_playbook",
    "load_yaml",
    "merged_workload",
    "parse_playbook",
    "placements",
    "predecessors",
    "reachable_from",
    "referenced_names",
    "render",
    "render_str",
    "render_text",
    "static_auth_refs",
    "successors",
]
