"""Cursor drivers (seed 003): where a cursor loop's rows come from.

    base.py       CursorSpec, the CursorDriver / CursorDriverFactory protocols, the
                  CursorDrivers registry (register_driver, lookup, open, close)
    postgres.py   claim = the user's SQL in one transaction (FOR UPDATE SKIP LOCKED)

A new backend (MySQL, Snowflake, Redis streams, ...) is a module with a factory and one
``register_driver`` line in ``default_drivers``; the engine and the slot runtime
(``noetl_worker.cursor``) stay as they are.
"""

from __future__ import annotations

from ..tools.postgres import PoolRegistry
from .base import (
    DEFAULT_POOL_SIZE,
    CursorDriver,
    CursorDriverFactory,
    CursorDrivers,
    CursorError,
    CursorSpec,
    Row,
)
from .postgres import PostgresCursorDriver, PostgresCursorFactory

__all__ = [
    "DEFAULT_POOL_SIZE",
    "CursorDriver",
    "CursorDriverFactory",
    "CursorDrivers",
    "CursorError",
    "CursorSpec",
    "PostgresCursorDriver",
    "PostgresCursorFactory",
    "Row",
    "default_drivers",
]


def default_drivers(pools: PoolRegistry) -> CursorDrivers:
    """The registry a worker starts with: postgres over the worker's shared pools."""
    drivers = CursorDrivers()
    drivers.register_driver("postgres", PostgresCursorFactory(pools))
    return drivers
