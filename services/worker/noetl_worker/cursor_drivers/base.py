"""The cursor driver contract and its registry.

    CursorSpec            the engine's rendered ``loop.cursor``: kind, auth, claim, options
    CursorDriver          ``claim(statement)``: an async context manager yielding one claimed
                          row (a JSON-able mapping) or None when nothing is left. Leaving the
                          block normally commits the claim; an exception rolls it back, so a
                          caller can record the row elsewhere *before* the claim commits.
    CursorDriverFactory   ``open(spec) -> CursorDriver`` (connections shared per DSN per
                          process), ``close()`` at shutdown
    CursorDrivers         the registry: ``register_driver(kind, factory)``, ``lookup(kind)``,
                          ``open(spec)``, ``close()``

Driver failures are ``ToolError`` (``CursorError`` for a spec or statement that can never
work, ``SQL_ERROR`` / ``CREDENTIAL_NOT_FOUND`` codes for the backend's own errors).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from noetl_common.errors import ToolError

from ..tools.outcome import CURSOR_ERROR

if TYPE_CHECKING:
    from ..tools.credentials import CommandSecrets

logger = logging.getLogger(__name__)

Row = dict[str, Any]
DEFAULT_POOL_SIZE = 8


class CursorError(ToolError):
    """A cursor spec or claim that cannot work as written (unknown kind, bad options,
    a claim returning several rows)."""

    def __init__(self, message: str, *, kind: str = "CursorError") -> None:
        super().__init__(message, code=CURSOR_ERROR, kind=kind)


@dataclass(frozen=True, slots=True)
class CursorSpec:
    """``loop.cursor`` as the engine rendered it once at loop entry."""

    kind: str
    auth: Any
    claim: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> CursorSpec:
        """Parse the ``cursor`` of a slot command's context; CursorError when unusable."""
        if not isinstance(data, Mapping):
            raise CursorError("the command carries no `cursor` spec (expected kind, auth, claim)")
        claim = data.get("claim")
        if not isinstance(claim, str) or not claim.strip():
            raise CursorError("loop.cursor needs a `claim` statement")
        options = data.get("options") or {}
        if not isinstance(options, Mapping):
            raise CursorError(f"loop.cursor.options must be a mapping, got {type(options).__name__}")
        return cls(str(data.get("kind") or "postgres").strip().lower(), data.get("auth"), claim, dict(options))

    @property
    def pool_size(self) -> int:
        raw = self.options.get("pool_size")
        if raw in (None, ""):
            return DEFAULT_POOL_SIZE
        try:
            size = int(raw)
        except (TypeError, ValueError):
            raise CursorError(f"loop.cursor.options.pool_size must be an integer, got {raw!r}") from None
        if size < 1:
            raise CursorError(f"loop.cursor.options.pool_size must be at least 1, got {size}")
        return size


class CursorDriver(Protocol):
    kind: str

    def claim(self, statement: str) -> AbstractAsyncContextManager[Row | None]:
        """Run the claim statement in a transaction and yield the claimed row (None when
        the cursor is drained); commit on a normal exit, roll back on an exception."""
        ...


class CursorDriverFactory(Protocol):
    async def open(self, spec: CursorSpec, secrets: CommandSecrets | None = None) -> CursorDriver:
        """A driver for ``spec`` (resolving ``auth`` through the command's ``secrets``,
        sharing connection pools)."""
        ...

    async def close(self) -> None:
        """Release what the factory holds (pools)."""
        ...


class CursorDrivers:
    """Cursor driver factories by ``kind``."""

    def __init__(self) -> None:
        self._factories: dict[str, CursorDriverFactory] = {}

    def register_driver(self, kind: str, factory: CursorDriverFactory) -> None:
        """Make ``kind`` available (replacing an earlier factory of that kind)."""
        key = kind.strip().lower()
        if not key:
            raise ValueError("a cursor driver needs a kind")
        self._factories[key] = factory

    @property
    def kinds(self) -> list[str]:
        return sorted(self._factories)

    def lookup(self, kind: str) -> CursorDriverFactory:
        factory = self._factories.get(kind.strip().lower())
        if factory is None:
            known = ", ".join(self.kinds) or "none"
            raise CursorError(f"unknown cursor kind {kind!r} (this worker has drivers for: {known})",
                              kind="UnknownCursorKind")
        return factory

    async def open(self, spec: CursorSpec, secrets: CommandSecrets | None = None) -> CursorDriver:
        return await self.lookup(spec.kind).open(spec, secrets)

    async def close(self) -> None:
        for kind, factory in list(self._factories.items()):
            try:
                await factory.close()
            except Exception:  # pragma: no cover - shutdown best effort
                logger.exception("closing the %s cursor driver failed", kind)
