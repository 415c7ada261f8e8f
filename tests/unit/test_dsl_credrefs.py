"""Where a playbook names stored credentials (noetl_dsl.credrefs): the fields, the
keychain block, and what each step may read."""

from __future__ import annotations

import pytest

from noetl_api.static_checks import credential_refs
from noetl_common.errors import PlaybookInvalid
from noetl_dsl import merged_workload, parse_playbook, static_auth_refs
from noetl_dsl.credrefs import keychain_reads, playbook_names, step_grant

PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: creds, path: tests/creds}
workload:
  pg_auth: pg_local
  api: api_token
keychain:
  - name: svc
    kind: credential
    credential: svc_login
  - name: other
    credential: "{{ workload.api }}"
  - name: tenant_b
    credential: pg_tenant_b
workbook:
  - name: lookup
    tool: {kind: postgres, auth: {credential: pg_wb}, query: "select 1"}
workflow:
  - step: start
    tool: {kind: postgres, auth: "{{ workload.pg_auth }}", command: "select 1"}
    next: [{step: call}]
  - step: call
    tool:
      - {name: a, kind: http, url: "http://x", credential: "{{ api }}"}
      - {name: b, kind: http, url: "http://x", auth: {type: basic, key: basic_login}}
      - {name: c, kind: http, url: "http://x", headers: {X-Svc: "{{ keychain.svc.token }}"}}
    next: [{step: wb}]
  - step: wb
    tool: {kind: workbook, name: lookup}
    next: [{step: per_tenant}]
  - step: per_tenant
    loop: {in: "{{ workload.tenants | default([]) }}", iterator: t}
    tool: {kind: postgres, auth: "{{ t.cred }}", command: "select 1"}
    next: [{step: cursor}]
  - step: cursor
    loop:
      iterator: row
      spec: {mode: cursor}
      cursor: {kind: postgres, auth: pg_cursor, claim: "select 1"}
    tool: {kind: python, code: "result = {}"}
    next: [{step: inline}]
  - step: inline
    tool: {kind: postgres, auth: {dsn: "host=db password=inline-pw"}, command: "select 1"}
    next: [{step: end}]
  - step: end
    tool: {kind: noop}
"""


@pytest.fixture(scope="module")
def playbook():  # type: ignore[no-untyped-def]
    return parse_playbook(PLAYBOOK)


def test_every_field_that_names_a_credential(playbook) -> None:  # type: ignore[no-untyped-def]
    workload = merged_workload(playbook, {})
    refs = dict(static_auth_refs(playbook, workload))
    assert refs == {
        "workflow[0].tool.auth": "pg_local",
        "workflow[1].tool[0].credential": "api_token",
        "workflow[1].tool[1].auth.key": "basic_login",
        "keychain[0].credential": "svc_login",
        "keychain[1].credential": "api_token",
        "keychain[2].credential": "pg_tenant_b",
        "workbook[0].tool.auth.credential": "pg_wb",
        "workflow[4].loop.cursor.auth": "pg_cursor",
    }  # the loop's {{ t.cred }} is chosen at run time; the inline dsn names nothing
    assert credential_refs(playbook, workload) == static_auth_refs(playbook, workload)


def test_what_a_step_may_read(playbook) -> None:  # type: ignore[no-untyped-def]
    workload = merged_workload(playbook, {"api": "api_other"})
    assert step_grant(playbook, "start", workload).names == {"pg_local"}
    call = step_grant(playbook, "call", workload)
    assert call.names == {"api_other", "basic_login", "svc_login"} and not call.dynamic  # reads keychain.svc only
    assert step_grant(playbook, "wb", workload).names == {"pg_wb"}  # the workbook task it calls
    assert step_grant(playbook, "cursor", workload).names == {"pg_cursor"}
    assert step_grant(playbook, "inline", workload).names == frozenset()
    loop = step_grant(playbook, "per_tenant", workload)
    assert loop.names == frozenset() and loop.dynamic
    named = playbook_names(playbook, workload)
    # a run-time choice may read what the playbook names (e.g. as a keychain entry), nothing else
    assert loop.allows("pg_tenant_b", named) and not loop.allows("pg_prod", named)
    assert not step_grant(playbook, "start", workload).allows("pg_tenant_b", named)
    assert step_grant(playbook, "no_such_step", workload).names == frozenset()


def test_keychain_reads() -> None:
    text = PLAYBOOK.replace('X-Svc: "{{ keychain.svc.token }}"', 'X-Svc: "{{ keychain[workload.which].token }}"')
    pb = parse_playbook(text)
    assert keychain_reads(pb, "call") is None  # dynamic: any entry of the playbook
    assert step_grant(pb, "call", merged_workload(pb, {})).names >= {"svc_login", "api_token", "pg_tenant_b"}
    assert keychain_reads(pb, "start") == set()


@pytest.mark.parametrize(("block", "fragment"), [
    ("keychain: {a: 1}", "keychain: keychain must be a list"),
    ("keychain: [{name: tok, kind: oauth2, endpoint: 'http://x'}]",
     "keychain[0].kind: keychain kind 'oauth2' is not supported by this runtime"),
    ("keychain: [{name: tok}]", "keychain[0].credential: a keychain entry of kind credential needs `credential`"),
    ("keychain: [{name: 'not an id', credential: x}]", "keychain[0].name: keychain entry name must be an identifier"),
    ("keychain: [{name: a, credential: x}, {name: a, credential: y}]", "duplicate keychain entry 'a'"),
    ("keychain: [{name: a, credential: '{{ x'}]", "keychain[0].credential"),
])
def test_keychain_block_is_validated(block: str, fragment: str) -> None:
    text = f"""apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: k}}
{block}
workflow:
  - step: start
    tool: {{kind: noop}}
"""
    with pytest.raises(PlaybookInvalid) as exc:
        parse_playbook(text)
    assert fragment in str(exc.value)


DUCKDB_ALIASES = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: duck, path: tests/duck}
workload: {pg_auth: pg_local}
workflow:
  - step: start
    tool:
      kind: duckdb
      auth:
        pg_db: {source: credential, type: postgres, key: "{{ workload.pg_auth }}"}
        other: pg_other
      query: "ATTACH '' AS pg_db (TYPE postgres, SECRET pg_db); SELECT 1"
    next: [{step: http}]
  - step: http
    tool: {kind: http, url: "http://x", auth: {type: bearer, credential: api_token}}
"""


def test_a_duckdb_alias_map_grants_each_credential_it_names() -> None:
    pb = parse_playbook(DUCKDB_ALIASES)
    workload = merged_workload(pb, {})
    grant = step_grant(pb, "start", workload)
    assert grant.names == frozenset({"pg_local", "pg_other"}) and not grant.dynamic
    assert step_grant(pb, "http", workload).names == frozenset({"api_token"})
    assert set(static_auth_refs(pb, workload)) == {("workflow[0].tool.auth.pg_db.key", "pg_local"),
                                                   ("workflow[0].tool.auth.other", "pg_other"),
                                                   ("workflow[1].tool.auth.credential", "api_token")}


def test_a_cursor_names_its_credential_with_credential_too() -> None:
    text = DUCKDB_ALIASES.replace("""  - step: http""", """  - step: drain
    loop:
      spec: {mode: cursor}
      cursor: {kind: postgres, credential: pg_cursor2, claim: "select 1"}
    tool: {kind: noop}
  - step: http""")
    pb = parse_playbook(text)
    assert step_grant(pb, "drain", merged_workload(pb, {})).names == frozenset({"pg_cursor2"})


def test_the_older_credentials_alias_map_of_duckdb_is_granted() -> None:
    text = DUCKDB_ALIASES.replace("""      auth:
        pg_db: {source: credential, type: postgres, key: "{{ workload.pg_auth }}"}
        other: pg_other""", """      credentials:
        pg_db: {key: pg_legacy}""")
    pb = parse_playbook(text)
    assert step_grant(pb, "start", merged_workload(pb, {})).names == frozenset({"pg_legacy"})
