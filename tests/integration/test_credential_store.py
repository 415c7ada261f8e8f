"""Credentials against a real Postgres: rows hold no plaintext (SQL shows it), legacy
plaintext rows are sealed and old keys re-wrapped at api start, an api without the key
refuses to start; and WorkerService.GetCredential over a real gRPC server answers only
the worker holding the claim of that attempt, only for names the command's step may read."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from credhelp import TEST_KEYS, put_credentials, sealing_keyring

from noetl_api.catalog import Catalog
from noetl_api.claims import Claims
from noetl_api.credentials import CredentialStore
from noetl_api.grants import CredentialGrants
from noetl_api.keyring import Keyring, generate_key
from noetl_api.servicers import WorkerServicer
from noetl_common import auth, grpcutil
from noetl_common.db import Pool
from noetl_common.errors import ConfigError, Conflict, NotFound, Unavailable
from noetl_proto.v1 import worker_pb2, worker_pb2_grpc
from noetl_worker.tools import Holder, api_fetch
from noetl_worker.tools.credentials import CredentialDenied

pytestmark = pytest.mark.integration

SECRET = "pg-S3cret-integration"
_ids = itertools.count(1)


async def rows(pool: Pool, sql: str, params: Any = None) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        return list(await cur.fetchall())


async def plaintext_anywhere(pool: Pool, secret: str) -> list[str]:
    """Names of credential rows whose stored form (every column, as text) holds ``secret``."""
    found = await rows(pool, "SELECT name FROM noetl.credential c WHERE row_to_json(c)::text LIKE %s"
                             " OR position(convert_to(%s, 'UTF8') IN coalesce(ciphertext, ''::bytea)) > 0"
                             " OR position(convert_to(%s, 'UTF8') IN coalesce(wrapped_key, ''::bytea)) > 0",
                       (f"%{secret}%", secret, secret))
    return [r["name"] for r in found]


async def test_stored_rows_hold_no_plaintext(pool: Pool) -> None:
    await put_credentials(pool, {"it_pg": ("postgres", {"dsn": f"host=db password={SECRET}"}),
                                 "it_bearer": ("http_bearer", {"token": SECRET + "-tok"})})
    stored = await rows(pool, "SELECT name, kind, data, key_id, length(ciphertext) AS n FROM noetl.credential"
                              " WHERE name IN ('it_pg', 'it_bearer') ORDER BY name")
    assert [(r["name"], r["kind"], r["data"], r["key_id"]) for r in stored] == [
        ("it_bearer", "http_bearer", None, "itest"), ("it_pg", "postgres", None, "itest")]
    assert all(r["n"] > 16 for r in stored)
    assert await plaintext_anywhere(pool, SECRET) == []
    store = CredentialStore(pool, sealing_keyring())
    assert (await store.get("it_pg")).data == {"dsn": f"host=db password={SECRET}"}
    assert SECRET not in repr(await store.get("it_pg"))
    assert {r["name"] for r in await store.names()} >= {"it_pg", "it_bearer"}
    assert "data" not in (await store.names())[0]
    with pytest.raises(NotFound, match="credential 'nope' not found"):
        await store.get("nope")


async def test_an_api_without_keys_stores_nothing(pool: Pool) -> None:
    with pytest.raises(Conflict, match="no NOETL_CREDENTIALS_KEYS"):
        await CredentialStore(pool, Keyring.parse("")).put("it_nokey", "generic", {"value": "v4lue"})
    assert await rows(pool, "SELECT 1 FROM noetl.credential WHERE name = 'it_nokey'") == []


async def test_start_seals_legacy_rows_and_rewraps_old_keys(pool: Pool) -> None:
    """The migration plan: plaintext rows written before 0007 are sealed by the first api
    that starts with a key; a new primary key re-wraps every row; keys are checked."""
    old = sealing_keyring()
    # a row written before migration 0007 (plaintext data, no sealed columns)
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM noetl.credential WHERE name = 'it_legacy'")
        await conn.execute("INSERT INTO noetl.credential (name, kind, data) VALUES ('it_legacy', 'postgres', %s)",
                           (json.dumps({"dsn": f"host=legacy password={SECRET}-legacy"}),))
    assert await plaintext_anywhere(pool, f"{SECRET}-legacy") == ["it_legacy"]
    with pytest.raises(ConfigError, match="NOETL_CREDENTIALS_KEYS is not set, but the runtime database holds"):
        await CredentialStore(pool, Keyring.parse("")).prepare()
    report = await CredentialStore(pool, old).prepare()
    assert report.sealed >= 1 and report.rewrapped == 0
    assert await rows(pool, "SELECT count(*) AS n FROM noetl.credential WHERE data IS NOT NULL") == [{"n": 0}]
    assert await plaintext_anywhere(pool, f"{SECRET}-legacy") == []
    assert (await CredentialStore(pool, old).get("it_legacy")).data == {"dsn": f"host=legacy password={SECRET}-legacy"}

    # rotation: a new primary in front of the old key; every row moves to it
    new_key = generate_key()
    rotated = Keyring.parse(f"itest2:{new_key},{TEST_KEYS}")
    report = await CredentialStore(pool, rotated).prepare()
    assert report.rewrapped == report.total and report.sealed == 0
    assert await rows(pool, "SELECT DISTINCT key_id FROM noetl.credential") == [{"key_id": "itest2"}]
    only_new = Keyring.parse(f"itest2:{new_key}")
    assert (await CredentialStore(pool, only_new).get("it_legacy")).data["dsn"].startswith("host=legacy")
    with pytest.raises(ConfigError, match="'itest2', which is not in NOETL_CREDENTIALS_KEYS"):
        await CredentialStore(pool, old).prepare()  # the old key alone cannot serve them now
    with pytest.raises(ConfigError, match="does not unwrap with key 'itest2'"):
        await CredentialStore(pool, Keyring.parse(f"itest2:{generate_key()}")).prepare()  # other material, same id

    # back to the session's key (other modules open rows with it)
    back = Keyring.parse(f"{TEST_KEYS},itest2:{new_key}")
    assert (await CredentialStore(pool, back).prepare()).rewrapped == report.total
    assert await rows(pool, "SELECT DISTINCT key_id FROM noetl.credential") == [{"key_id": "itest"}]


def test_the_api_refuses_to_start_without_the_key(pg_dsn: str, nats_url: str) -> None:
    """A real api process: the runtime database holds credentials, NOETL_CREDENTIALS_KEYS is
    unset: it exits 2 naming the setting before it serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    env.update(NOETL_POSTGRES_DSN=pg_dsn, NOETL_NATS_URL=nats_url, NOETL_SHARD_MANAGER_TARGET="127.0.0.1:1",
               NOETL_GRPC_LISTEN="127.0.0.1:0", NOETL_METRICS_LISTEN="127.0.0.1:0")
    run = subprocess.run([sys.executable, "-m", "noetl_api"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "NOETL_CREDENTIALS_KEYS is not set, but the runtime database holds" in run.stdout + run.stderr
    env["NOETL_CREDENTIALS_KEYS"] = "bad"
    run = subprocess.run([sys.executable, "-m", "noetl_api"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "NOETL_CREDENTIALS_KEYS: entry 1 is not ID:BASE64KEY" in run.stdout + run.stderr


# ---------------------------------------------------------------- GetCredential

PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: grants, path: tests/grants_{n}}}
workload: {{db: it_grant_a}}
keychain:
  - name: tenant_b
    credential: it_grant_b
workflow:
  - step: start
    tool: {{kind: postgres, auth: "{{{{ workload.db }}}}", command: "select 1"}}
    next: [{{step: dyn}}]
  - step: dyn
    tool: {{kind: postgres, auth: "{{{{ ctx.which }}}}", command: "select 1"}}
    next: [{{step: end}}]
  - step: end
    tool: {{kind: noop}}
"""


class Api:
    def __init__(self, pool: Pool, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        self.pool, self.stub = pool, stub

    async def execution(self, payload: dict[str, Any] | None = None) -> int:
        n = next(_ids)
        entry, _ = await Catalog(self.pool).register(PLAYBOOK.format(n=n))
        eid = 9_400_000_000 + n
        async with self.pool.connection() as conn:
            await conn.execute("INSERT INTO noetl.execution_request (execution_id, shard_id, catalog_id, payload,"
                               " timeout_sec) VALUES (%s, 0, %s, %s, 60)", (eid, entry.catalog_id,
                                                                           json.dumps(payload or {})))
            for step, status, attempt, worker in (("start", "claimed", 1, "w1"), ("dyn", "claimed", 2, "w1"),
                                                  ("end", "queued", 1, None)):
                await conn.execute(
                    "INSERT INTO noetl.command (command_id, execution_id, shard_id, catalog_id, step, kind, status,"
                    " attempt, worker_id, context) VALUES (%s, %s, 0, %s, %s, 'postgres', %s, %s, %s, '{}')",
                    (f"{eid}:{step}:1", eid, entry.catalog_id, step, status, attempt, worker))
        return eid

    async def ask(self, command_id: str, name: str, *, worker: str = "w1", attempt: int = 1) -> Any:
        return await self.stub.GetCredential(worker_pb2.GetCredentialRequest(
            command_id=command_id, attempt=attempt, worker_id=worker, name=name), timeout=10)

    async def code(self, command_id: str, name: str, **kw: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await self.ask(command_id, name, **kw)
        return exc.value.code()


@pytest.fixture(scope="module")
async def api(pool: Pool) -> AsyncIterator[Api]:
    await put_credentials(pool, {name: ("postgres", {"dsn": f"host={name} password={SECRET}-{name}"})
                                 for name in ("it_grant_a", "it_grant_b", "it_grant_c", "it_grant_other")})
    catalog = Catalog(pool)
    claims = Claims(pool, catalog, lease_sec=30)
    grants = CredentialGrants(claims, catalog, CredentialStore(pool, sealing_keyring()))
    server = grpc.aio.server(interceptors=[grpcutil.ErrorInterceptor()])
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(claims, grants), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpcutil.channel(f"127.0.0.1:{port}")
    yield Api(pool, worker_pb2_grpc.WorkerServiceStub(channel))
    await channel.close()
    await server.stop(0)


async def test_the_holder_of_the_claim_gets_what_its_step_names(api: Api) -> None:
    eid = await api.execution()
    got = await api.ask(f"{eid}:start:1", "it_grant_a")
    assert (got.name, got.kind) == ("it_grant_a", "postgres")
    assert json.loads(got.data_json) == {"dsn": f"host=it_grant_a password={SECRET}-it_grant_a"}
    # a payload that chooses another credential: the step reads that one, not the default
    other = await api.execution({"db": "it_grant_c"})
    assert (await api.ask(f"{other}:start:1", "it_grant_c")).name == "it_grant_c"
    assert await api.code(f"{other}:start:1", "it_grant_a") == grpc.StatusCode.PERMISSION_DENIED


async def test_no_claim_no_credential(api: Api) -> None:
    eid = await api.execution()
    assert await api.code(f"{eid}:start:1", "it_grant_a", worker="w2") == grpc.StatusCode.FAILED_PRECONDITION
    assert await api.code(f"{eid}:start:1", "it_grant_a", attempt=2) == grpc.StatusCode.FAILED_PRECONDITION
    assert await api.code(f"{eid}:dyn:1", "it_grant_a", attempt=1) == grpc.StatusCode.FAILED_PRECONDITION
    assert await api.code(f"{eid}:end:1", "it_grant_a") == grpc.StatusCode.FAILED_PRECONDITION  # queued
    assert await api.code(f"{eid}:nope:1", "it_grant_a") == grpc.StatusCode.NOT_FOUND
    async with api.pool.connection() as conn:  # the claim moves on (re-issued): the old holder gets nothing
        await conn.execute("UPDATE noetl.command SET status = 'queued', attempt = 2, worker_id = NULL"
                           " WHERE command_id = %s", (f"{eid}:start:1",))
    assert await api.code(f"{eid}:start:1", "it_grant_a") == grpc.StatusCode.FAILED_PRECONDITION
    assert await api.code(f"{eid}:start:1", "it_grant_a", attempt=2) == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await api.stub.GetCredential(worker_pb2.GetCredentialRequest(command_id=f"{eid}:start:1"), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_claim_token_proves_the_holder(api: Api) -> None:
    """With the api's claim key (as it runs), naming oneself as the holder is not enough:
    the request must carry the token the claim answer gave that worker."""
    eid = await api.execution()
    key = b"k" * 32
    catalog = Catalog(api.pool)
    grants = CredentialGrants(Claims(api.pool, catalog, 30, key), catalog, CredentialStore(api.pool, sealing_keyring()))
    command_id = f"{eid}:start:1"
    good = auth.claim_token(key, command_id, 1, "w1")
    assert (await grants.resolve(command_id, 1, "w1", "it_grant_a", good)).name == "it_grant_a"
    for token in ("", auth.claim_token(key, command_id, 1, "w2"), auth.claim_token(b"x" * 32, command_id, 1, "w1")):
        with pytest.raises(Conflict, match="the claim token does not match"):
            await grants.resolve(command_id, 1, "w1", "it_grant_a", token)


async def test_only_names_the_step_may_read(api: Api) -> None:
    eid = await api.execution()
    # `start` names {{ workload.db }} only: not the keychain entry, not any other credential
    for name in ("it_grant_b", "it_grant_other", "no_such_credential"):
        assert await api.code(f"{eid}:start:1", name) == grpc.StatusCode.PERMISSION_DENIED
    # `dyn` chooses at run time: whatever the playbook names (the keychain entry, start's), nothing else
    assert (await api.ask(f"{eid}:dyn:1", "it_grant_b", attempt=2)).name == "it_grant_b"
    assert (await api.ask(f"{eid}:dyn:1", "it_grant_a", attempt=2)).name == "it_grant_a"
    assert await api.code(f"{eid}:dyn:1", "it_grant_other", attempt=2) == grpc.StatusCode.PERMISSION_DENIED
    # a name the step may read that does not exist
    missing = await api.execution({"db": "it_grant_missing"})
    assert await api.code(f"{missing}:start:1", "it_grant_missing") == grpc.StatusCode.NOT_FOUND


async def test_the_worker_side_translation(api: Api) -> None:
    """What the worker's credential access makes of each answer (tools map these to
    CREDENTIAL_NOT_PERMITTED, CREDENTIAL_NOT_FOUND, a lost claim)."""
    eid = await api.execution()
    fetch = api_fetch(api.stub, "w1", retry_sec=1)
    holder = Holder(f"{eid}:start:1", 1, eid, "start")
    assert (await fetch(holder, "it_grant_a")).data["dsn"].startswith("host=it_grant_a")
    with pytest.raises(CredentialDenied, match="may not read credential 'it_grant_b'"):
        await fetch(holder, "it_grant_b")
    with pytest.raises(Conflict, match="not claimed by worker w2"):
        await api_fetch(api.stub, "w2", retry_sec=1)(holder, "it_grant_a")
    with pytest.raises(NotFound):
        await fetch(Holder(f"{eid}:nope:1", 1, eid, "nope"), "it_grant_a")


async def test_an_unreachable_api_is_waited_out_then_unavailable(api: Api) -> None:
    channel = grpcutil.channel("127.0.0.1:1")
    fetch = api_fetch(worker_pb2_grpc.WorkerServiceStub(channel), "w1", retry_sec=0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(Unavailable):
        await fetch(Holder("1:s:1", 1, 1, "s"), "it_grant_a")
    assert loop.time() - started >= 0.4
    await channel.close()
