"""A command's credentials inside one worker process: keychain entries render where the
task needs them, and the values are masked in everything the command reports (results,
errors, stdout, ctx updates, the worker's log, a python task's stderr)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from waiting import until

from noetl_common.errors import NotFound
from noetl_common.redact import MASK, ActiveSecrets, LogFilter, Redactor
from noetl_proto.v1 import messages_pb2
from noetl_store import MemoryResultStore, envelope_from_proto
from noetl_worker.runner import execute_command
from noetl_worker.tools import Credentials, Holder, PythonPool, StoredCredential, Tools
from noetl_worker.tools.credentials import CredentialDenied

TOKEN = "kc-t0ken-9f8e7d"
asked: list[tuple[Holder, str]] = []


async def fetch(holder: Holder, name: str) -> StoredCredential:
    asked.append((holder, name))
    if name == "api_token":
        return StoredCredential(name, "http_bearer", {"token": TOKEN})
    if name == "forbidden":
        raise CredentialDenied(f"step {holder.step!r} may not read credential {name!r}")
    raise NotFound(f"credential {name!r} not found")


@pytest.fixture(scope="module")
async def tools() -> AsyncIterator[Tools]:
    pool = PythonPool(1)
    await pool.start()
    t = Tools(python=pool)
    yield t
    await t.close()


def command(tool: Any, keychain: dict[str, Any] | None = None) -> messages_pb2.Command:
    spec: dict[str, Any] = {"step": "use", "tool": tool}
    if keychain is not None:
        spec["keychain"] = keychain
    ctx = {"execution_id": 9, "workload": {"which": "api_token"}, "ctx": {}, "steps": {}, "known_steps": [],
           "event": {}}
    return messages_pb2.Command(command_id="9:use:1", execution_id=9, shard_id=0, step="use", attempt=2,
                                kind="python", spec_json=json.dumps(spec), context_json=json.dumps(ctx))


async def test_keychain_values_are_used_and_masked_everywhere(tools: Tools, caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryResultStore()
    credentials = Credentials(fetch)
    redactor = Redactor()
    active = ActiveSecrets()
    active.register(redactor)
    log_filter = LogFilter(active)
    stderr_lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stderr_lines.append(self.format(record))

    collect = Collect()
    collect.addFilter(log_filter)
    pump_log = logging.getLogger("noetl_worker.python.stderr")
    pump_log.addHandler(collect)
    pump_log.setLevel(logging.INFO)
    tool = [
        {"name": "use", "kind": "python", "input": {"auth": "Bearer {{ keychain.api.token }}"},
         "code": "import sys\nprint('stdout', auth)\nprint('stderr', auth, file=sys.stderr, flush=True)\n"
                 "result = {'echo': auth, 'len': len(auth)}",
         "spec": {"policy": {"rules": [{"else": {"then": {"do": "continue",
                                                           "set": {"ctx.leak": "{{ keychain.api.token }}"}}}}]}}},
        {"name": "boom", "kind": "python", "input": {"t": "{{ keychain.api.token }}"},
         "code": "raise ValueError('bad token ' + t)"},
    ]
    try:
        result = await execute_command(command(tool, {"api": {"name": "api", "credential": "{{ workload.which }}"}}),
                                       store, tools, secrets=credentials.for_command(
                                           Holder("9:use:1", 2, 9, "use"), redactor))
        # the stderr pump logs asynchronously
        await until(lambda: any("stderr" in line for line in stderr_lines), timeout=5,
                    what="the task's stderr line in the log", interval=0.02)
    finally:
        pump_log.removeHandler(collect)
        pump_log.setLevel(logging.NOTSET)
    assert asked[-1] == (Holder("9:use:1", 2, 9, "use"), "api_token")
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "error" and env["error"]["message"].endswith(f"bad token {MASK}")
    first = await store.get(env["parent_ref"]["ref_id"])  # the failed task stored nothing
    assert first == {"echo": f"Bearer {MASK}", "len": len("Bearer ") + len(TOKEN)}  # the task saw the real value
    assert json.loads(result.set_json)["ctx"] == {"leak": MASK}
    assert TOKEN not in result.SerializeToString().decode("utf-8", "replace")
    assert any(f"stderr Bearer {MASK}" in line for line in stderr_lines), stderr_lines
    assert not any(TOKEN in line for line in stderr_lines)
    assert TOKEN not in caplog.text


@pytest.mark.parametrize(("name", "code"), [("forbidden", "CREDENTIAL_NOT_PERMITTED"),
                                            ("nope", "CREDENTIAL_NOT_FOUND")])
async def test_a_keychain_entry_that_cannot_be_had_fails_the_command(tools: Tools, name: str, code: str) -> None:
    tool = {"kind": "python", "input": {"t": "{{ keychain.k.token }}"}, "code": "result = 1"}
    result = await execute_command(command(tool, {"k": {"name": "k", "credential": name}}), MemoryResultStore(),
                                   tools, secrets=Credentials(fetch).for_command(Holder("9:use:1", 2, 9, "use")))
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "error" and env["error"]["code"] == code and name in env["error"]["message"]


async def test_answers_are_reused_per_step_briefly() -> None:
    now = [0.0]
    calls: list[str] = []

    async def counting(holder: Holder, name: str) -> StoredCredential:
        calls.append(f"{holder.execution_id}:{holder.step}")
        return StoredCredential(name, "http_bearer", {"token": TOKEN})

    creds = Credentials(counting, ttl=10.0, clock=lambda: now[0])
    await creds.get(Holder("1:a:1:0", 1, 1, "a"), "api_token")
    await creds.get(Holder("1:a:1:1", 1, 1, "a"), "api_token")  # another iteration of the same step
    await creds.get(Holder("1:b:1", 1, 1, "b"), "api_token")  # another step: the api decides again
    now[0] = 11.0
    await creds.get(Holder("1:a:1:2", 1, 1, "a"), "api_token")  # expired
    assert calls == ["1:a", "1:b", "1:a"]
