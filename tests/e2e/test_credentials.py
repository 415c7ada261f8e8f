"""Credentials end to end, the roles as processes: a run that uses a postgres credential
(through ``auth`` and the keychain) and an http bearer credential (``auth``, and the
keychain in a URL), with a server that echoes the token back, an SQL error that quotes
the password, a python task that prints, logs to stderr, returns, sets and raises with
the token. Afterwards neither secret appears anywhere the runtime writes: every role's
log, the events (GetEvents and the table), results (GetExecution and the result store),
commands, the spans (jsonl exporter) and every role's metrics; the credential table holds
no plaintext. The masks are there instead (so nothing passed by not being written).
The bearer credential is added with ``noetl-rt credential add`` from stdin."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from chaos import stack_for
from harness import REPO, Runner
from psycopg import sql as pgsql
from waiting import until_sync

from noetl_client import values
from noetl_common.redact import MASK
from noetl_common.tracing import read_jsonl
from noetl_proto.v1 import catalog_pb2, execution_pb2

pytestmark = pytest.mark.e2e

TOKEN = "tok-" + secrets.token_hex(12)
PG_PASSWORD = "pgpw-" + secrets.token_hex(12)
SECRETS = (TOKEN, PG_PASSWORD)

PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: credentials_e2e, path: tests/credentials_e2e}
workload:
  pg_auth: e2e_pg
  api_url: "http://127.0.0.1:__PORT__"
keychain:
  - name: db
    credential: "{{ workload.pg_auth }}"
  - name: api
    credential: e2e_api
workflow:
  - step: start
    tool: {kind: postgres, auth: "{{ workload.pg_auth }}", query: "SELECT 41 + 1 AS answer"}
    next: [{step: leak_sql}]
  - step: leak_sql
    desc: an SQL error quoting the password
    tool: {kind: postgres, auth: "{{ workload.pg_auth }}", query: "SELECT '{{ keychain.db.password }}'::int AS n"}
    next:
      - step: call
        when: "{{ event.name == 'call.error' }}"
  - step: call
    desc: the server checks the bearer token and echoes it back
    tool: {kind: http, url: "{{ workload.api_url }}/echo", auth: e2e_api}
    next: [{step: fail_url}]
  - step: fail_url
    desc: an error message naming a URL that carries the token
    tool: {kind: http, url: "{{ workload.api_url }}/fail?t={{ keychain.api.token }}"}
    next:
      - step: py
        when: "{{ event.name == 'call.error' }}"
  - step: py
    tool:
      - name: use
        kind: python
        input: {t: "{{ keychain.api.token }}", pw: "{{ keychain.db.password }}"}
        code: |
          import sys
          print("stdout:", t, pw)
          print("stderr:", t, pw, file=sys.stderr, flush=True)
          result = {"token": t, "pw": pw, "len": len(t)}
        spec:
          policy:
            rules:
              - else: {then: {do: continue, set: {ctx.copied: "{{ output.data.token }}"}}}
      - name: boom
        kind: python
        input: {t: "{{ keychain.api.token }}"}
        code: "raise RuntimeError('refused token ' + t)"
    next:
      - step: end
        when: "{{ event.name == 'call.error' }}"
  - step: end
    tool: {kind: noop}
"""


class EchoServer:
    """Requires ``Authorization: Bearer TOKEN`` on /echo (401 otherwise) and echoes it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization") or ""
                outer.seen.append(auth)
                if self.path.startswith("/echo"):
                    code = 200 if auth == f"Bearer {TOKEN}" else 401
                    body = json.dumps({"authorization": auth, "ok": code == 200}).encode()
                else:
                    code, body = 500, f"refused {self.path}".encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def spans_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="noetl-cred-spans-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def runner(spans_dir: Path) -> Iterator[Runner]:
    env = {"NOETL_OTEL_EXPORTER": "jsonl", "NOETL_OTEL_FILE": str(spans_dir / "{role}-{pid}.jsonl"),
           "NOETL_LOG_LEVEL": "DEBUG"}  # the most the roles ever write
    with stack_for("credentials", {}, env) as r:
        yield r


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def add_credentials(runner: Runner) -> None:
    dsn = runner.state.postgres_dsn
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(dsn)
    # a user of the stack's Postgres (SCRAM over verify-full TLS) whose password is PG_PASSWORD
    with psycopg.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'e2e_pg_user'").fetchone()
        conn.execute(pgsql.SQL("{} ROLE e2e_pg_user LOGIN PASSWORD {}").format(
            pgsql.SQL("ALTER" if exists else "CREATE"), pgsql.Literal(PG_PASSWORD)))
    fields = {"host": parts.get("host"), "port": parts.get("port"), "user": "e2e_pg_user",
              "dbname": parts.get("dbname"), "password": PG_PASSWORD, "sslmode": parts.get("sslmode"),
              "sslrootcert": parts.get("sslrootcert")}
    runner.api.credentials.PutCredential(catalog_pb2.PutCredentialRequest(
        name="e2e_pg", kind="postgres", data=values.to_struct(fields)), timeout=10)
    # the CLI, reading the token from stdin: it never is in the process's arguments
    env = {**os.environ, "NOETL_API": runner.state.api, "NOETL_TOKEN": runner.state.tokens.get("admin", ""),
           "NOETL_TLS_CA_FILE": runner.state.ca_file}
    added = subprocess.run([sys.executable, "-m", "noetl_cli", "credential", "add", "e2e_api", "--kind",
                            "http_bearer"], input=TOKEN + "\n", capture_output=True, text=True, timeout=60,
                           env=env, cwd=str(REPO))
    assert added.returncode == 0 and added.stdout.strip() == "credential e2e_api created", added.stderr
    refused = subprocess.run([sys.executable, "-m", "noetl_cli", "credential", "add", "x", "--kind", "http_bearer",
                              TOKEN], capture_output=True, text=True, timeout=60, env=env, cwd=str(REPO))
    assert refused.returncode == 2 and "not accepted on the command line" in refused.stderr
    assert TOKEN not in refused.stderr + refused.stdout


def found_in(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def test_a_run_with_credentials_leaves_no_secret_behind(runner: Runner, echo: EchoServer, spans_dir: Path) -> None:
    add_credentials(runner)
    listed = runner.api.credentials.ListCredentials(catalog_pb2.ListCredentialsRequest(), timeout=10)
    assert {"e2e_pg", "e2e_api"} <= {c.name for c in listed.credentials}
    assert found_in(str(listed)) == []

    out = runner.run(PLAYBOOK.replace("__PORT__", str(echo.port)), timeout=120)
    assert out.status == "COMPLETED", (out.error, out.steps)
    # the credentials did their work
    assert out.result("start")["rows"] == [{"answer": 42}]
    assert echo.seen[0] == f"Bearer {TOKEN}"  # the http tool authenticated with the stored token
    assert out.steps["leak_sql"]["status"] == "FAILED" and "invalid input syntax" in out.steps["leak_sql"]["error"]
    assert out.result("call")["data"] == {"authorization": MASK, "ok": True}  # echoed back: masked
    py = out.steps["py"]
    assert py["status"] == "FAILED" and f"refused token {MASK}" in py["error"]
    eid = out.execution_id

    # ---- nowhere: results, events, commands, the result store, the credential table
    results = runner.api.executions.GetExecution(execution_pb2.GetExecutionRequest(
        execution_id=eid, include_results=True), timeout=10)
    assert found_in(str(results)) == [] and MASK in str(results)
    events = runner.events(eid)
    assert found_in("".join(json.dumps(values.from_struct(e.result)) + json.dumps(values.from_struct(e.meta)) for e in events)) == []
    tables = {
        "event": "SELECT e::text FROM noetl.event e WHERE execution_id = %s",
        "command": "SELECT c::text FROM noetl.command c WHERE execution_id = %s",
        "engine_state": "SELECT s::text FROM noetl.engine_state s WHERE execution_id = %s",
        "execution": "SELECT x::text FROM noetl.execution x WHERE execution_id = %s",
        "execution_step": "SELECT x::text FROM noetl.execution_step x WHERE execution_id = %s",
        "result_payload": "SELECT p::text FROM noetl.result_payload p JOIN noetl.result_ref r USING (ref_id)"
                          " WHERE r.execution_id = %s",
    }
    for table, sql in tables.items():
        text = "".join(str(r[0]) for r in runner.sql(sql, (eid,)))
        assert text and found_in(text) == [], table
    stored = "".join(str(r[0]) for r in runner.sql("SELECT c::text FROM noetl.credential c"))
    assert found_in(stored) == [] and runner.sql("SELECT count(*) FROM noetl.credential WHERE data IS NOT NULL") == \
        [(0,)]

    # ---- nowhere in what the processes wrote: spans, logs, metrics
    def worker_spans() -> list[dict[str, Any]]:
        spans = read_jsonl(sorted(spans_dir.glob("*.jsonl")))
        runs = [s for s in spans if s["name"].startswith("tool.run")
                and s["attributes"].get("noetl.execution_id") == eid]
        return spans if len(runs) >= 7 else []

    spans = until_sync(worker_spans, timeout=30, what="the tool.run spans of every task")
    span_text = json.dumps(spans)
    assert found_in(span_text) == [] and MASK in span_text  # error statuses carry the masked messages
    logs = {p.instance: Path(p.log).read_text(errors="replace") for p in runner.state.processes()}
    for instance, text in logs.items():
        assert found_in(text) == [], f"secret in the log of {instance}"
    worker = "".join(text for name, text in logs.items() if name.startswith("worker"))
    assert f"stderr: {MASK} {MASK}" in worker  # the python task's stderr went through the masking filter
    for proc in runner.state.processes():
        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
            assert found_in(resp.read().decode()) == [], proc.instance
