"""What the CLI prints: JSON documents for ``--json``, human summaries otherwise.

Machine output goes to stdout only; progress and errors go to stderr. Everything here
is pure (protobuf in, str/dict out) so it is unit-tested without a server.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from google.protobuf.timestamp_pb2 import Timestamp

from noetl_client import step_result, values
from noetl_common.vocab import PUBLIC_TERMINAL, ExecutionStatus, StepViewStatus
from noetl_proto.v1 import common_pb2, execution_pb2

if TYPE_CHECKING:
    from noetl_proto.v1 import shard_manager_pb2

TERMINAL = PUBLIC_TERMINAL
RESULT_PREVIEW_CHARS = 4000


class CliError(Exception):
    """An expected failure: print ``message`` on stderr, exit with ``code`` (no traceback)."""

    def __init__(self, message: str, code: int = 1, *, detail: str = "") -> None:
        self.message = message
        self.code = code
        self.detail = detail
        super().__init__(message)


def eprint(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


# Status colours on a terminal (ANSI SGR; plain text when the stream is not a terminal,
# NO_COLOR is set or TERM is dumb: https://no-color.org). Four codes do not justify a
# rendering library in a CLI whose start-up time is budgeted (docs/BENCHMARKS.md).
_COLOURS: dict[str, str] = {ExecutionStatus.COMPLETED: "32", ExecutionStatus.FAILED: "31", ExecutionStatus.CANCELLED: "35",
            ExecutionStatus.RUNNING: "33", ExecutionStatus.PENDING: "2"}


def colour_enabled(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


def paint(status: str, on: bool) -> str:
    """``status`` in its colour when ``on``."""
    code = _COLOURS.get(status)
    return f"\033[{code}m{status}\033[0m" if on and code else status


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------- enums and values


def execution_status(value: int) -> str:
    """``EXECUTION_STATUS_COMPLETED`` -> ``COMPLETED`` (unknown numbers stay visible)."""
    try:
        return common_pb2.ExecutionStatus.Name(value).removeprefix("EXECUTION_STATUS_")  # type: ignore[arg-type]
    except ValueError:
        return f"STATUS_{value}"


def step_status(value: int) -> str:
    try:
        return common_pb2.StepStatus.Name(value).removeprefix("STEP_STATUS_")  # type: ignore[arg-type]
    except ValueError:
        return f"STATUS_{value}"


def is_terminal(execution: execution_pb2.Execution) -> bool:
    return execution_status(execution.status) in TERMINAL


def struct_or_none(message: Any, field: str) -> dict[str, Any] | None:
    """``message.field`` (a Struct) as a dict; None when it is unset."""
    return values.from_struct(getattr(message, field)) if message.HasField(field) else None


def timestamp(ts: Timestamp) -> str | None:
    if not ts.seconds and not ts.nanos:
        return None
    return str(ts.ToDatetime().isoformat(timespec="milliseconds")) + "Z"


# ---------------------------------------------------------------- executions


def execution_json(execution: execution_pb2.Execution, *, error: str | None = None) -> dict[str, Any]:
    """The ``run --json`` document: execution_id, status, steps {name: {status, result}}, error."""
    steps: dict[str, dict[str, Any]] = {}
    for step in execution.steps:
        steps[step.name] = {"status": step_status(step.status), "result": step_result(step)}
        if step.HasField("loop"):
            steps[step.name]["loop"] = {"total": step.loop.total, "done": step.loop.done, "failed": step.loop.failed}
        if step.waiting:  # queued with no live worker that may take it (worker pools)
            steps[step.name]["waiting"] = step.waiting
    doc = {
        "execution_id": str(execution.execution_id),
        "status": execution_status(execution.status),
        "steps": steps,
        "error": error if error is not None else (execution.error or None),
    }
    if execution.rerun_of:  # a rerun (noetl-rt rerun) names its original
        doc["rerun_of"] = str(execution.rerun_of)
    if execution.waiting:  # PENDING behind a concurrency limit
        doc["waiting"] = execution.waiting
    return doc


def execution_detail_json(execution: execution_pb2.Execution) -> dict[str, Any]:
    """``status --json``: the run document plus playbook, times and per-step details."""
    doc = execution_json(execution)
    doc.update({
        "playbook_path": execution.playbook_path,
        "playbook_version": execution.playbook_version,
        "shard_id": execution.shard_id,
        "created_at": timestamp(execution.created_at),
        "started_at": timestamp(execution.started_at),
        "ended_at": timestamp(execution.ended_at),
    })
    for step in execution.steps:
        doc["steps"][step.name].update({
            "attempts": step.attempts, "visits": step.visits, "error": step.error or None,
        })
    return doc


def step_states(execution: execution_pb2.Execution) -> dict[str, str]:
    return {s.name: step_status(s.status) for s in execution.steps}


def progress_lines(previous: Mapping[str, str], execution: execution_pb2.Execution, *,
                   colour: bool = False) -> list[str]:
    """One line per step whose status differs from ``previous`` (step name -> status)."""
    current = step_states(execution)
    width = max([len(n) for n in current] + [5])
    return [f"  {name.ljust(width)}  {paint(status, colour)}" for name, status in current.items()
            if previous.get(name) != status]


def loop_progress_text(loop: execution_pb2.LoopProgress, rate: float | None = None) -> str:
    """``450/1000 (2 failed, 350/s)``: a loop's iterations done of its items."""
    done = f"{loop.done}/{loop.total}" if loop.total else f"{loop.done}"
    extra = [f"{loop.failed} failed"] if loop.failed else []
    if rate is not None:
        extra.append(f"{rate:,.0f}/s" if rate >= 10 else f"{rate:.1f}/s")
    return done + (f" ({', '.join(extra)})" if extra else "")


class LoopMeter:
    """Lines showing running loops' progress while an execution is followed: at most one
    per loop every ``interval`` seconds (a 100,000-item loop must not print 100,000
    lines), with the rate since the meter first saw the loop. Pure: the caller gives the
    clock."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._first: dict[str, tuple[float, int]] = {}
        self._shown: dict[str, tuple[float, int]] = {}

    def lines(self, execution: execution_pb2.Execution, now: float, *, force: bool = False) -> list[str]:
        out: list[str] = []
        running = [s for s in execution.steps if s.HasField("loop") and step_status(s.status) == StepViewStatus.RUNNING]
        width = max([len(s.name) for s in running] + [5])
        for s in running:
            key = f"{s.name}#{s.visits}"
            first = self._first.setdefault(key, (now, s.loop.done))
            shown = self._shown.get(key)
            if shown is not None and shown[1] == s.loop.done:
                continue  # nothing new
            if shown is not None and now - shown[0] < self.interval and not force:
                continue
            elapsed = now - first[0]
            rate = (s.loop.done - first[1]) / elapsed if elapsed >= 0.5 else None
            self._shown[key] = (now, s.loop.done)
            out.append(f"  {s.name.ljust(width)}  {loop_progress_text(s.loop, rate)}")
        return out


def _duration(execution: execution_pb2.Execution) -> str:
    start = execution.started_at if execution.started_at.seconds else execution.created_at
    if not start.seconds or not execution.ended_at.seconds:
        return ""
    secs = (execution.ended_at.ToNanoseconds() - start.ToNanoseconds()) / 1e9
    return f", {secs:.2f}s"


def pretty_value(value: Any, limit: int = RESULT_PREVIEW_CHARS) -> str:
    text = value if isinstance(value, str) else json.dumps(value, indent=2, sort_keys=True, default=str)
    if len(text) > limit:
        text = text[:limit] + f"\n... ({len(text) - limit} more characters; use --json for all of it)"
    return text


def execution_summary(execution: execution_pb2.Execution, *, error: str | None = None, colour: bool = False) -> str:
    """Human summary: status line, one line per step (a loop's iterations with it), then
    the results of the steps (each cut at ``RESULT_PREVIEW_CHARS``: ``--json`` has all)."""
    status = paint(execution_status(execution.status), colour)
    playbook = (f" ({execution.playbook_path} v{execution.playbook_version}{_duration(execution)})"
                if execution.playbook_path else "")
    rerun = f", reruns {execution.rerun_of}" if execution.rerun_of else ""
    lines = [f"execution {execution.execution_id} {status}{playbook}{rerun}"]
    err = error or execution.error
    if err:
        lines.append(f"error: {err}")
    if execution.waiting:
        lines.append(f"waiting: {execution.waiting}")
    if execution.steps:
        width = max(len(s.name) for s in execution.steps)
        lines.append("steps:")
        for s in execution.steps:
            first, *more = s.error.splitlines() or [""]
            extra = f"  ({first})" if first else ""
            if s.HasField("loop"):
                extra = f"  {loop_progress_text(s.loop)}{extra}"
            if s.waiting:
                extra = f"{extra}  waiting: {s.waiting}"
            lines.append(f"  {s.name.ljust(width)}  {paint(step_status(s.status), colour)}{extra}")
            lines.extend("      " + ln for ln in more)  # a python task's traceback
    results = [(s.name, step_result(s)) for s in execution.steps if s.HasField("result")]
    for name, value in results:
        lines.append(f"result of {name}:")
        lines.extend("  " + ln for ln in pretty_value(value).splitlines())
    return "\n".join(lines)


# ---------------------------------------------------------------- events


def _short(value: Any, limit: int = 100) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True,
                                                             default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def event_short_result(event: common_pb2.EventRecord) -> str:
    """``status ctx={...}`` or ``status ref=db:7`` from a result envelope, else the raw text cut short."""
    env = struct_or_none(event, "result")
    if not isinstance(env, dict):
        return _short(env)
    parts = []
    if env.get("status"):
        parts.append(str(env["status"]))
    ref = env.get("reference")
    if isinstance(ref, dict) and ref.get("ref_id"):
        parts.append(f"ref={ref.get('type', '?')}:{ref['ref_id']}")
    if env.get("context"):
        parts.append("ctx=" + _short(env["context"], 80))
    err = env.get("error")
    if err:
        parts.append("error=" + _short(err.get("message", err) if isinstance(err, dict) else err, 80))
    if not parts:
        return _short(env)
    return " ".join(parts)


EXECUTION_HEADER = ("ID", "STATUS", "PLAYBOOK", "CREATED", "DURATION", "ERROR")
ERROR_PREVIEW_CHARS = 60


def execution_list_json(execution: execution_pb2.Execution) -> dict[str, Any]:
    """One execution of ``list --json`` (no steps: the list reads only the execution rows)."""
    return {
        "execution_id": str(execution.execution_id),
        "status": execution_status(execution.status),
        "playbook_path": execution.playbook_path,
        "playbook_version": execution.playbook_version,
        "parent_execution_id": str(execution.parent_execution_id) if execution.parent_execution_id else None,
        "created_at": timestamp(execution.created_at),
        "ended_at": timestamp(execution.ended_at),
        "error": execution.error or None,
    }


def duration(execution: execution_pb2.Execution) -> str:
    """Started (or created) to ended, e.g. ``1.23s``; ``-`` while running."""
    start = execution.started_at if timestamp(execution.started_at) else execution.created_at
    if not timestamp(execution.ended_at) or not timestamp(start):
        return "-"
    seconds = (execution.ended_at.ToNanoseconds() - start.ToNanoseconds()) / 1e9
    return f"{seconds:.2f}s" if seconds < 120 else f"{seconds / 60:.1f}m"


def execution_row(execution: execution_pb2.Execution) -> tuple[str, ...]:
    """id, status, path vN, created, duration, short error (for ``table``)."""
    error = " ".join((execution.error or "").split())
    if len(error) > ERROR_PREVIEW_CHARS:
        error = error[:ERROR_PREVIEW_CHARS - 3] + "..."
    return (str(execution.execution_id), execution_status(execution.status),
            f"{execution.playbook_path} v{execution.playbook_version}", timestamp(execution.created_at) or "-",
            duration(execution), error or "-")


EVENT_HEADER = ("SEQ", "TYPE", "STEP", "COMMAND", "RESULT")


def event_row(event: common_pb2.EventRecord) -> tuple[str, ...]:
    """shard_seq, type, step, command_id, short result (for ``table``)."""
    return (str(event.shard_seq), event.event_type, event.step or "-", event.command_id or "-",
            event_short_result(event))


def event_line(event: common_pb2.EventRecord) -> str:
    return "  ".join(event_row(event)).rstrip()


def event_json(event: common_pb2.EventRecord) -> dict[str, Any]:
    return {
        "event_id": str(event.event_id), "shard_id": event.shard_id, "shard_seq": event.shard_seq,
        "event_type": event.event_type, "step": event.step or None, "command_id": event.command_id or None,
        "result": struct_or_none(event, "result"), "meta": values.from_struct(event.meta),
        "created_at": timestamp(event.created_at),
    }


TRACE_HEADER = ("REF", "PARENT", "TIER", "SIZE", "TASK", "COMMAND", "CREATED", "URI")


def trace_entry_json(entry: execution_pb2.TraceEntry) -> dict[str, Any]:
    """Ids as text (64-bit ids lose precision as JSON numbers in many readers)."""
    return {
        "ref_id": str(entry.ref_id), "parent_ref_id": str(entry.parent_ref_id) if entry.parent_ref_id else None,
        "tier": entry.tier, "uri": entry.uri, "size_bytes": entry.size_bytes, "task": entry.task or None,
        "command_id": entry.command_id or None, "step": entry.step or None, "sha256": entry.sha256 or None,
        "created_at": timestamp(entry.created_at),
    }


def trace_row(entry: execution_pb2.TraceEntry) -> tuple[str, ...]:
    return (str(entry.ref_id), str(entry.parent_ref_id or "-"), entry.tier, str(entry.size_bytes),
            entry.task or "-", entry.command_id or "-", timestamp(entry.created_at) or "-", entry.uri)


# ---------------------------------------------------------------- tables


def table(rows: Iterable[Sequence[object]], header: Sequence[str] | None = None) -> str:
    """Left-aligned columns separated by two spaces."""
    all_rows = [[str(c) for c in r] for r in rows]
    if header:
        all_rows.insert(0, list(header))
    if not all_rows:
        return ""
    widths = [max(len(r[i]) for r in all_rows if i < len(r)) for i in range(max(len(r) for r in all_rows))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in all_rows)


# ---------------------------------------------------------------- cluster


def shard_ranges(shards: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> ``0-2,5,7-8``; nothing -> ``-``."""
    ordered = sorted(set(shards))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def cluster_view(resp: shard_manager_pb2.DescribeResponse, now_ns: int | None = None) -> dict[str, Any]:
    """The Describe answer as a document: members with the shards each holds, and the
    shards that are unowned, owned by a member not alive, or whose lease ran out."""
    import time

    now = time.time_ns() if now_ns is None else now_ns
    alive = {m.runtime_id for m in resp.members if m.alive}
    held: dict[int, list[int]] = {}
    unsettled = []
    for s in resp.shards:
        expired = bool(timestamp(s.leased_until)) and s.leased_until.ToNanoseconds() < now
        if s.owner_runtime_id in alive and not expired:
            held.setdefault(s.owner_runtime_id, []).append(s.shard_id)
        else:
            why = ("no owner" if not s.owner_runtime_id else "lease expired" if expired
                   else f"owner {s.owner_instance or s.owner_runtime_id} not alive")
            unsettled.append({"role": s.role, "shard_id": s.shard_id, "epoch": s.epoch, "why": why})
    members = [{
        "role": m.role, "instance": m.instance, "runtime_id": str(m.runtime_id), "alive": m.alive,
        "address": m.address or None, "metrics": m.metrics_address or None, "pid": m.pid or None,
        "heartbeat_at": timestamp(m.heartbeat_at), "shards": sorted(held.get(m.runtime_id, [])),
    } for m in resp.members]
    return {
        "leader": {"instance": resp.leader_instance or None, "epoch": resp.leader_epoch},
        "members": members,
        "shards": [{"role": s.role, "shard_id": s.shard_id, "owner": s.owner_instance or None, "epoch": s.epoch,
                    "leased_until": timestamp(s.leased_until)} for s in resp.shards],
        "unsettled": unsettled,
    }


CLUSTER_HEADER = ("ROLE", "INSTANCE", "ALIVE", "SHARDS", "ADDRESS", "METRICS", "PID")


def cluster_text(view: Mapping[str, Any]) -> str:
    leader = view["leader"]
    lines = [f"leader: {leader['instance']} (epoch {leader['epoch']})" if leader["instance"]
             else "leader: none (no shard-manager holds the leader lease)"]
    rows = [(m["role"], m["instance"], "yes" if m["alive"] else "no",
             shard_ranges(m["shards"]) if m["shards"] else "-", m["address"] or "-", m["metrics"] or "-",
             m["pid"] or "-") for m in view["members"]]
    lines.append(table(rows, header=CLUSTER_HEADER) if rows else "no members")
    by_role: dict[str, list[int]] = {}
    for u in view["unsettled"]:
        by_role.setdefault(u["role"], []).append(u["shard_id"])
    for role, shards in sorted(by_role.items()):
        lines.append(f"not held by a live member: {role} shards {shard_ranges(shards)}")
    return "\n".join(lines)
