"""The http tool's ``auth``: headers built from stored credentials (noetl_worker.tools.httpauth),
inline secrets refused, and the secret masked in what the task reports."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from noetl_common.errors import NotFound
from noetl_common.redact import MASK, Redactor
from noetl_worker.tools import CommandSecrets, Credentials, Holder, HttpTool, StoredCredential
from noetl_worker.tools.credentials import CredentialDenied
from noetl_worker.tools.httpauth import AuthSpec, auth_headers, merge_headers, parse_auth

TOKEN = "t0ken-Secret-123"
STORE = {
    "api_token": ("http_bearer", {"token": TOKEN}),
    "svc_login": ("http_basic", {"username": "svc", "password": "b4sic-pw"}),
    "api_key": ("generic", {"header": "X-Api-Key", "value": "k3y-value"}),
    "raw_token": ("generic", {"token": "gen-t0ken"}),
    "pg": ("postgres", {"dsn": "host=db password=pg-pw"}),
    "forbidden": ("generic", {"value": "never"}),
}


def test_parse_auth_forms() -> None:
    assert parse_auth("api_token") == AuthSpec("api_token")
    assert parse_auth({"credential": "a", "type": "Bearer"}) == AuthSpec("a", "bearer")
    assert parse_auth({"key": "a", "type": "api_key", "header": "X-K"}) == AuthSpec("a", "api_key", "X-K")
    assert parse_auth({"name": "a"}) == AuthSpec("a")
    with pytest.raises(ValueError, match=r"inline secrets \(token\) are not accepted") as exc:
        parse_auth({"type": "bearer", "token": TOKEN})
    assert TOKEN not in str(exc.value)
    with pytest.raises(ValueError, match="must name a stored credential"):
        parse_auth({"type": "bearer"})
    with pytest.raises(ValueError, match="not one of: bearer, basic, header, api_key"):
        parse_auth({"credential": "a", "type": "digest"})
    with pytest.raises(ValueError):
        parse_auth(["a"])


def test_headers_by_kind_and_type() -> None:
    assert auth_headers(AuthSpec("a"), "http_bearer", {"token": "t"}) == {"Authorization": "Bearer t"}
    basic = auth_headers(AuthSpec("a"), "http_basic", {"username": "u", "password": "p"})
    assert basic == {"Authorization": "Basic " + base64.b64encode(b"u:p").decode()}
    assert auth_headers(AuthSpec("a"), "generic", {"header": "X-K", "value": "v"}) == {"X-K": "v"}
    assert auth_headers(AuthSpec("a"), "generic", {"token": "t"}) == {"Authorization": "Bearer t"}
    assert auth_headers(AuthSpec("a", "api_key"), "generic", {"value": "v"}) == {"X-API-Key": "v"}
    assert auth_headers(AuthSpec("a", "header", "X-T"), "http_bearer", {"token": "t"}) == {"X-T": "t"}
    with pytest.raises(ValueError, match=r"credential 'a' \(postgres\) cannot authenticate"):
        auth_headers(AuthSpec("a"), "postgres", {"dsn": "x"})
    with pytest.raises(ValueError, match="needs `username` and `password`"):
        auth_headers(AuthSpec("a", "basic"), "generic", {"password": "p"})
    assert merge_headers({"authorization": "Bearer stale", "Accept": "x"}, {"Authorization": "Bearer t"}) == {
        "Accept": "x", "Authorization": "Bearer t"}


async def fetch(holder: Holder, name: str) -> StoredCredential:
    if name == "forbidden":
        raise CredentialDenied(f"step 'call' may not read credential {name!r}")
    if name not in STORE:
        raise NotFound(f"credential {name!r} not found")
    kind, data = STORE[name]
    return StoredCredential(name, kind, data)


@pytest.fixture
async def http() -> AsyncIterator[tuple[HttpTool, list[httpx.Request]]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/echo":  # a server that echoes the credential back
            return httpx.Response(200, json={"auth": request.headers.get("authorization")})
        if request.url.path == "/fail":
            return httpx.Response(500, text=f"denied for {request.headers.get('authorization')}")
        return httpx.Response(200, json={"ok": True})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    yield HttpTool(client), seen
    await client.aclose()


def secrets() -> CommandSecrets:
    return Credentials(fetch).for_command(Holder("1:call:1", 1, 1, "call"), Redactor())


async def test_requests_carry_the_credential(http: tuple[HttpTool, list[httpx.Request]]) -> None:
    tool, seen = http
    s = secrets()
    out = await tool.run({"url": "http://api/x", "auth": "api_token", "headers": {"Authorization": "stale"}},
                         secrets=s)
    assert out.ok and seen[-1].headers["authorization"] == f"Bearer {TOKEN}"
    out = await tool.run({"url": "http://api/x", "credential": "svc_login"}, secrets=s)
    assert seen[-1].headers["authorization"] == "Basic " + base64.b64encode(b"svc:b4sic-pw").decode()
    out = await tool.run({"url": "http://api/x", "auth": {"credential": "api_key"}}, secrets=s)
    assert seen[-1].headers["x-api-key"] == "k3y-value"
    # the secrets, and the header values built from them
    assert s.redactor.text(f"{TOKEN} b4sic-pw k3y-value; Bearer {TOKEN}") == f"{MASK} {MASK} {MASK}; {MASK}"


async def test_refusals_are_task_errors(http: tuple[HttpTool, list[httpx.Request]]) -> None:
    tool, seen = http
    s = secrets()
    cases = [({"auth": "missing"}, "CREDENTIAL_NOT_FOUND"), ({"auth": "forbidden"}, "CREDENTIAL_NOT_PERMITTED"),
             ({"auth": "pg"}, "INVALID_TASK"), ({"auth": {"type": "bearer", "token": TOKEN}}, "INVALID_TASK")]
    for fields, code in cases:
        out = await tool.run({"url": "http://api/x", **fields}, secrets=s)
        assert out.error is not None and out.error.code == code, (fields, out)
        assert TOKEN not in out.error.message and "pg-pw" not in out.error.message
    out = await tool.run({"url": "http://api/x", "auth": "api_token"}, secrets=None)
    assert out.error is not None and out.error.code == "CREDENTIAL_NOT_FOUND"
    assert seen == []  # nothing was sent


async def test_runner_masks_what_the_server_echoes(http: tuple[HttpTool, list[httpx.Request]]) -> None:
    """Through the runner: the echoed token in the result, and in an error body, is masked."""
    from noetl_proto.v1 import messages_pb2
    from noetl_store import MemoryResultStore, envelope_from_proto
    from noetl_worker.runner import execute_command
    from noetl_worker.tools import Tools

    tool, _ = http
    store = MemoryResultStore()

    def command(url: str) -> messages_pb2.Command:
        spec = {"step": "call", "tool": {"kind": "http", "url": url, "auth": "api_token"}}
        ctx = {"execution_id": 1, "workload": {}, "ctx": {}, "steps": {}, "known_steps": [], "event": {}}
        return messages_pb2.Command(command_id="1:call:1", execution_id=1, shard_id=0, step="call", attempt=1,
                                    kind="http", spec_json=json.dumps(spec), context_json=json.dumps(ctx))

    result = await execute_command(command("http://api/echo"), store, Tools(http=tool), secrets=secrets())
    env = envelope_from_proto(result.envelope)
    value: Any = await store.get(env["reference"]["ref_id"])
    assert value["data"] == {"auth": MASK} and TOKEN not in json.dumps(value)
    result = await execute_command(command("http://api/fail"), store, Tools(http=tool), secrets=secrets())
    env = envelope_from_proto(result.envelope)
    assert env["status"] == "error" and env["error"]["code"] == "HTTP_ERROR"
    stored = await store.get(env["reference"]["ref_id"])
    assert TOKEN not in json.dumps(stored) and MASK in stored["body"]
