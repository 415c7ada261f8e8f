"""Who may do what in the runtime database: the one grant matrix, applied by the owner.

Each role process connects as its own login user, a member of the role's NOLOGIN group
role (``noetl_api``, ``noetl_shard_manager``, ... ``noetl_worker``, created by migration
0009). The group roles get exactly the privileges of ``GRANTS`` (table or sequence ->
role -> privileges), ``FUNCTIONS`` (function -> roles that may execute it) and
``MEMBERSHIPS``; nothing is granted to PUBLIC. ``apply`` makes the database match the
matrix (it revokes what the matrix does not list), in one transaction; ``db.migrate``
runs it after the SQL migrations, every time, so a grant change needs no migration and
a hand-made grant does not survive the next migrate.

Every table and sequence of schema ``noetl`` must appear in ``GRANTS`` (an empty entry:
only the owner touches it); a unit test and ``undecided`` keep a new migration's table
from being forgotten. Event partitions are not listed: the roles reach them through
``noetl.event``, and only the owner's SECURITY DEFINER functions create and drop them.

Shared library code runs under several roles: ``noetl_common.shards`` (lease renewal and
heartbeats: every sharded role), ``noetl_common.auth`` (token lookup, through
``noetl.token_identity``: every role), ``noetl_store`` (api and worker).

Role names are cluster-wide in Postgres: two runtimes in one cluster share the group
roles (their grants are per database). docs/DEPLOY.md "Database users".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from psycopg import sql

logger = logging.getLogger(__name__)

SCHEMA = "noetl"
ROLES = ("api", "shard-manager", "projector", "checkpointer", "compactor", "reaper", "worker")
#: The roles that hold shard leases (``noetl_common.shards``: renewals, heartbeats, fences).
SHARDED = ("api", "projector", "checkpointer", "compactor", "reaper")

R, A, W, D, U = "SELECT", "INSERT", "UPDATE", "DELETE", "USAGE"


def group_role(role: str) -> str:
    """The NOLOGIN group role of a runtime role: ``shard-manager`` -> ``noetl_shard_manager``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    return "noetl_" + role.replace("-", "_")


def _sharded(**extra: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    grants: dict[str, tuple[str, ...]] = {role: (R, W) for role in SHARDED}
    grants.update(extra)
    return grants


#: table or sequence (in schema noetl) -> role -> privileges. A role not named gets nothing.
GRANTS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "schema_migration": {},
    # the catalog and submissions: the api's
    "catalog": {"api": (R, A)},
    "catalog_catalog_id_seq": {},  # identity (GENERATED ALWAYS): INSERT suffices
    "execution_request": {"api": (R, A), "reaper": (R,)},
    "cancel_request": {"api": (R, A, D)},
    "quarantine": {"api": (R, A)},
    "quarantine_quarantine_id_seq": {"api": (U,)},
    # dead letters: the engine (api) records and redrives them; RedriveDeadLetter commits
    # a request the engine applies and deletes (docs/ARCHITECTURE.md "Dead letters")
    "dead_letter": {"api": (R, A, W)},
    "dead_letter_dead_letter_id_seq": {"api": (U,)},
    "redrive_request": {"api": (R, A, D)},
    # the event log: the engine (api) appends, the compactor deletes (retention)
    "event": {"api": (R, A), "projector": (R,), "checkpointer": (R,), "compactor": (R, D)},
    "event_id_seq": {"api": (U,)},
    "engine_state": {"api": (R, A, W)},
    "command": {"api": (R, A, W), "reaper": (R,)},
    "loop_item": {"api": (R, A)},
    # a redrive takes a failed iteration's result back (DELETE) before re-issuing it
    "loop_result": {"api": (R, A, D), "worker": (R,)},
    # results: written by workers (and the engine's loop results), read by the api
    "result_ref": {"api": (R, A), "worker": (R, A), "compactor": (R,)},
    "result_ref_ref_id_seq": {"api": (U,), "worker": (U,)},  # nextval(pg_get_serial_sequence(...))
    "result_payload": {"api": (R, A), "worker": (R, A)},
    # membership and leases
    "runtime": _sharded(**{"shard-manager": (R, A, W)}),
    "runtime_runtime_id_seq": {},
    "shard_lease": _sharded(**{"shard-manager": (R, A, W)}),
    "leader_lease": {"shard-manager": (R, A, W)},
    # read models and checkpoints
    "execution": {"projector": (R, A, W), "api": (R,), "compactor": (R,)},
    "execution_step": {"projector": (R, A, W), "api": (R,), "compactor": (R,)},
    "projection_checkpoint": {"projector": (R, A, W), "checkpointer": (R,), "compactor": (R,)},
    "checkpoint": {"checkpointer": (R, A)},
    "manifest": {"compactor": (R, A, W), "api": (R,)},
    "manifest_part": {"compactor": (R, A), "api": (R,)},
    # secrets: the api's alone (workers get credentials through the api's GetCredential)
    "credential": {"api": (R, A, W)},
    "api_token": {"api": (R, A, W)},
    "api_token_token_id_seq": {"api": (U,)},
    "runtime_secret": {"api": (R, A)},
    # schedules (noetl_db.schedules): the api changes them, the reaper fires their
    # ticks (it locks schedule rows FOR UPDATE to move next_tick) and records submissions
    "schedule": {"api": (R, A, W, D), "reaper": (R, W)},
    "schedule_schedule_id_seq": {"api": (U,)},
    "schedule_tick": {"api": (R,), "reaper": (R, A, W)},
    # concurrency limits: the api defines them; the engine (in the api) takes, queues and
    # frees slots in its fenced batches (noetl.take_slot)
    "concurrency_limit": {"api": (R, A, W, D)},
    "concurrency_limit_limit_id_seq": {"api": (U,)},
    "concurrency_slot": {"api": (R, A, D)},
    "concurrency_wait": {"api": (R, A, D)},
}

#: function signature (in schema noetl) -> roles that may execute it (EXECUTE is revoked
#: from PUBLIC). The SECURITY DEFINER ones (migration 0009) are the narrow doors to what
#: the roles may not touch directly.
FUNCTIONS: Mapping[str, tuple[str, ...]] = {
    "assert_lease(text, integer, bigint, bigint)": SHARDED,
    # a token's identity by its hash; nobody but the api reads noetl.api_token itself
    "token_identity(text)": ROLES,
    # event partitions are owned by the owner; the compactor creates and drops them
    "create_event_partition(date)": ("compactor",),
    "drop_event_partition(text)": ("compactor",),
    "take_slot(bigint, text, integer, bigint, integer)": ("api",),
}

#: built-in roles a group role is a member of. The shard-manager's leader ends the session
#: of a dead member that still holds a lease row locked (``pg_terminate_backend``), which
#: runs as another role: ``pg_signal_backend`` (granted by migration 0009 when the owner
#: may; otherwise the operator grants it, docs/DEPLOY.md).
MEMBERSHIPS: Mapping[str, tuple[str, ...]] = {"shard-manager": ("pg_signal_backend",)}


def privileges(role: str) -> dict[str, tuple[str, ...]]:
    """What ``role`` may do, by table or sequence."""
    group_role(role)
    return {obj: grants[role] for obj, grants in GRANTS.items() if role in grants}


def undecided(conn: psycopg.Connection[Any]) -> list[str]:
    """Tables and sequences of schema noetl (event partitions aside) missing from GRANTS."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'S', 'v', 'm') AND NOT c.relispartition",
        (SCHEMA,)).fetchall()
    return sorted(str(r[0]) for r in rows if str(r[0]) not in GRANTS)


def _existing_groups(conn: psycopg.Connection[Any]) -> set[str]:
    names = [group_role(r) for r in ROLES]
    return {str(r[0]) for r in conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)",
                                            (names,)).fetchall()}


def statements(groups: Iterable[str] | None = None, relkinds: Mapping[str, str] | None = None) -> list[sql.Composed]:
    """The GRANT/REVOKE statements that make the database match the matrix, for the
    group roles ``groups`` (all when None). ``relkinds``: object -> 'S' for sequences."""
    wanted = set(groups) if groups is not None else {group_role(r) for r in ROLES}
    kinds = relkinds or {}
    out: list[sql.Composed] = []
    roles = [r for r in ROLES if group_role(r) in wanted]
    idents = sql.SQL(", ").join(sql.Identifier(group_role(r)) for r in roles)
    schema = sql.Identifier(SCHEMA)
    if not roles:
        return out
    out.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, idents))
    for obj, grants in GRANTS.items():
        if obj not in kinds:
            continue
        target = sql.SQL("SEQUENCE" if kinds[obj] == "S" else "TABLE")
        table = sql.Identifier(SCHEMA, obj)
        out.append(sql.SQL("REVOKE ALL ON {} {} FROM PUBLIC, {}").format(target, table, idents))
        for role in roles:
            privs = grants.get(role)
            if privs:
                out.append(sql.SQL("GRANT {} ON {} {} TO {}").format(
                    sql.SQL(", ").join(sql.SQL(p) for p in privs), target, table, sql.Identifier(group_role(role))))
    for fn, allowed in FUNCTIONS.items():
        name = sql.SQL("{}.{}").format(schema, sql.SQL(fn))
        out.append(sql.SQL("REVOKE ALL ON FUNCTION {} FROM PUBLIC, {}").format(name, idents))
        granted = [r for r in allowed if r in roles]
        if granted:
            out.append(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
                name, sql.SQL(", ").join(sql.Identifier(group_role(r)) for r in granted)))
    return out


def apply(conn: psycopg.Connection[Any]) -> list[str]:
    """Make the grants of schema noetl match the matrix (one transaction; idempotent).
    Returns the group roles it applied to; a group role that does not exist (the owner may
    not create roles, and the operator has not) is skipped with a warning."""
    groups = _existing_groups(conn)
    missing = sorted({group_role(r) for r in ROLES} - groups)
    if missing:
        logger.warning("database roles %s do not exist: their grants are not applied (docs/DEPLOY.md"
                       " \"Database users\")", missing)
    kinds = {str(r[0]): str(r[1]) for r in conn.execute(
        "SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'S', 'v', 'm') AND NOT c.relispartition",
        (SCHEMA,)).fetchall()}
    with conn.transaction():
        for stmt in statements(groups, kinds):
            conn.execute(stmt)
    left = undecided(conn)
    if left:
        logger.warning("tables with no decided grants (only the owner may use them): %s", left)
    return sorted(groups)
