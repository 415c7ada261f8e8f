"""The engine's pure core: execution state, folding inputs, routing. No I/O."""

from . import rerun
from .redrive import RedriveItem, redrive_command_id, refusal
from .rerun import RerunPlan, RerunRefused
from .router import (
    Flow,
)
from .state import ExecState, Pending, StepRun
from .transitions import (
    CallResultInput,
    CommandUpdate,
    DeadLetter,
    IterationOutcome,
    NewCommand,
    NewEvent,
    StartInput,
    Transition,
)

__all__ = [
    "CallResultInput",
    "CommandUpdate",
    "DeadLetter",
    "ExecState",
    "Flow",
    "IterationOutcome",
    "NewCommand",
    "NewEvent",
    "Pending",
    "RedriveItem",
    "RerunPlan",
    "RerunRefused",
    "StartInput",
    "StepRun",
    "Transition",
    "redrive_command_id",
    "refusal",
    "rerun",
]
