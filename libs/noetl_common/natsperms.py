"""What each role may publish and subscribe on NATS: the one table, as data.

Used by the local stack's ``nats-server`` configuration (``noetl_cli/stacknats.py``),
printed for operators by ``noetl-rt nats-config`` (an ``authorization`` block for the
NATS server), and checked by ``tests/unit/test_natsperms.py`` (every subject function of
``natsio`` is in ``USES``; the permissions grant each use and nothing the table does
not list) and ``tests/e2e/test_nats_security.py`` (against the running roles).

Least privilege, by role:

  role          publishes                                subscribes
  api           events .submit/.cancel/.redrive,         progress hints, its inbox
                commands, handoffs, cancel/projector hints; manages both
                streams, the worker consumer, its own
                ordered consumers on NOETL_EVENTS; the
                result KV (create, read, write)
  worker        events .call only; creates (filtered on  cancel hints, handoffs, its inbox
                commands only), pulls and acks its pool's
                ``noetl-workers-{pool}-{priority}``
                consumers; reads stream info; the
                result KV (read, write; not create)
  projector     checkpointer and progress hints          projector hints, its inbox
  checkpointer  events .barrier                          projector and checkpointer hints,
                                                         its inbox
  reaper        events .expired, commands                its inbox
  admin         everything (tests and operator tools)

A worker may not publish a command or an event kind of another role, create, update,
delete or purge a stream, touch another consumer, or read another role's replies: each
role's replies come to ``_INBOX.{role}.>`` (``natsio.inbox_prefix``). JetStream API
requests are ``$JS.API.*``; acks ``$JS.ACK.*``; flow control replies of push consumers
``$JS.FC.*``; KV writes ``$KV.{bucket}.{key}``; KV reads go through direct get
(``$JS.API.DIRECT.GET.KV_{bucket}``) or ``STREAM.MSG.GET``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from . import natsio

__all__ = [
    "ADMIN",
    "DEFAULT_KV_BUCKET",
    "ROLES",
    "USES",
    "Permissions",
    "allowed",
    "authorization_block",
    "matches",
    "role_permissions",
]

ADMIN = "admin"
ROLES = ("api", "worker", "projector", "checkpointer", "reaper")
DEFAULT_KV_BUCKET = "noetl_results"

ANY = "*"  # a shard or execution id in a subject

# Who publishes and who subscribes (core NATS) each subject ``natsio`` builds; keyed by
# the subject function's name and, for events, the kind. Events and commands are read
# through JetStream consumers (the api's ordered consumers, the workers' pull consumer),
# not subscribed.
USES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    # key: (subject pattern, publishers, subscribers)
    f"events_subject:{natsio.KIND_CALL}": (natsio.events_subject(ANY, natsio.KIND_CALL), ("worker",), ()),
    f"events_subject:{natsio.KIND_SUBMIT}": (natsio.events_subject(ANY, natsio.KIND_SUBMIT), ("api",), ()),
    f"events_subject:{natsio.KIND_CANCEL}": (natsio.events_subject(ANY, natsio.KIND_CANCEL), ("api",), ()),
    f"events_subject:{natsio.KIND_REDRIVE}": (natsio.events_subject(ANY, natsio.KIND_REDRIVE), ("api",), ()),
    f"events_subject:{natsio.KIND_EXPIRED}": (natsio.events_subject(ANY, natsio.KIND_EXPIRED), ("reaper",), ()),
    f"events_subject:{natsio.KIND_BARRIER}": (natsio.events_subject(ANY, natsio.KIND_BARRIER), ("checkpointer",), ()),
    "commands_subject": (natsio.commands_subject(ANY, ANY, ANY), ("api", "reaper"), ()),
    "progress_subject": (natsio.progress_subject(ANY), ("projector",), ("api",)),
    "projector_subject": (natsio.projector_subject(ANY), ("api",), ("projector", "checkpointer")),
    "checkpointer_subject": (natsio.checkpointer_subject(ANY), ("projector",), ("checkpointer",)),
    "cancel_subject": (natsio.cancel_subject(ANY), ("api",), ("worker",)),
    # the engine hands a command to the worker that offered to take it (per worker, by digest)
    "handoff_subject": (f"{natsio.HANDOFF_PREFIX}.{ANY}", ("api",), ("worker",)),
}

_API = "$JS.API"


def _stream_admin(stream: str) -> list[str]:
    return [f"{_API}.STREAM.{op}.{stream}" for op in ("INFO", "CREATE", "UPDATE")]


def _kv(bucket: str, *, create: bool) -> list[str]:
    stream = f"KV_{bucket}"
    out = [f"{_API}.STREAM.INFO.{stream}", f"{_API}.DIRECT.GET.{stream}", f"{_API}.DIRECT.GET.{stream}.>",
           f"{_API}.STREAM.MSG.GET.{stream}", f"$KV.{bucket}.>"]
    if create:
        out.append(f"{_API}.STREAM.CREATE.{stream}")
    return out


def _worker_consumers() -> list[str]:
    """A pool's consumers (``pools.consumer_name``): created only filtered on commands
    subjects (``CONSUMER.CREATE.{stream}.{name}.{filter}``), read, pulled from and acked."""
    stream = natsio.COMMANDS_STREAM
    return [f"{_API}.CONSUMER.INFO.{stream}.*", f"{_API}.CONSUMER.CREATE.{stream}.*.noetl.commands.>",
            f"{_API}.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.ACK.{stream}.*.>"]


def _legacy_consumer() -> list[str]:
    """The api deletes the shared consumer of a runtime before pools, and its notices."""
    stream, name = natsio.COMMANDS_STREAM, natsio.LEGACY_WORKER_CONSUMER
    return [f"{_API}.CONSUMER.INFO.{stream}.{name}", f"{_API}.CONSUMER.DELETE.{stream}.{name}"]


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def role_permissions(kv_bucket: str = DEFAULT_KV_BUCKET) -> dict[str, Permissions]:
    """Every role's (and ``admin``'s) publish and subscribe allow lists."""
    pub: dict[str, list[str]] = {r: [] for r in ROLES}
    sub: dict[str, list[str]] = {r: [f"{natsio.inbox_prefix(r)}.>"] for r in ROLES}
    for subject, publishers, subscribers in USES.values():
        for r in publishers:
            pub[r].append(subject)
        for r in subscribers:
            sub[r].append(subject)
    events, commands = natsio.EVENTS_STREAM, natsio.COMMANDS_STREAM
    pub["api"] += [
        *_stream_admin(events), *_stream_admin(commands), *_legacy_consumer(),
        # the engine's ordered consumers on its shards' events (created, re-created, deleted)
        f"{_API}.STREAM.NAMES", f"{_API}.CONSUMER.CREATE.{events}", f"{_API}.CONSUMER.CREATE.{events}.>",
        f"{_API}.CONSUMER.INFO.{events}.*", f"{_API}.CONSUMER.DELETE.{events}.*", f"$JS.FC.{events}.>",
        *_kv(kv_bucket, create=True),
    ]
    pub["worker"] += [
        f"{_API}.STREAM.INFO.{events}", f"{_API}.STREAM.INFO.{commands}", *_worker_consumers(),
        *_kv(kv_bucket, create=False),
    ]
    perms = {r: Permissions(tuple(dict.fromkeys(pub[r])), tuple(dict.fromkeys(sub[r]))) for r in ROLES}
    perms[ADMIN] = Permissions((">",), (">",))
    return perms


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def allowed(perms: Permissions, subject: str, *, publish: bool) -> bool:
    return any(matches(p, subject) for p in (perms.publish if publish else perms.subscribe))


def authorization_block(passwords: Mapping[str, str] | None = None, *,
                        kv_bucket: str = DEFAULT_KV_BUCKET, user_prefix: str = "") -> str:
    """A NATS server ``authorization`` block: one user per role (``user_prefix`` + the
    role) and ``admin``, with their permissions. A password from ``passwords`` is written as given
    (a bcrypt hash from ``nats server passwd`` works too); a role without one gets a
    variable reference, ``$NOETL_NATS_PASSWORD_<ROLE>``, that nats-server resolves from
    its environment. Strings are JSON-quoted (NATS config accepts them; ``$`` inside
    quotes is not a variable)."""
    passwords = passwords or {}
    lines = ["authorization {", "  users = ["]
    for user, perms in role_permissions(kv_bucket).items():
        secret = passwords.get(user)
        password = json.dumps(secret) if secret else f"$NOETL_NATS_PASSWORD_{user.upper()}"
        lines += [
            f"    {{user: {json.dumps(user_prefix + user)}, password: {password}, permissions: {{",
            f"      publish: {{allow: {json.dumps(list(perms.publish))}}}",
            f"      subscribe: {{allow: {json.dumps(list(perms.subscribe))}}}",
            "    }}",
        ]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
