"""``noetl-rt``: the client CLI, migrations, and the embedded local stack.

The local stack launcher is a Python API too (``noetl_cli.devstack``); its public
names are re-exported here, loaded on first use: a client command (``noetl-rt status``)
never imports the launcher (Postgres, NATS, certificates: most of the CLI's start-up).
Everything else is reached through ``noetl_cli.main``.
"""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)

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


def __getattr__(name: str) -> object:
    if name in __all__:
        from . import devstack

        return getattr(devstack, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
