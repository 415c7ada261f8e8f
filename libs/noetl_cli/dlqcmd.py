"""``noetl-rt dlq ...``: dead letters (docs/ARCHITECTURE.md "Dead letters (as built)").

    dlq list [--execution ID] [--status dead|pending|redriven] [--step S] [--path P]
             [--limit N] [--all] [--json]                                       (any reader)
    dlq show ID [--json]                                                        (any reader)
    dlq redrive ID [ID ...] [--wait] [--timeout S] [--json]        (admin; submit: its own)
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from noetl_client import values
from noetl_common.errors import NoetlError
from noetl_common.vocab import EventType, ExecutionStatus
from noetl_proto.v1 import deadletter_pb2, deadletter_pb2_grpc

from . import client, output
from .apichannel import Api, WithApi
from .output import CliError

STATUSES = {"dead": deadletter_pb2.DEAD_LETTER_STATUS_DEAD,
            "pending": deadletter_pb2.DEAD_LETTER_STATUS_REDRIVE_PENDING,
            "redriven": deadletter_pb2.DEAD_LETTER_STATUS_REDRIVEN}
_STATUS_NAMES = {v: k for k, v in STATUSES.items()}
_ENDS: dict[str, str] = {EventType.PLAYBOOK_COMPLETED: ExecutionStatus.COMPLETED,
                         EventType.PLAYBOOK_FAILED: ExecutionStatus.FAILED,
                         EventType.PLAYBOOK_CANCELLED: ExecutionStatus.CANCELLED}

def add_parsers(sub: Any, with_api: argparse.ArgumentParser, run: WithApi) -> None:
    """The ``dlq`` command group; ``run(args, fn)`` calls ``fn`` with the api."""
    dq = sub.add_parser("dlq", help="dead letters: commands that exhausted their attempts; inspect and redrive"
                        ).add_subparsers(dest="action", metavar="ACTION")
    dq.required = True
    p = dq.add_parser("list", parents=[with_api], help="list dead letters, newest first")
    p.add_argument("--execution", type=int, default=0, metavar="ID", help="of one execution")
    p.add_argument("--status", choices=list(STATUSES), help="dead (not redriven), pending (a redrive is"
                   " committed) or redriven")
    p.add_argument("--step", default="", help="of one step")
    p.add_argument("--path", default="", help="of one playbook (catalog path)")
    p.add_argument("--limit", type=int, default=100, metavar="N", help="at most N (default 100)")
    p.add_argument("--all", action="store_true", help="every page")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: run(a, lambda api: list_dead_letters(api, a)))
    p = dq.add_parser("show", parents=[with_api], help="one dead letter: its error, attempts, worker, and"
                      " whether it can be redriven")
    p.add_argument("id", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: run(a, lambda api: show(api, a.id, as_json=a.json)))
    p = dq.add_parser("redrive", parents=[with_api], help="issue dead letters once more into their execution"
                      " (admin, or the submit token of the execution)")
    p.add_argument("ids", type=int, nargs="+", metavar="ID")
    p.add_argument("--wait", action="store_true", help="then wait for the execution(s) to end; exit 1 unless"
                   " they complete")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="with --wait: at most S seconds")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: run(a, lambda api: redrive(api, a)))


def _stub(api: Api) -> deadletter_pb2_grpc.DeadLetterServiceStub:
    return deadletter_pb2_grpc.DeadLetterServiceStub(api.channel)


def dead_letter_dict(d: deadletter_pb2.DeadLetter) -> dict[str, Any]:
    err = d.error
    error: dict[str, Any] = {"code": err.code, "message": err.message, "kind": err.kind}
    if err.exception_type:
        error["exception_type"] = err.exception_type
    if err.traceback:
        error["traceback"] = err.traceback
    if err.status_code:
        error["status_code"] = err.status_code
    if err.HasField("details"):
        error["details"] = values.from_struct(err.details)
    return {"dead_letter_id": d.dead_letter_id, "execution_id": d.execution_id, "shard_id": d.shard_id,
            "playbook_path": d.playbook_path, "command_id": d.command_id, "step": d.step,
            "loop_instance": d.loop_instance or None, "loop_index": d.loop_index if d.loop_instance else None,
            "attempts": d.attempts, "reason": d.reason, "error": error, "worker_id": d.worker_id,
            "status": _STATUS_NAMES.get(d.status, "dead"), "redrive_command_id": d.redrive_command_id,
            "created_at": d.created_at.ToJsonString() if d.HasField("created_at") else "",
            "redriven_at": d.redriven_at.ToJsonString() if d.HasField("redriven_at") else "",
            "redriven_by": d.redriven_by, "refusal": d.refusal}


def _error_line(d: dict[str, Any]) -> str:
    err = d["error"]
    head = err.get("exception_type") or err.get("code") or ""
    text = f"{head}: {err['message']}" if head else err["message"]
    return text.splitlines()[0][:120] if text else "-"


def list_dead_letters(api: Api, a: argparse.Namespace) -> int:
    if a.limit <= 0:
        raise CliError("--limit must be positive", code=2)
    rows: list[dict[str, Any]] = []
    token = ""
    while True:
        page = min(1000, a.limit - len(rows)) if not a.all else 1000
        resp = api.call(_stub(api).ListDeadLetters, deadletter_pb2.ListDeadLettersRequest(
            execution_id=a.execution,
            status=STATUSES[a.status] if a.status else deadletter_pb2.DEAD_LETTER_STATUS_UNSPECIFIED, step=a.step,
            playbook_path=a.path, page_size=page, page_token=token))
        rows += [dead_letter_dict(d) for d in resp.dead_letters]
        token = resp.next_page_token
        if not token or (not a.all and len(rows) >= a.limit):
            break
    if a.json:
        print(json.dumps(rows))
        return 0
    print(output.table([(r["dead_letter_id"], r["execution_id"], r["step"] + (
        f"[{r['loop_index']}]" if r["loop_index"] is not None else ""), r["attempts"], r["reason"],
        r["worker_id"] or "-", r["status"], _error_line(r)) for r in rows],
        header=["ID", "EXECUTION", "STEP", "ATTEMPTS", "REASON", "WORKER", "STATUS", "ERROR"]))
    return 0


def show(api: Api, dead_letter_id: int, *, as_json: bool) -> int:
    resp = api.call(_stub(api).GetDeadLetter, deadletter_pb2.GetDeadLetterRequest(dead_letter_id=dead_letter_id))
    d = dead_letter_dict(resp.dead_letter)
    d["redrivable"] = resp.redrivable
    d["not_redrivable_reason"] = resp.not_redrivable_reason
    if as_json:
        print(json.dumps(d))
        return 0
    err = d["error"]
    lines = [
        f"dead letter {d['dead_letter_id']}  ({d['status']})",
        f"execution   {d['execution_id']}  {d['playbook_path']}  shard {d['shard_id']}",
        f"step        {d['step']}" + (f"  iteration {d['loop_index']} of loop {d['loop_instance']}"
                                       if d["loop_instance"] else ""),
        f"command     {d['command_id']}",
        f"attempts    {d['attempts']}  ({'its result was an error' if d['reason'] == 'failed' else 'claim leases ran out'})",
        f"worker      {d['worker_id'] or '-'}",
        f"at          {d['created_at']}",
        f"error       {err.get('code') or '-'}" + (f" ({err['kind']})" if err.get("kind") else ""),
    ]
    message = (f"{err['exception_type']}: " if err.get("exception_type") else "") + err["message"]
    lines += ["  " + line for line in message.splitlines()]
    if err.get("traceback"):
        lines += ["  " + line for line in err["traceback"].rstrip().splitlines()]
    if d["status"] == "redriven":
        lines.append(f"redriven    {d['redriven_at']} by {d['redriven_by'] or '-'} as {d['redrive_command_id']}")
    if d["refusal"]:
        lines.append(f"refused     {d['refusal']}")
    lines.append("redrivable  yes" if d["redrivable"] else f"redrivable  no: {d['not_redrivable_reason']}")
    print("\n".join(lines))
    return 0


def redrive(api: Api, a: argparse.Namespace) -> int:
    done: list[dict[str, Any]] = []
    for dead_letter_id in a.ids:
        resp = api.call(_stub(api).RedriveDeadLetter,
                        deadletter_pb2.RedriveDeadLetterRequest(dead_letter_id=dead_letter_id))
        d = dead_letter_dict(resp.dead_letter)
        d["already_requested"] = resp.already_requested
        done.append(d)
        if not a.json:
            print(f"dead letter {dead_letter_id} ({d['step']}"
                  + (f"[{d['loop_index']}]" if d["loop_index"] is not None else "")
                  + f" of execution {d['execution_id']}): "
                  + ("a redrive was pending already" if resp.already_requested else "redrive committed"))
    if a.json and not a.wait:
        print(json.dumps(done))
    if not a.wait:
        return 0
    status = _wait(api, done, a.timeout)
    if a.json:
        print(json.dumps({"dead_letters": done, "executions": status}))
    else:
        for eid, st in status.items():
            print(f"execution {eid}: {st}")
    return 0 if all(s == ExecutionStatus.COMPLETED for s in status.values()) else 1


def _wait(api: Api, done: list[dict[str, Any]], timeout: float) -> dict[int, str]:
    """Wait until every redrive is applied (or refused) and each execution ended."""
    deadline = time.monotonic() + timeout
    out: dict[int, str] = {}
    for d in done:
        while True:
            got = api.call(_stub(api).GetDeadLetter,
                           deadletter_pb2.GetDeadLetterRequest(dead_letter_id=d["dead_letter_id"]))
            cur = dead_letter_dict(got.dead_letter)
            if cur["status"] == "redriven":
                break
            if cur["status"] == "dead":  # the engine refused it
                raise CliError(f"dead letter {d['dead_letter_id']}: the engine refused the redrive: {cur['refusal']}")
            _tick(deadline, f"the redrive of dead letter {d['dead_letter_id']} to be applied")
    for eid in sorted({d["execution_id"] for d in done}):
        follow = _Follow(eid)
        while (status := follow.status(api)) is None:
            _tick(deadline, f"execution {eid} to end")
        out[eid] = status
    return out


class _Follow:
    """An execution's event log read forward: its status once it ended after its latest
    redrive (the read model may still show the failure the redrive undid)."""

    def __init__(self, execution_id: int) -> None:
        self.execution_id = execution_id
        self.after = 0
        self.last_redrive = 0
        self.ended: tuple[int, str] | None = None

    def status(self, api: Api) -> str | None:
        for page in client.event_pages(api, self.execution_id, self.after, 1000):
            for e in page:
                self.after = max(self.after, e.event_id)
                if e.event_type == EventType.COMMAND_REDRIVEN:
                    self.last_redrive = max(self.last_redrive, e.shard_seq)
                elif e.event_type in _ENDS:
                    self.ended = (e.shard_seq, _ENDS[e.event_type])
        if self.ended is not None and self.ended[0] > self.last_redrive:
            return self.ended[1]
        return None


def _tick(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise NoetlError(f"timed out waiting for {what}")
    time.sleep(0.2)


__all__ = ["add_parsers", "dead_letter_dict"]
