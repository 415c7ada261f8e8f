"""The engine's pure core: execution state, folding inputs, routing. No I/O."""

from . import rerun
from .rerun import RerunPlan, RerunRefused
from .router import (
    EV_CALL_DONE,
    EV_CALL_ERROR,
    EV_CANCELLED,
    EV_COMPLETED,
    EV_DEAD,
    EV_DUPLICATE,
    EV_FAILED,
    EV_REISSUED,
    EV_STARTED,
    EV_STEP_ENTER,
    Flow,
)
from .state import ExecState, Pending, StepRun
from .transitions import CallResultInput, CommandUpdate, NewCommand, NewEvent, StartInput, Transition

__all__ = [
    "EV_CALL_DONE",
    "EV_CALL_ERROR",
    "EV_CANCELLED",
    "EV_COMPLETED",
    "EV_DEAD",
    "EV_DUPLICATE",
    "EV_FAILED",
    "EV_REISSUED",
    "EV_STARTED",
    "EV_STEP_ENTER",
    "CallResultInput",
    "CommandUpdate",
    "ExecState",
    "Flow",
    "NewCommand",
    "NewEvent",
    "Pending",
    "RerunPlan",
    "RerunRefused",
    "StartInput",
    "StepRun",
    "Transition",
    "rerun",
]
