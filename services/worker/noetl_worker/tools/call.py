"""Who is running a task: the identity tools need beyond the task itself.

``key`` is deterministic for one task run of one command (the same on every attempt of
the command), so a tool that starts something elsewhere (a sub-playbook) can use it as
an idempotency key and re-attach after a worker died. ``cancelled`` is set when the api
cancelled the command (not when the worker merely lost its lease or shuts down: then
another attempt takes over and re-attaches). ``secrets`` is the command attempt's access
to stored credentials (``credentials.py``), which records what it hands out for redaction.
``python_lane``: the child a batch's python tasks run in, one after another (``PythonLane``);
None: each takes an idle child of the pool.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .credentials import CommandSecrets
    from .python import PythonLane


@dataclass(frozen=True, slots=True)
class CallInfo:
    execution_id: int
    command_id: str
    step: str
    key: str
    cancelled: asyncio.Event | None = None
    # the claim this call runs under (a sub-playbook's submission proves it with it)
    attempt: int = 0
    worker_id: str = ""
    claim_token: str = ""
    secrets: CommandSecrets | None = None
    # the catalog path of the command's playbook (file scripts are looked up beside it)
    playbook_path: str = ""
    python_lane: PythonLane | None = None

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled is not None and self.cancelled.is_set()
