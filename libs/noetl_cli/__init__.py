"""``noetl-rt``: the client CLI, migrations, and the embedded local stack.

The local stack launcher is a Python API too (``noetl_cli.devstack``); its public
names are re-exported here. Everything else is reached through ``noetl_cli.main``.
"""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)

from .devstack import (
    ROLES,
    ServiceProcess,
    StackError,
    StackRunning,
    StackState,
    StackStatus,
    down,
    heal,
    parse_scale,
    status,
    up,
)

__all__ = [
    "ROLES",
    "ServiceProcess",
    "StackError",
    "StackRunning",
    "StackState",
    "StackStatus",
    "down",
    "heal",
    "parse_scale",
    "status",
    "up",
]
