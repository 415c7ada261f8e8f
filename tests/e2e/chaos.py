"""Helpers for the failover tests: a module-scoped stack with fast leases, shard ownership
lookups, and the invariants every failover must keep (gap-free ``shard_seq``, one
accepted result per command, read model == a fresh fold). Waiting: tests/waiting.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from harness import CREDENTIALS, Runner, start_stack
from nats.js.errors import NotFoundError
from psycopg.rows import dict_row
from waiting import until_sync

from noetl_cli import devstack
from noetl_cli.client import Api
from noetl_cli.supervise import ServiceProcess, target_of
from noetl_client import values
from noetl_common import natsio
from noetl_flow.projection import ExecutionView, fold
from noetl_proto.v1 import catalog_pb2

# Fast leases: a dead member is declared dead after 3 s, members heartbeat every second.
CHAOS_ENV = {
    "NOETL_SHARD_HEARTBEAT_SEC": "1",
    "NOETL_SHARD_LEASE_SEC": "3",
    "NOETL_COMMAND_LEASE_SEC": "3",
    "NOETL_COMMAND_REPUBLISH_AFTER_SEC": "3",
    "NOETL_EXECUTION_SWEEP_INTERVAL_SEC": "0.5",
}

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata:\n  name: {name}\n  path: tests/failover/{name}\n"


def chain(name: str, steps: int, sleep: float) -> str:
    """A playbook of ``steps`` python steps in a row, each sleeping ``sleep`` seconds."""
    body = ["workflow:"]
    for i in range(1, steps + 1):
        body.append(f"  - step: s{i}" if i > 1 else "  - step: start")
        body.append(f"    tool: {{kind: python, code: \"import time\\ntime.sleep({sleep})\\nresult = {i}\"}}")
        if i < steps:
            body.append(f"    next: {{arcs: [{{step: s{i + 1}}}]}}")
    return HEADER.format(name=name) + "\n".join(body) + "\n"


@contextlib.contextmanager
def stack_for(prefix: str, scale: dict[str, int], env: dict[str, str] | None = None, **up: Any) -> Iterator[Runner]:
    """A stack of its own for one test module (torn down afterwards); ``up`` passes on to
    ``devstack.up`` (e.g. ``role_postgres_dsn=proxy.dsn_via``)."""
    home = Path(tempfile.mkdtemp(prefix=f"noetl-{prefix}-"))
    os.chmod(home, 0o755)
    state = start_stack(home, scale, {**CHAOS_ENV, **(env or {})}, **up)
    runner = Runner(state)
    try:
        dsn = state.postgres_dsn
        for name in CREDENTIALS:
            runner.api.credentials.PutCredential(catalog_pb2.PutCredentialRequest(
                name=name, kind="postgres", data=values.to_struct({"dsn": dsn})), timeout=10)
        yield runner
    finally:
        runner.api.close()
        state.shutdown()  # this object holds the Popen handles (restarted replicas too): reaps them
        keep = os.environ.get("NOETL_TEST_KEEP_LOGS")
        if keep:  # the role logs survive the stack for a post-mortem
            shutil.copytree(state.log_dir, Path(keep) / home.name, dirs_exist_ok=True)
        shutil.rmtree(home, ignore_errors=True)


class Db:
    """One autocommit connection with dict rows (polling without a connect per query)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)

    def close(self) -> None:
        self.conn.close()

    def reconnect(self) -> None:
        """A new connection (after the server restarted)."""
        with contextlib.suppress(psycopg.Error):
            self.conn.close()
        self.conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row)

    def all(self, query: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        return list(self.conn.execute(query, params).fetchall())

    def one(self, query: str, params: tuple[Any, ...] = ()) -> dict[str, Any] | None:
        return self.conn.execute(query, params).fetchone()

    def value(self, query: str, params: tuple[Any, ...] = ()) -> Any:
        row = self.conn.execute(query, params).fetchone()
        return None if row is None else next(iter(row.values()))

    # ------------------------------------------------------------ ownership

    def shard_of(self, execution_id: int) -> int:
        return int(self.value("SELECT shard_id FROM noetl.execution_request WHERE execution_id = %s",
                              (execution_id,)))

    def lease(self, role: str, shard: int) -> dict[str, Any]:
        row = self.one(
            "SELECT l.owner_runtime_id, l.epoch, l.leased_until, l.updated_at, l.event_seq, r.instance, r.status"
            " FROM noetl.shard_lease l LEFT JOIN noetl.runtime r ON r.runtime_id = l.owner_runtime_id"
            " WHERE l.role = %s AND l.shard_id = %s", (role, shard))
        assert row is not None, f"no {role} lease row for shard {shard}"
        return row

    def leader(self) -> dict[str, Any] | None:
        return self.one("SELECT holder_instance, holder_runtime_id, epoch, leased_until FROM noetl.leader_lease"
                        " WHERE name = 'shard-manager'")

    def now(self) -> Any:
        return self.value("SELECT clock_timestamp()")

    # ------------------------------------------------------------ invariants

    def assert_shard_log_intact(self, shard: int) -> list[dict[str, Any]]:
        """The shard's log is gap-free and unique in ``shard_seq`` (1..n), agrees with the
        engine's ``event_seq``, and its lease epochs never go back: no write of an older
        owner landed after a newer owner's."""
        # one statement, one snapshot: a batch committing between two reads (a checkpoint
        # barrier, any time) would move event_seq past the events read first
        rows = self.all("SELECT e.shard_seq, (e.meta->>'lease_epoch')::bigint AS lease_epoch, e.event_type,"
                        " e.execution_id, e.created_at, l.event_seq AS lease_event_seq"
                        " FROM noetl.shard_lease l LEFT JOIN noetl.event e ON e.shard_id = l.shard_id"
                        " WHERE l.role = 'api' AND l.shard_id = %s ORDER BY e.shard_seq", (shard,))
        event_seq = rows[0]["lease_event_seq"] if rows else 0
        rows = [r for r in rows if r["shard_seq"] is not None]
        seqs = [r["shard_seq"] for r in rows]
        assert seqs == list(range(1, len(seqs) + 1)), f"shard {shard}: shard_seq not gap-free/unique: {seqs}"
        assert event_seq == len(seqs), f"shard {shard}: event_seq {event_seq} != last shard_seq {len(seqs)}"
        epochs = [r["lease_epoch"] for r in rows]
        assert None not in epochs, f"shard {shard}: an event without meta.lease_epoch"
        backwards = [(a["shard_seq"], a["lease_epoch"], b["lease_epoch"]) for a, b in itertools.pairwise(rows)
                     if b["lease_epoch"] < a["lease_epoch"]]
        assert not backwards, f"shard {shard}: an older owner appended after a newer one: {backwards}"
        return rows

    def assert_routed_once(self, execution_id: int) -> dict[str, int]:
        """One accepted result per command, one ``step.enter`` per visit, one terminal event.
        Returns {event_type: count}."""
        counts = {r["event_type"]: r["n"] for r in self.all(
            "SELECT event_type, count(*) AS n FROM noetl.event WHERE execution_id = %s GROUP BY 1", (execution_id,))}
        accepted = self.all("SELECT command_id, count(*) AS n FROM noetl.event WHERE execution_id = %s"
                            " AND event_type IN ('call.done', 'call.error') GROUP BY 1", (execution_id,))
        assert all(r["n"] == 1 for r in accepted), f"a command with several accepted results: {accepted}"
        enters = self.all("SELECT step, meta->>'visit' AS visit, count(*) AS n FROM noetl.event"
                          " WHERE execution_id = %s AND event_type = 'step.enter' GROUP BY 1, 2", (execution_id,))
        assert all(r["n"] == 1 for r in enters), f"a step entered twice for one visit: {enters}"
        duplicates = {r["command_id"] for r in self.all(
            "SELECT command_id FROM noetl.event WHERE execution_id = %s AND event_type = 'call.duplicate'",
            (execution_id,))}
        assert duplicates <= {r["command_id"] for r in accepted}, (
            f"a duplicate result for a command without an accepted one: {duplicates}")
        terminal = sum(counts.get(t, 0) for t in ("playbook.completed", "playbook.failed", "playbook.cancelled"))
        assert terminal == 1, f"terminal events: {counts}"
        return counts

    def events(self, execution_id: int) -> list[dict[str, Any]]:
        return self.all("SELECT execution_id, shard_seq, event_type, step, command_id, result, meta, created_at"
                        " FROM noetl.event WHERE execution_id = %s ORDER BY shard_seq", (execution_id,))

    def wait_projected(self, timeout: float = 30.0) -> None:
        """Until every shard's projection watermark equals the engine's last ``shard_seq``."""
        def projected() -> bool:
            behind = self.all("SELECT l.shard_id, l.event_seq, COALESCE(p.last_shard_seq, 0) AS projected"
                              " FROM noetl.shard_lease l LEFT JOIN noetl.projection_checkpoint p"
                              " ON p.shard_id = l.shard_id WHERE l.role = 'api'"
                              " AND l.event_seq <> COALESCE(p.last_shard_seq, 0)")
            assert not behind, f"shards behind: {behind}"
            return True

        until_sync(projected, timeout=timeout, what="every shard projected up to its last event",
                   ignoring=AssertionError)

    def assert_projection_is_a_fold(self, execution_id: int) -> None:
        """``noetl.execution`` / ``noetl.execution_step`` equal a fresh fold of the log."""
        events = self.events(execution_id)
        assert events, f"no events for {execution_id}"
        view = ExecutionView(execution_id=execution_id, shard_id=self.shard_of(execution_id))
        fold(view, events)
        row = self.one("SELECT * FROM noetl.execution WHERE execution_id = %s", (execution_id,))
        assert row is not None, f"execution {execution_id} not projected"
        for name in ("shard_id", "status", "catalog_id", "playbook_path", "playbook_version", "parent_execution_id",
                     "error", "created_at", "started_at", "ended_at", "last_shard_seq"):
            assert row[name] == getattr(view, name), (
                f"execution {execution_id}: {name} projected {row[name]!r}, fold {getattr(view, name)!r}")
        steps = {r["step"]: r for r in self.all("SELECT * FROM noetl.execution_step WHERE execution_id = %s",
                                                 (execution_id,))}
        assert set(steps) == set(view.steps), f"execution {execution_id}: steps {sorted(steps)} vs {sorted(view.steps)}"
        for name, s in view.steps.items():
            for f in ("status", "visits", "attempts", "result_ref_id", "error", "started_at", "ended_at"):
                assert steps[name][f] == getattr(s, f), (
                    f"execution {execution_id} step {name}: {f} projected {steps[name][f]!r}, fold {getattr(s, f)!r}")


@dataclass
class Owner:
    instance: str
    runtime_id: int
    epoch: int


def owner(db: Db, role: str, shard: int) -> Owner:
    row = db.lease(role, shard)
    return Owner(row["instance"] or "", int(row["owner_runtime_id"] or 0), int(row["epoch"]))


def moved(db: Db, role: str, shard: int, before: Owner) -> Owner | None:
    """The shard's owner once it is another member at a later epoch than ``before``."""
    now = owner(db, role, shard)
    return now if now.epoch > before.epoch and now.runtime_id != before.runtime_id else None


def leader_other_than(db: Db, instance: str) -> dict[str, Any] | None:
    row = db.leader()
    return row if row is not None and row["holder_instance"] and row["holder_instance"] != instance else None


def process_of(state: devstack.StackState, instance: str) -> ServiceProcess:
    for p in state.processes():
        if p.instance == instance:
            return p
    raise AssertionError(f"no process {instance} in the stack")


def api_without(state: devstack.StackState, *skip: ServiceProcess) -> Api:
    """A client of the api replicas except ``skip`` (a SIGSTOPped replica accepts
    connections but never answers, so round robin alone would stall on it)."""
    return Api(target_of([p.grpc for p in state.processes("api") if p not in skip]),
               token=state.tokens.get("admin", ""), ca_file=state.ca_file)


def log_has(proc: ServiceProcess, pattern: str) -> bool:
    try:
        text = Path(proc.log).read_text(errors="replace")
    except OSError:
        return False
    return re.search(pattern, text) is not None


def scrape(proc: ServiceProcess) -> str:
    with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
        return resp.read().decode()


def samples(text: str, name: str) -> list[dict[str, str]]:
    """Label sets of the samples of metric ``name`` in a Prometheus exposition."""
    out = []
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} \S+$", line)
        if m:
            out.append(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
        elif re.match(rf"^{re.escape(name)} \S+$", line):
            out.append({})
    return out


# ---------------------------------------------------------------- the NATS events stream


@dataclass
class StreamMsg:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]


def stream_messages(state: devstack.StackState, subject: str) -> list[StreamMsg]:
    """Every message stored in ``NOETL_EVENTS`` on ``subject``, oldest first (read by
    sequence, no consumer is created), read as the stack's NATS admin."""
    async def scan() -> list[StreamMsg]:
        nc = await state.nats_connect("test-scan")
        try:
            js = nc.jetstream()
            out: list[StreamMsg] = []
            seq = 1
            while True:
                try:
                    msg = await js.get_msg(natsio.EVENTS_STREAM, seq=seq, subject=subject, next=True)
                except NotFoundError:
                    return out
                assert msg.seq is not None
                out.append(StreamMsg(msg.seq, msg.subject or subject, msg.data or b"", dict(msg.headers or {})))
                seq = msg.seq + 1
        finally:
            await nc.close()

    return asyncio.run(scan())


def stream_publish(state: devstack.StackState, subject: str, data: bytes, msg_id: str) -> Any:
    """Publish one message to JetStream with ``Nats-Msg-Id = msg_id`` (as the stack's NATS
    admin); returns the PubAck (``duplicate`` is True when the stream's dedup window
    swallowed it)."""
    async def pub() -> Any:
        nc = await state.nats_connect("test-publish")
        try:
            return await natsio.publish(nc.jetstream(), subject, data, msg_id=msg_id)
        finally:
            await nc.close()

    return asyncio.run(pub())
