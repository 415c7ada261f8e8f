"""The worker service with the api's real WorkerService (Claims over Postgres) on an
in-process gRPC server, and real NATS: a cursor slot whose worker is stopped in the
middle of a row is re-issued and resumes with that row; the row was recorded with
RenewLease before its claim committed; a cancel hint stops a running command; a claim
whose answer was lost (the api replica died after committing it) is claimed again by
the same worker and runs once, and duplicate notices of an attempt run nothing."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import nats
import psycopg
import pytest
from credhelp import put_credentials, sealing_keyring
from psycopg_pool import AsyncConnectionPool
from waiting import until

from noetl_api.catalog import Catalog
from noetl_api.claims import Claimed, Claims
from noetl_api.credentials import CredentialStore
from noetl_api.grants import CredentialGrants
from noetl_api.servicers import WorkerServicer
from noetl_common import grpcutil, natsio
from noetl_common.config import CommandSettings, CoreSettings, ShardSettings, WorkerSettings
from noetl_common.db import make_pool
from noetl_common.errors import Conflict, NotFound
from noetl_proto.v1 import messages_pb2, worker_pb2, worker_pb2_grpc
from noetl_store import envelope_from_proto
from noetl_worker.service import WorkerService

pytestmark = pytest.mark.integration

CRED = "cursor_service_pg"
SHARD = 6
_ids = itertools.count(1)


class StandaloneWorker(WorkerService):
    joins = False  # no shard-manager in this test


class RecordingServicer(WorkerServicer):
    """The real servicer; each progress report also records what another session sees
    of the reported row at that moment (the claim must not have committed yet)."""

    def __init__(self, claims: Claims, dsn: str, table: Callable[[], str],
                 grants: CredentialGrants | None = None) -> None:
        super().__init__(claims, grants)
        self.dsn = dsn
        self.table = table
        self.progress: list[tuple[int, str]] = []
        self.lose_answer_once: set[str] = set()
        self.claim_calls: list[str] = []

    async def ClaimCommand(self, request: worker_pb2.ClaimCommandRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ClaimCommandResponse:
        """The real claim; for a command in ``lose_answer_once`` it commits and then the
        answer is lost, as when the api replica dies mid-call."""
        self.claim_calls.append(request.command_id)
        response = await super().ClaimCommand(request, context)
        if request.command_id in self.lose_answer_once:
            self.lose_answer_once.discard(request.command_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica died after committing the claim")
        return response

    async def RenewLease(self, request: worker_pb2.RenewLeaseRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.RenewLeaseResponse:
        if request.progress_json:
            row = json.loads(request.progress_json)["row"]
            async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                cur = await conn.execute(f"SELECT status FROM {self.table()} WHERE id = %s", (row["id"],))
                found = await cur.fetchone()
            self.progress.append((row["id"], found[0] if found else "missing"))
        return await super().RenewLease(request, context)


class Stack:
    def __init__(self, pg_dsn: str, nats_url: str, pool: AsyncConnectionPool, servicer: RecordingServicer,
                 target: str, nc: Any, results: asyncio.Queue[Any]) -> None:
        self.pg_dsn, self.nats_url, self.pool = pg_dsn, nats_url, pool
        self.servicer, self.target, self.nc, self.results = servicer, target, nc, results
        self.table = ""

    async def start_worker(self, instance: str) -> tuple[WorkerService, asyncio.Future[Any]]:
        core = CoreSettings(postgres_dsn=self.pg_dsn, nats_url=self.nats_url, api_target=self.target,
                            instance=instance, shutdown_grace_sec=1.5)
        svc = StandaloneWorker(core, ShardSettings(), CommandSettings(lease_sec=1.5),
                               WorkerSettings(concurrency=1, python_pool=1))
        running = asyncio.ensure_future(svc.run())
        await until(lambda: len(svc._slots) == 1 or running.done(), timeout=30, what=f"{instance}'s slot",
                    interval=0.02)
        assert not running.done()
        return svc, running

    async def notify(self, command_id: str, execution_id: int, attempt: int, kind: str = "cursor") -> None:
        notice = messages_pb2.CommandNotice(command_id=command_id, execution_id=execution_id, shard_id=SHARD,
                                            attempt=attempt, kind=kind)
        await natsio.publish(self.nc.jetstream(), natsio.commands_subject('default', 'normal', SHARD), notice.SerializeToString(),
                             msg_id=f"{command_id}#{attempt}")

    async def result_for(self, command_id: str, limit: float = 20) -> messages_pb2.CallResult:
        async with asyncio.timeout(limit):
            while True:
                msg = await self.results.get()
                if msg.call_result.command_id == command_id:
                    return msg.call_result

    async def sql(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(self.pg_dsn, autocommit=True) as conn:
            cur = await conn.execute(statement, params)
            return list(await cur.fetchall()) if cur.description else []


@pytest.fixture
async def stack(pg_dsn: str, nats_url: str) -> AsyncIterator[Stack]:
    pool = make_pool(pg_dsn, min_size=1, max_size=4, name="test-cursor-service")
    await pool.open(wait=True, timeout=30)
    await put_credentials(pool, {CRED: ("postgres", {"dsn": pg_dsn})})
    holder: list[Stack] = []
    catalog = Catalog(pool)
    claims = Claims(pool, catalog, lease_sec=30)
    # the api's credential path as it runs: the worker asks GetCredential for its claims
    grants = CredentialGrants(claims, catalog, CredentialStore(pool, sealing_keyring()))
    servicer = RecordingServicer(claims, pg_dsn, lambda: holder[0].table, grants)
    server = grpc.aio.server(interceptors=[grpcutil.ErrorInterceptor()])
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    nc = await nats.connect(nats_url)
    await natsio.ensure_streams(nc.jetstream())  # the api's part: workers wait for the streams
    results: asyncio.Queue[Any] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        results.put_nowait(messages_pb2.EngineInput.FromString(msg.data))

    await nc.subscribe("noetl.events.*.call", cb=on_event)
    holder.append(Stack(pg_dsn, nats_url, pool, servicer, f"127.0.0.1:{port}", nc, results))
    yield holder[0]
    await nc.drain()
    await server.stop(0)
    await pool.close()


PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: cursor_resume
  path: tests/cursor_resume_{n}
workflow:
  - step: drain
    loop:
      iterator: row
      cursor:
        kind: postgres
        auth: {cred}
        claim: "{claim}"
      spec:
        mode: cursor
        max_in_flight: 1
    tool:
      - name: gate
        kind: python
        input:
          row_id: "{{{{ row.id }}}}"
          flag: "{flag}"
        code: |
          import os, time
          while row_id == 3 and not os.path.exists(flag):
              time.sleep(0.02)
          result = row_id
      - name: save
        kind: postgres
        auth: {cred}
        command: "INSERT INTO {sink} (id) VALUES ({{{{ row.id }}}}) ON CONFLICT (id) DO UPDATE SET hits = {sink}.hits + 1"
"""


async def test_a_killed_slot_resumes_with_the_row_it_had_claimed(stack: Stack, tmp_path: Path) -> None:
    n = next(_ids)
    table, sink = f"public.cursor_resume_work_{n}", f"public.cursor_resume_sink_{n}"
    stack.table = table
    await stack.sql(f"DROP TABLE IF EXISTS {table}; DROP TABLE IF EXISTS {sink}")
    await stack.sql(f"CREATE TABLE {table} (id int PRIMARY KEY, status text NOT NULL DEFAULT 'pending')")
    await stack.sql(f"INSERT INTO {table} (id) SELECT generate_series(1, 5)")
    await stack.sql(f"CREATE TABLE {sink} (id int PRIMARY KEY, hits int NOT NULL DEFAULT 1, seq bigserial)")
    claim = (f"UPDATE {table} SET status = 'claimed' WHERE id = (SELECT id FROM {table} WHERE status = 'pending' "
             "ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id")
    flag = tmp_path / "resume-flag"
    content = PLAYBOOK.format(n=n, cred=CRED, claim=claim, flag=flag, sink=sink)
    entry, _ = await Catalog(stack.pool).register(content)

    execution_id = 9_300_000_000 + n
    command_id = f"{execution_id}:drain:1:0"
    context = {"ctx": {}, "steps": {}, "event": {"name": "step.enter", "step": "drain"}, "iter": None,
               "loop": {"instance": "drain:1", "index": 0, "iterator": "row", "mode": "cursor"},
               "cursor": {"kind": "postgres", "auth": CRED, "claim": claim, "options": {}}}
    await stack.sql("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload, timeout_sec)"
                    " VALUES (%s, %s, %s, '{}', 60)", (execution_id, SHARD, entry.catalog_id))
    await stack.sql("INSERT INTO noetl.command (command_id, execution_id, shard_id, catalog_id, step, kind, status,"
                    " attempt, context) VALUES (%s, %s, %s, %s, 'drain', 'cursor', 'queued', 1, %s)",
                    (command_id, execution_id, SHARD, entry.catalog_id, json.dumps(context)))

    # Attempt 1 runs rows 1 and 2, claims row 3 and hangs in it; its worker is stopped.
    first, running = await stack.start_worker(f"cursor-w1-{n}")
    await stack.notify(command_id, execution_id, 1)
    await until(lambda: (3, "pending") in stack.servicer.progress, timeout=30, what="row 3's progress",
                interval=0.02)

    async def row_3_claimed() -> bool:  # the claim of row 3 commits; its gate task hangs
        return await stack.sql(f"SELECT status FROM {table} WHERE id = 3") == [("claimed",)]

    await until(row_3_claimed, timeout=20, what="the claim of row 3 committed", interval=0.02)
    progress = await stack.sql("SELECT progress FROM noetl.command WHERE command_id = %s", (command_id,))
    # recorded before that commit, with the slot's counts before the row (rows 1 and 2)
    assert progress == [({"row": {"id": 3}, "counts": {"processed": 2, "succeeded": 2, "failed": 0}},)]
    first.request_stop()
    await asyncio.wait_for(running, timeout=20)
    assert await stack.sql(f"SELECT id FROM {sink} ORDER BY id") == [(1,), (2,)]
    assert await stack.sql(f"SELECT status FROM {table} WHERE id = 3") == [("claimed",)]

    # The reaper's re-issue: queued again as attempt 2; the claim hands back the row.
    await stack.sql("UPDATE noetl.command SET status = 'queued', attempt = 2, worker_id = NULL"
                    " WHERE command_id = %s", (command_id,))
    flag.write_text("go")
    second, running = await stack.start_worker(f"cursor-w2-{n}")
    try:
        await stack.notify(command_id, execution_id, 2)
        result = await stack.result_for(command_id)
    finally:
        second.request_stop()
        await asyncio.wait_for(running, timeout=20)
    env = envelope_from_proto(result.envelope)
    assert result.attempt == 2 and env["status"] == "ok", env
    # attempt 2 ran rows 3, 4 and 5 and took over attempt 1's counts: the slot counts all 5
    assert env["context"] == {"processed": 5, "succeeded": 5, "failed": 0}
    assert await stack.sql(f"SELECT id, hits FROM {sink} ORDER BY seq") == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]
    # Every claimed row was recorded while its claim was still uncommitted.
    assert stack.servicer.progress == [(1, "pending"), (2, "pending"), (3, "pending"), (4, "pending"),
                                       (5, "pending")]


async def queue_python_command(stack: Stack, name: str, code: str, n: int) -> tuple[str, int]:
    """Register a one-step python playbook and queue its command (attempt 1) as the engine would."""
    content = f"""
apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: {name}
  path: tests/{name}_{n}
workflow:
  - step: run
    tool:
      kind: python
      code: "{code}"
"""
    entry, _ = await Catalog(stack.pool).register(content)
    execution_id = 9_500_000_000 + n
    command_id = f"{execution_id}:run:1"
    await stack.sql("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload, timeout_sec)"
                    " VALUES (%s, %s, %s, '{}', 60)", (execution_id, SHARD, entry.catalog_id))
    await stack.sql("INSERT INTO noetl.command (command_id, execution_id, shard_id, catalog_id, step, kind, status,"
                    " attempt, context) VALUES (%s, %s, %s, %s, 'run', 'python', 'queued', 1, %s)",
                    (command_id, execution_id, SHARD, entry.catalog_id,
                     json.dumps({"ctx": {}, "steps": {}, "event": {}, "iter": None})))
    return command_id, execution_id


async def test_a_cancel_hint_stops_a_running_command(stack: Stack) -> None:
    n = next(_ids)
    command_id, execution_id = await queue_python_command(
        stack, "cancel_hint", "import time; time.sleep(60); result = 'never'", n)
    worker, running = await stack.start_worker(f"cancel-w-{n}")
    try:
        await stack.notify(command_id, execution_id, 1, kind="python")
        await until(lambda: command_id in worker._runs, timeout=20, what="the command running", interval=0.02)
        run = worker._runs[command_id]
        await stack.nc.publish(f"noetl.cancel.{SHARD}", json.dumps({"command_ids": ["other", command_id]}).encode())
        # well before the 60 s sleep or a renewal stop
        await until(lambda: command_id not in worker._runs, timeout=5, what="the command stopped", interval=0.02)
        assert run.stop_reason == "cancelled" and run.cancelled.is_set()
        await stack.nc.flush()
        assert all(m.call_result.command_id != command_id for m in drain(stack.results))
    finally:
        worker.request_stop()
        await asyncio.wait_for(running, timeout=20)


def drain(queue: asyncio.Queue[Any]) -> list[Any]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


async def test_a_claim_whose_answer_was_lost_is_claimed_again_and_runs_once(stack: Stack) -> None:
    n = next(_ids)
    command_id, execution_id = await queue_python_command(stack, "lost_claim_answer", "result = 42", n)
    stack.servicer.lose_answer_once.add(command_id)
    worker, running = await stack.start_worker(f"lost-answer-w-{n}")
    try:
        await stack.notify(command_id, execution_id, 1, kind="python")
        # The first claim committed but its answer never arrived: the worker claims the
        # same attempt again and gets it back (no lease expiry, no re-issue).
        result = await stack.result_for(command_id)
        assert result.attempt == 1 and envelope_from_proto(result.envelope)["context"] == {"value": 42}
        assert stack.servicer.claim_calls.count(command_id) == 2
        assert await stack.sql("SELECT status, attempt, worker_id FROM noetl.command WHERE command_id = %s",
                               (command_id,)) == [("claimed", 1, f"lost-answer-w-{n}")]
        # A late duplicate notice of the same attempt (a republish under another Msg-Id)
        # is claimed again by the same worker (the row is still claimed: no engine here)
        # and dropped by the worker: the command does not run twice.
        await natsio.publish(stack.nc.jetstream(), natsio.commands_subject('default', 'normal', SHARD), messages_pb2.CommandNotice(
            command_id=command_id, execution_id=execution_id, shard_id=SHARD, attempt=1,
            kind="python").SerializeToString(), msg_id=f"{command_id}#1#r-test")
        await until(lambda: stack.servicer.claim_calls.count(command_id) == 3, timeout=10,
                    what="the duplicate notice claimed", interval=0.02)
        await asyncio.sleep(0.3)  # a sleep, not a wait: time for a second run's result to wrongly show
        await stack.nc.flush()
        assert all(m.call_result.command_id != command_id for m in drain(stack.results))
    finally:
        worker.request_stop()
        await asyncio.wait_for(running, timeout=20)


async def test_claims_are_idempotent_only_for_the_same_worker_and_attempt(stack: Stack) -> None:
    n = next(_ids)
    command_id, _ = await queue_python_command(stack, "claim_idempotent", "result = 1", n)
    claims = Claims(stack.pool, Catalog(stack.pool), lease_sec=30)
    # one call asking twice for the same command gets it once
    first, twice = await claims.claim_many([(command_id, 1), (command_id, 1)], "w-a")
    assert isinstance(first, Claimed) and first.row["worker_id"] == "w-a"
    assert isinstance(twice, Conflict) and "asked for twice" in str(twice)
    # the same worker and attempt again: given back (its first answer may have been lost)
    again = await claims.claim(command_id, "w-a", 1)
    assert again.row["command_id"] == command_id and again.row["attempt"] == 1
    # another worker, or another attempt: not claimable, and the message says who has it
    with pytest.raises(Conflict, match=r"claimed .*attempt 1.*worker w-a"):
        await claims.claim(command_id, "w-b", 1)
    with pytest.raises(Conflict, match="not claimable as attempt 2"):
        await claims.claim(command_id, "w-a", 2)
    # a command that moved on (re-issued as attempt 2) is not given back for attempt 1
    await stack.sql("UPDATE noetl.command SET status = 'queued', attempt = 2, worker_id = NULL"
                    " WHERE command_id = %s", (command_id,))
    with pytest.raises(Conflict):
        await claims.claim(command_id, "w-a", 1)
    assert (await claims.claim(command_id, "w-b", 2)).row["worker_id"] == "w-b"
    with pytest.raises(NotFound):
        await claims.claim(f"{command_id}-missing", "w-a", 1)
