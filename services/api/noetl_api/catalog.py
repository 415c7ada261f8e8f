"""The playbook catalog: versioned per ``metadata.path``; parsed playbooks cached by id."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from noetl_common.config import LimitSettings
from noetl_common.db import Pool, autocommit, transaction
from noetl_common.errors import NotFound
from noetl_db import catalog as catalog_db
from noetl_dsl import Placement, Playbook, load_playbook, parse_playbook, placements
from noetl_flow import Flow
from noetl_flow.loops import DEFAULT_BATCH_MAX, DEFAULT_BATCH_MS

logger = logging.getLogger(__name__)

SUPPORTED_KINDS = frozenset({"python", "http", "postgres", "duckdb", "noop", "workbook", "playbook"})
# Inline playbook texts whose parse is kept (``Catalog.parsed``): how many, and the longest.
PARSED_TEXTS = 256
PARSED_TEXT_BYTES = 64 * 1024


@dataclass(frozen=True)
class CatalogEntry:
    catalog_id: int
    path: str
    version: int
    kind: str
    name: str
    content: str
    content_sha256: str
    created_at: datetime


@dataclass
class Compiled:
    """A catalog entry's parsed playbook and its routing tables (immutable per id)."""

    entry: CatalogEntry
    playbook: Playbook
    flow: Flow
    # steps whose pool / required labels / priority are not the defaults (noetl_dsl.placement)
    placements: dict[str, Placement] = field(default_factory=dict)


def parse(content: str, limits: LimitSettings | None = None) -> Playbook:
    """Parse and validate a playbook within ``limits`` (size, YAML nodes, depth, steps)."""
    return parse_playbook(content, supported_kinds=SUPPORTED_KINDS, limits=limits)


class Catalog:
    def __init__(self, pool: Pool, cache_size: int = 256, *, limits: LimitSettings | None = None,
                 loop_batch: int = DEFAULT_BATCH_MAX, loop_batch_ms: float = DEFAULT_BATCH_MS) -> None:
        self._pool = pool
        self.limits = limits or LimitSettings.model_construct()
        self.loop_batch = loop_batch
        self.loop_batch_ms = loop_batch_ms
        self._cache: OrderedDict[int, Compiled] = OrderedDict()
        self._cache_size = cache_size
        # inline texts already parsed, by SHA-256 (a client submitting the same YAML again)
        self._parsed: OrderedDict[str, Playbook] = OrderedDict()
        # the entry ``register`` last gave for a text, by its SHA-256: the latest version of
        # its path then (a submission's insert checks that it still is: ``registered``)
        self._registered: OrderedDict[str, CatalogEntry] = OrderedDict()

    def parsed(self, content: str) -> Playbook | None:
        """The playbook parsed from exactly ``content`` before (``remember``), if kept.
        Parsing is pure (the text and this process's limits decide it) and a Playbook is
        shared read-only (as ``compiled`` shares them), so the kept one is what parsing
        again would give; texts that failed to parse are never kept."""
        data = content.encode()
        if len(data) > PARSED_TEXT_BYTES:
            return None
        key = hashlib.sha256(data).hexdigest()
        hit = self._parsed.get(key)
        if hit is not None:
            self._parsed.move_to_end(key)
        return hit

    def remember(self, content: str, playbook: Playbook) -> None:
        """Keep ``playbook`` as the parse of ``content`` (at most PARSED_TEXTS texts of up
        to PARSED_TEXT_BYTES bytes of UTF-8 each; the least recently used goes first)."""
        data = content.encode()
        if len(data) > PARSED_TEXT_BYTES:
            return
        self._parsed[hashlib.sha256(data).hexdigest()] = playbook
        while len(self._parsed) > PARSED_TEXTS:
            self._parsed.popitem(last=False)

    def registered(self, content: str) -> CatalogEntry | None:
        """The entry ``register`` last gave for exactly ``content`` here, which was the
        latest version of its path then. Only a hint: whoever pins it must check that it
        still is the latest (``requests.insert_submission(latest_of=...)`` does, in the
        same statement), and ``forget`` it when not."""
        data = content.encode()
        if len(data) > PARSED_TEXT_BYTES:
            return None
        key = hashlib.sha256(data).hexdigest()
        hit = self._registered.get(key)
        if hit is not None:
            self._registered.move_to_end(key)
        return hit

    def forget(self, entry: CatalogEntry) -> None:
        """``entry`` is no longer the latest version of its path."""
        self._registered.pop(entry.content_sha256, None)

    async def register(self, content: str, playbook: Playbook | None = None) -> tuple[CatalogEntry, bool]:
        """Store a new version of the playbook's path unless the latest version is identical."""
        if playbook is None:  # parsed off the event loop, within the limits
            playbook = await asyncio.to_thread(parse, content, self.limits)
        sha = hashlib.sha256(content.encode()).hexdigest()
        path = playbook.path
        # The usual case, the same text as the latest version, in one read (no lock).
        async with autocommit(self._pool) as conn:
            latest = await _latest(conn, path)
        if latest is not None and latest["content_sha256"] == sha:
            return self._keep(content, _entry(latest)), False
        async with transaction(self._pool) as conn:
            await catalog_db.lock_path(conn, path)
            latest = await _latest(conn, path)
            if latest is not None and latest["content_sha256"] == sha:
                return self._keep(content, _entry(latest)), False
            version = (latest["version"] if latest else 0) + 1
            doc = playbook.raw
            row = await catalog_db.insert(conn, path=path, version=version, kind=str(doc.get("kind", "Playbook")),
                                          name=playbook.name, content=content, sha256=sha, doc=doc)
        logger.info("registered playbook %s version %s", path, version)
        return self._keep(content, _entry(row)), True

    def _keep(self, content: str, entry: CatalogEntry) -> CatalogEntry:
        if len(content.encode()) <= PARSED_TEXT_BYTES:
            self._registered[entry.content_sha256] = entry
            self._registered.move_to_end(entry.content_sha256)
            while len(self._registered) > PARSED_TEXTS:
                self._registered.popitem(last=False)
        return entry

    async def get(self, path: str, version: int = 0) -> CatalogEntry:
        async with self._pool.connection() as conn:
            if version > 0:
                cur = await conn.execute("SELECT * FROM noetl.catalog WHERE path = %s AND version = %s",
                                         (path, version))
                row = await cur.fetchone()
            else:
                row = await _latest(conn, path)
        if row is None:
            raise NotFound(f"playbook {path!r}" + (f" version {version}" if version else "") + " not found")
        return _entry(row)

    async def list(self, prefix: str, limit: int, after: str) -> list[CatalogEntry]:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT DISTINCT ON (path) * FROM noetl.catalog WHERE path LIKE %s AND path > %s"
                " ORDER BY path, version DESC LIMIT %s",
                (prefix.replace("%", r"\%") + "%", after, limit),
            )
            return [_entry(r) for r in await cur.fetchall()]

    def _compile(self, doc: Any) -> tuple[Playbook, Flow]:
        playbook = load_playbook(doc, limits=self.limits)
        return playbook, Flow(playbook, copy_state=False, max_loop_items=self.limits.loop_items,
                              loop_batch=self.loop_batch, loop_batch_ms=self.loop_batch_ms)

    async def compiled(self, catalog_id: int) -> Compiled:
        hit = self._cache.get(catalog_id)
        if hit is not None:
            self._cache.move_to_end(catalog_id)
            return hit
        async with self._pool.connection() as conn:
            cur = await conn.execute("SELECT * FROM noetl.catalog WHERE catalog_id = %s", (catalog_id,))
            row = await cur.fetchone()
        if row is None:
            raise NotFound(f"catalog entry {catalog_id} not found")
        # validating and building the routing tables never run on the loop that drives
        # the engines and the leases
        playbook, flow = await asyncio.to_thread(self._compile, row["doc"])
        compiled = Compiled(_entry(row), playbook, flow, placements(playbook))
        self._cache[catalog_id] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled


async def _latest(conn: Any, path: str) -> dict[str, Any] | None:
    """The newest catalog row of ``path``, if any."""
    cur = await conn.execute("SELECT * FROM noetl.catalog WHERE path = %s ORDER BY version DESC LIMIT 1", (path,))
    row: dict[str, Any] | None = await cur.fetchone()
    return row


def _entry(row: dict[str, Any]) -> CatalogEntry:
    return CatalogEntry(row["catalog_id"], row["path"], row["version"], row["kind"], row["name"],
                        row["content"], row["content_sha256"], row["created_at"])
