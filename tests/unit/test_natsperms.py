"""The NATS permission table (``natsperms``): every subject ``natsio`` builds is in it,
each role is granted exactly the uses the table lists, and the worker gets none of the
dangerous rights (commands, engine-only events, stream management, other inboxes)."""

from __future__ import annotations

import inspect

import pytest

from noetl_common import natsio, natsperms, pools

PERMS = natsperms.role_permissions()
KINDS = sorted(v for k, v in vars(natsio).items() if k.startswith("KIND_"))


def subject_functions() -> list[str]:
    return sorted(name for name, fn in vars(natsio).items()
                  if inspect.isfunction(fn) and name.endswith("_subject"))


def concrete(key: str) -> str:
    """A real subject of a ``USES`` key (shard/execution 7)."""
    name, _, kind = key.partition(":")
    fn = getattr(natsio, name)
    if name == "commands_subject":
        return fn("gpu", "high", 7)
    return str(fn(7, kind) if kind else fn(7))


def test_every_subject_function_and_event_kind_is_in_the_table() -> None:
    keys = set(natsperms.USES)
    for name in subject_functions():
        if name == "events_subject":
            missing = [k for k in KINDS if f"events_subject:{k}" not in keys]
            assert not missing, f"event kinds without permissions in natsperms.USES: {missing}"
        else:
            assert name in keys, f"natsio.{name} has no entry in natsperms.USES (who publishes, who subscribes)"
    known = {f"events_subject:{k}" for k in KINDS} | set(subject_functions())
    assert keys <= known, f"stale entries: {keys - known}"


@pytest.mark.parametrize("key", sorted(natsperms.USES))
def test_each_use_is_granted_to_its_roles_and_to_no_other(key: str) -> None:
    _, publishers, subscribers = natsperms.USES[key]
    subject = concrete(key)
    for role in natsperms.ROLES:
        perms = PERMS[role]
        assert natsperms.allowed(perms, subject, publish=True) == (role in publishers), (role, "publish", subject)
        assert natsperms.allowed(perms, subject, publish=False) == (role in subscribers), (role, "sub", subject)
    assert natsperms.allowed(PERMS[natsperms.ADMIN], subject, publish=True)


def test_each_role_subscribes_to_its_own_inbox_only() -> None:
    for role in natsperms.ROLES:
        for other in natsperms.ROLES:
            inbox = f"{natsio.inbox_prefix(other)}.abc.1"
            assert natsperms.allowed(PERMS[role], inbox, publish=False) == (role == other), (role, other)
        assert not natsperms.allowed(PERMS[role], "_INBOX.abc", publish=False)
        assert not natsperms.allowed(PERMS[role], "_INBOX.>", publish=False)


@pytest.mark.parametrize("subject", [
    natsio.commands_subject("default", "normal", 0), natsio.events_subject(0, natsio.KIND_SUBMIT),
    natsio.events_subject(0, natsio.KIND_CANCEL), natsio.events_subject(0, natsio.KIND_EXPIRED),
    natsio.events_subject(0, natsio.KIND_BARRIER), natsio.cancel_subject(0), natsio.progress_subject(1),
    natsio.handoff_subject("worker-1"),
    f"$JS.API.STREAM.CREATE.{natsio.COMMANDS_STREAM}", f"$JS.API.STREAM.UPDATE.{natsio.EVENTS_STREAM}",
    f"$JS.API.STREAM.DELETE.{natsio.COMMANDS_STREAM}", f"$JS.API.STREAM.PURGE.{natsio.EVENTS_STREAM}",
    "$JS.API.STREAM.CREATE.KV_noetl_results", "$JS.API.STREAM.DELETE.KV_noetl_results",
    "$JS.API.STREAM.PURGE.KV_noetl_results", f"$JS.API.CONSUMER.DELETE.{natsio.COMMANDS_STREAM}.noetl-workers",
    f"$JS.API.CONSUMER.CREATE.{natsio.EVENTS_STREAM}", f"$JS.API.CONSUMER.CREATE.{natsio.COMMANDS_STREAM}.other",
    f"$JS.API.CONSUMER.CREATE.{natsio.COMMANDS_STREAM}.other.noetl.events.>",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{natsio.COMMANDS_STREAM}.other",
    f"$JS.API.CONSUMER.MSG.NEXT.{natsio.EVENTS_STREAM}.other", f"$JS.ACK.{natsio.EVENTS_STREAM}.x.1.1.1.1.1",
    "$JS.API.STREAM.MSG.DELETE.NOETL_EVENTS", "$JS.API.ACCOUNT.PURGE.x", "$SYS.REQ.SERVER.PING", "other.subject",
])
def test_the_worker_may_not_publish(subject: str) -> None:
    assert not natsperms.allowed(PERMS["worker"], subject, publish=True), subject


@pytest.mark.parametrize("subject", [
    natsio.events_subject(3, natsio.KIND_CALL), f"$JS.API.STREAM.INFO.{natsio.EVENTS_STREAM}",
    f"$JS.API.CONSUMER.MSG.NEXT.{natsio.COMMANDS_STREAM}.{pools.consumer_name('gpu', 'high')}",
    f"$JS.ACK.{natsio.COMMANDS_STREAM}.{pools.consumer_name('gpu', 'high')}.1.2.3.4.0",
    f"$JS.API.CONSUMER.CREATE.{natsio.COMMANDS_STREAM}.{pools.consumer_name('gpu', 'high')}"
    f".{natsio.commands_filter('gpu', 'high')}",
    "$KV.noetl_results.42", "$JS.API.DIRECT.GET.KV_noetl_results.$KV.noetl_results.42",
])
def test_the_worker_may_publish(subject: str) -> None:
    assert natsperms.allowed(PERMS["worker"], subject, publish=True), subject


def test_the_worker_reads_notices_only_through_its_pull_consumers() -> None:
    # no core-NATS copy of any pool's notices (or any events): a worker sees a notice only
    # when a pull request of its own is answered, on its role's inbox
    for subject in (natsio.commands_subject("default", "normal", 0), natsio.commands_subject("gpu", "high", 3),
                    natsio.events_subject(0, natsio.KIND_CALL), "_INBOX.api.x", "_INBOX.projector.x"):
        assert not natsperms.allowed(PERMS["worker"], subject, publish=False), subject
    assert natsperms.allowed(PERMS["worker"], "_INBOX.worker.abc.1", publish=False)
    assert natsperms.allowed(PERMS["worker"], natsio.cancel_subject(2), publish=False)


def test_only_the_api_manages_streams() -> None:
    for role in natsperms.ROLES:
        manage = [p for p in PERMS[role].publish if any(op in p for op in (".STREAM.CREATE.", ".STREAM.UPDATE."))]
        assert bool(manage) == (role == "api"), (role, manage)
        deletes = [p for p in PERMS[role].publish if ".DELETE." in p and "NOETL_COMMANDS" in p]
        # the api deletes the pre-pool shared consumer, and nothing else of the commands stream
        assert deletes == ([f"$JS.API.CONSUMER.DELETE.NOETL_COMMANDS.{natsio.LEGACY_WORKER_CONSUMER}"]
                           if role == "api" else []), role
        assert not [p for p in PERMS[role].publish if ".PURGE." in p or p in (">", "$JS.API.>")], role


def test_subject_matching() -> None:
    m = natsperms.matches
    assert m("a.*.c", "a.b.c") and not m("a.*.c", "a.b.d") and not m("a.*", "a.b.c")
    assert m("a.>", "a.b.c") and m("a.>", "a.b") and not m("a.>", "a")
    assert m(">", "x") and not m("a.b", "a.b.c") and not m("a.b.c", "a.b")


def test_the_authorization_block_names_every_user_and_hides_missing_passwords() -> None:
    text = natsperms.authorization_block({"worker": "s3cret"}, kv_bucket="cache1")
    for user in (*natsperms.ROLES, natsperms.ADMIN):
        assert f'{{user: "{user}"' in text
    assert '"s3cret"' in text and "$NOETL_NATS_PASSWORD_API" in text
    assert '"$KV.cache1.>"' in text and "noetl_results" not in text
    assert '{user: "noetl_worker"' in natsperms.authorization_block(user_prefix="noetl_")


def test_redact_hides_passwords() -> None:
    assert natsio.redact("tls://u:pw@h:4222,nats://h2:1") == "tls://u:***@h:4222,nats://h2:1"
    assert natsio.redact("nats://h:4222") == "nats://h:4222"
