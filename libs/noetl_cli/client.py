"""Client commands: a blocking gRPC client of the api role.

Every RPC goes through ``Api.call`` (apichannel.py), the one place gRPC errors become
project errors: "cannot reach the api at X" when it cannot be reached, "the api cannot
serve the request: <its message>" when it answers that a dependency is down.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from noetl_client import ApiError, submit_request, values
from noetl_common.errors import InvalidInput, NoetlError, NotFound
from noetl_common.vocab import ExecutionStatus
from noetl_proto.v1 import common_pb2, execution_pb2

from . import output
from .apichannel import Api
from .output import CliError, eprint


def parse_payload(text: str | None) -> dict[str, Any] | None:
    """Validate ``--payload``: a JSON object that a Struct can carry (docs/CLIENTS.md "JSON
    values and numbers"); None when absent."""
    if text is None or text == "":
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CliError(f"--payload is not valid JSON: {exc}", code=2) from None
    if not isinstance(value, dict):
        raise CliError(f"--payload must be a JSON object ({{...}}), got {type(value).__name__}: {text.strip()[:60]}",
                       code=2)
    try:
        values.to_struct(value)
    except ValueError as exc:
        raise CliError(f"--payload: {exc}", code=2) from None
    return value


def parse_execution_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise CliError(f"execution id must be a number, got {text!r}", code=2) from None
    if value <= 0:
        raise CliError(f"execution id must be positive, got {value}", code=2)
    return value


def read_file(path: str) -> str:
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise CliError(f"file not found: {path}", code=2) from None
    except IsADirectoryError:
        raise CliError(f"{path} is a directory, not a playbook file", code=2) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", code=2) from None


# ---------------------------------------------------------------- run


class Follower:
    """Follows an execution to a terminal state (``noetl_client.Client.watch``:
    WatchExecution, falling back to polling GetExecution when the stream breaks).
    ``on_change`` gets each snapshot."""

    def __init__(self, api: Api, execution_id: int, deadline: float | None,
                 on_change: Callable[[execution_pb2.Execution], None]) -> None:
        self.api = api
        self.execution_id = execution_id
        self.deadline = deadline
        self.on_change = on_change

    def follow(self) -> execution_pb2.Execution | None:
        """The terminal snapshot, or None when the deadline passed first."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            for execution in self.api.client.watch(self.execution_id, timeout=timeout, changes_only=False):
                self.on_change(execution)
                if output.is_terminal(execution):
                    return execution
        except ApiError as exc:
            raise self.api.error(exc) from exc
        return None


def parse_playbook_ref(text: str) -> execution_pb2.PlaybookRef:
    """``--path PATH[@VERSION]`` -> PlaybookRef (version 0 = the latest registered)."""
    path, at, version_text = text.partition("@")
    if not path.strip():
        raise CliError(f"--path needs a catalog path, got {text!r}", code=2)
    version = 0
    if at:
        try:
            version = int(version_text)
        except ValueError:
            raise CliError(f"--path {text}: the version after @ must be a number, got {version_text!r}",
                           code=2) from None
        if version <= 0:
            raise CliError(f"--path {text}: the version must be positive, got {version}", code=2)
    return execution_pb2.PlaybookRef(path=path.strip(), version=version)


def run(api: Api, playbook_yaml: str = "", *, ref: execution_pb2.PlaybookRef | None = None,
        payload: dict[str, Any] | None = None, as_json: bool = False, timeout: float | None = None,
        idempotency_key: str = "", detach: bool = False, priority: str = "") -> int:
    """``noetl-rt run``: submit (a playbook's text, or a registered one by ``ref``), then
    follow with live progress on stderr and print the outcome, or with ``detach`` print
    the execution id and return. Inputs are validated by the caller (``parse_payload``,
    ``read_file``, ``parse_playbook_ref``) before any RPC. The submission carries
    ``idempotency_key``, or a fresh one: repeated on a transient failure, it never makes
    two executions."""
    import uuid  # here: only submissions make keys

    request = submit_request(playbook_yaml if ref is None else None, path=ref.path if ref is not None else None,
                             version=ref.version if ref is not None else 0, payload=payload,
                             idempotency_key=idempotency_key or f"cli-{uuid.uuid4()}",
                             timeout_seconds=timeout or 0.0, priority=priority or None)
    try:
        submitted = api.call_keyed(api.executions.SubmitExecution, request)
    except InvalidInput as exc:
        raise CliError(str(exc), code=2) from None
    except NotFound as exc:  # an unknown catalog path or version
        raise CliError(str(exc), code=2) from None
    execution_id = submitted.execution_id
    # an answer to a repeat of this submission (our own key) is no earlier submission of the user's
    deduplicated = submitted.deduplicated and bool(idempotency_key)
    dedup = " (deduplicated: an earlier submission with this idempotency key)" if deduplicated else ""
    eprint(f"execution {execution_id} submitted: {submitted.playbook_path} v{submitted.playbook_version}, "
           f"shard {submitted.shard_id}{dedup}")
    if detach:
        if as_json:
            output.print_json({"execution_id": str(execution_id), "playbook_path": submitted.playbook_path,
                               "playbook_version": submitted.playbook_version, "shard_id": submitted.shard_id,
                               "deduplicated": deduplicated})
        else:
            print(execution_id)
        return 0
    return follow_to_end(api, execution_id, as_json=as_json, timeout=timeout, grace=5.0)


def watch(api: Api, execution_id: int, *, as_json: bool = False, timeout: float | None = None) -> int:
    """``noetl-rt watch``: follow an execution already submitted to its end, as ``run`` does."""
    api.call(api.executions.GetExecution, execution_pb2.GetExecutionRequest(execution_id=execution_id))
    return follow_to_end(api, execution_id, as_json=as_json, timeout=timeout)


def follow_to_end(api: Api, execution_id: int, *, as_json: bool, timeout: float | None, grace: float = 0.0) -> int:
    """Follow with progress on stderr; print the outcome; 0 when COMPLETED, else 1 (or
    CliError when the client gave up after ``timeout`` + ``grace`` seconds)."""
    seen: dict[str, str] = {}
    last_status = [""]
    err_colour = output.colour_enabled(sys.stderr)
    meter = output.LoopMeter()

    def on_change(execution: execution_pb2.Execution) -> None:
        for line in output.progress_lines(seen, execution, colour=err_colour):
            eprint(line)
        for line in meter.lines(execution, time.monotonic()):
            eprint(line)
        seen.clear()
        seen.update(output.step_states(execution))
        status = output.execution_status(execution.status)
        if status != last_status[0] and status in output.TERMINAL:
            eprint(f"execution {status}")
        last_status[0] = status

    deadline = None if timeout is None else time.monotonic() + timeout + grace
    try:
        final = Follower(api, execution_id, deadline, on_change).follow()
    except KeyboardInterrupt:
        eprint(f"\ndetached; execution {execution_id} keeps running (noetl-rt cancel {execution_id})")
        raise CliError("interrupted", code=130) from None

    if final is None:
        snapshot = _latest(api, execution_id, include_results=True)
        within = f"--timeout {timeout:g}s" + (f" (+{grace:g}s)" if grace else "")
        message = f"timed out: execution {execution_id} did not finish within {within}"
        if as_json:
            doc = output.execution_json(snapshot, error=message) if snapshot is not None else {
                "execution_id": str(execution_id), "status": "UNKNOWN", "steps": {}, "error": message}
            output.print_json(doc)
        elif snapshot is not None:
            print(output.execution_summary(snapshot, error=message, colour=output.colour_enabled(sys.stdout)))
        raise CliError(message, code=1)

    resp = api.call(api.executions.GetExecution,
                    execution_pb2.GetExecutionRequest(execution_id=execution_id, include_results=True))
    execution = resp.execution
    if as_json:
        output.print_json(output.execution_json(execution))
    else:
        print(output.execution_summary(execution, colour=output.colour_enabled(sys.stdout)))
    return 0 if output.execution_status(execution.status) == ExecutionStatus.COMPLETED else 1


def _latest(api: Api, execution_id: int, *, include_results: bool) -> execution_pb2.Execution | None:
    try:
        resp = api.call(api.executions.GetExecution, execution_pb2.GetExecutionRequest(
            execution_id=execution_id, include_results=include_results), timeout=5)
    except NoetlError:
        return None
    return resp.execution


# ---------------------------------------------------------------- executions


def parse_status(text: str | None) -> int:
    """``--status running`` -> ExecutionStatus number (0 = any)."""
    if not text:
        return 0
    names = [n.removeprefix("EXECUTION_STATUS_") for n in common_pb2.ExecutionStatus.keys()
             if n != "EXECUTION_STATUS_UNSPECIFIED"]
    wanted = text.strip().upper()
    if wanted not in names:
        raise CliError(f"--status must be one of {', '.join(n.lower() for n in names)}; got {text!r}", code=2)
    return common_pb2.ExecutionStatus.Value(f"EXECUTION_STATUS_{wanted}")


def list_executions(api: Api, *, status: int = 0, path: str = "", limit: int = 20, as_json: bool = False) -> int:
    """``noetl-rt list``: the newest executions first (the read model), ``limit`` at most."""
    found: list[execution_pb2.Execution] = []
    token = ""
    while len(found) < limit:
        resp = api.call(api.executions.ListExecutions, execution_pb2.ListExecutionsRequest(
            page_size=min(limit - len(found), 500), page_token=token, status=status,  # type: ignore[arg-type]
            playbook_path=path))
        found.extend(resp.executions)
        token = resp.next_page_token
        if not token or not resp.executions:
            break
    found = found[:limit]
    if as_json:
        output.print_json([output.execution_list_json(e) for e in found])
    elif not found:
        print("no executions")
    else:
        print(output.table([output.execution_row(e) for e in found], header=output.EXECUTION_HEADER))
    return 0


def status(api: Api, execution_id: int, *, as_json: bool = False) -> int:
    resp = api.call(api.executions.GetExecution,
                    execution_pb2.GetExecutionRequest(execution_id=execution_id, include_results=True))
    if as_json:
        output.print_json(output.execution_detail_json(resp.execution))
    else:
        print(output.execution_summary(resp.execution, colour=output.colour_enabled(sys.stdout)))
    return 0


def event_pages(api: Api, execution_id: int, after: int,
                 page_size: int) -> Iterator[list[common_pb2.EventRecord]]:
    """The execution's events after event id ``after``, a page at a time, to the end."""
    while True:
        resp = api.call(api.executions.GetEvents, execution_pb2.GetEventsRequest(
            execution_id=execution_id, after_event_id=after, page_size=page_size))
        if resp.events:
            yield list(resp.events)
        if not resp.events or len(resp.events) < page_size:
            return
        after = max(e.event_id for e in resp.events)


def events(api: Api, execution_id: int, *, as_json: bool = False, page_size: int = 500, limit: int = 0,
           follow: bool = False, poll: float = 0.5) -> int:
    """``noetl-rt events``: every event, or the last ``limit``; ``follow`` then prints new
    events as they are recorded (one line each, ``--json``: one JSON object per line)
    until the execution is terminal and its last events are printed."""
    records: collections.deque[common_pb2.EventRecord] = collections.deque(maxlen=limit or None)
    for page in event_pages(api, execution_id, 0, page_size):
        records.extend(page)
    if not follow:
        if as_json:
            output.print_json({"execution_id": str(execution_id), "events": [output.event_json(e) for e in records]})
        elif not records:
            print(f"no events for execution {execution_id}")
        else:
            print(output.table([output.event_row(e) for e in records], header=output.EVENT_HEADER))
        return 0
    after = 0

    def emit(batch: Iterable[common_pb2.EventRecord]) -> None:
        nonlocal after
        for e in batch:
            print(json.dumps(output.event_json(e), default=str) if as_json else output.event_line(e), flush=True)
            after = max(after, e.event_id)

    emit(records)
    try:
        while True:
            terminal = _latest(api, execution_id, include_results=False)
            for page in event_pages(api, execution_id, after, page_size):
                emit(page)
            if terminal is not None and output.is_terminal(terminal):
                return 0  # its terminal event was recorded before the read model said so
            time.sleep(poll)
    except KeyboardInterrupt:
        return 130


def trace(api: Api, execution_id: int, step: str, *, as_json: bool = False) -> int:
    """The lineage of a step's result (ExecutionService.GetTrace), newest first."""
    resp = api.call(api.executions.GetTrace, execution_pb2.GetTraceRequest(execution_id=execution_id, step=step))
    if as_json:
        output.print_json({"execution_id": str(execution_id), "step": step, "from_manifest": resp.from_manifest,
                           "entries": [output.trace_entry_json(e) for e in resp.entries]})
        return 0
    if not resp.entries:
        print(f"step {step} of execution {execution_id} has no result reference")
        return 0
    print(output.table([output.trace_row(e) for e in resp.entries], header=output.TRACE_HEADER))
    if resp.from_manifest:
        print("(from the execution's manifest: its events were compacted)")
    return 0


def cancel(api: Api, execution_id: int, *, reason: str = "") -> int:
    resp = api.call(api.executions.CancelExecution,
                    execution_pb2.CancelExecutionRequest(execution_id=execution_id, reason=reason))
    if resp.accepted:
        print(f"cancel requested for execution {execution_id}")
        return 0
    eprint(f"execution {execution_id} was not cancelled (it already finished)")
    return 1


# ---------------------------------------------------------------- cluster


def cluster(api: Api, *, role: str = "", as_json: bool = False) -> int:
    """``noetl-rt cluster``: the shard-manager's view (Describe): the leader, each member
    with the shards it holds, and shards no live member holds. Exit 1 when a shard has
    no live owner or its lease ran out (the map is not settled)."""
    from noetl_proto.v1 import shard_manager_pb2

    resp = api.call(api.shard_manager.Describe, shard_manager_pb2.DescribeRequest(role=role))
    view = output.cluster_view(resp)
    if as_json:
        output.print_json(view)
    else:
        print(output.cluster_text(view))
    return 1 if view["unsettled"] else 0


# ---------------------------------------------------------------- catalog and credentials


def playbook_register(api: Api, path: str) -> int:
    from noetl_proto.v1 import catalog_pb2

    content = read_file(path)
    try:
        resp = api.call(api.catalog.RegisterPlaybook, catalog_pb2.RegisterPlaybookRequest(content=content))
    except InvalidInput as exc:
        raise CliError(str(exc), code=2) from None
    entry = resp.entry
    how = "registered" if resp.created else "unchanged (identical to the latest version)"
    print(f"{entry.path} version {entry.version} {how}")
    return 0


def playbook_list(api: Api, *, prefix: str = "", as_json: bool = False) -> int:
    from noetl_proto.v1 import catalog_pb2

    entries = []
    token = ""
    while True:
        resp = api.call(api.catalog.ListPlaybooks, catalog_pb2.ListPlaybooksRequest(
            path_prefix=prefix, page_size=200, page_token=token))
        entries.extend(resp.entries)
        token = resp.next_page_token
        if not token:
            break
    if as_json:
        output.print_json([{"path": e.path, "version": e.version, "kind": e.kind, "name": e.name,
                            "catalog_id": str(e.catalog_id), "created_at": output.timestamp(e.created_at)}
                           for e in entries])
    elif not entries:
        print("no playbooks registered")
    else:
        print(output.table([(e.path, e.version, e.kind, output.timestamp(e.created_at) or "") for e in entries],
                           header=("PATH", "VERSION", "KIND", "CREATED")))
    return 0


# One secret value (not a JSON object) becomes this field, by kind.
SECRET_FIELD = {"postgres": "dsn", "http_bearer": "token", "http_basic": "password", "generic": "value"}


def read_credential(kind: str, *, from_file: str | None = None, username: str | None = None,
                    stdin: TextIO | None = None) -> dict[str, Any]:
    """The credential's fields from ``from_file`` or stdin (prompted for without echo on a
    terminal): a JSON object, or one secret value stored under the kind's field
    (``SECRET_FIELD``). Messages never quote the input."""
    stream = stdin if stdin is not None else sys.stdin
    if from_file:
        try:
            text = Path(from_file).read_text()
        except OSError as exc:
            raise CliError(f"--from-file {from_file}: {exc.strerror or exc}", code=2) from None
    elif stream.isatty():
        import getpass

        text = getpass.getpass(f"secret for this {kind} credential (not echoed): ")
    else:
        text = stream.read()
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise CliError("no secret given: pipe it on stdin or give --from-file PATH", code=2)
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:  # the position only: never the text
            raise CliError(f"the credential is not valid JSON (line {exc.lineno}, column {exc.colno})",
                           code=2) from None
        if not isinstance(fields, dict):
            raise CliError("the credential must be a JSON object", code=2)
    else:
        field = SECRET_FIELD.get(kind)
        if field is None:
            raise CliError(f"for --kind {kind}, give the credential as a JSON object of its fields", code=2)
        fields = {field: text}
    if username is not None:
        fields["username"] = username
    if kind == "http_basic" and "username" not in fields:
        raise CliError("an http_basic credential needs --username (or a JSON object with username and password)",
                       code=2)
    return fields


def credential_add(api: Api, name: str, kind: str, fields: dict[str, Any]) -> int:
    from noetl_proto.v1 import catalog_pb2

    try:
        resp = api.call(api.credentials.PutCredential,
                        catalog_pb2.PutCredentialRequest(name=name, kind=kind, data=values.to_struct(fields)))
    except InvalidInput as exc:
        raise CliError(str(exc), code=2) from None
    print(f"credential {resp.name or name} {'created' if resp.created else 'updated'}")
    return 0


def credential_list(api: Api, *, as_json: bool = False) -> int:
    from noetl_proto.v1 import catalog_pb2

    resp = api.call(api.credentials.ListCredentials, catalog_pb2.ListCredentialsRequest())
    creds = list(resp.credentials)
    if as_json:
        output.print_json([{"name": c.name, "kind": c.kind, "updated_at": output.timestamp(c.updated_at)}
                           for c in creds])
    elif not creds:
        print("no credentials")
    else:
        print(output.table([(c.name, c.kind, output.timestamp(c.updated_at) or "") for c in creds],
                           header=("NAME", "KIND", "UPDATED")))
    return 0
