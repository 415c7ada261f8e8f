"""``noetl-rt rerun ID [--from STEP]``: rerun a finished execution from its failed step
(docs/ARCHITECTURE.md "Rerun"). A new execution, linked to the original; the steps that
completed keep their results and do not run again. Follows it to the end like ``run``
(``--detach``: print the new id and return).
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from typing import Any

from noetl_common.errors import Conflict, InvalidInput, NotFound
from noetl_proto.v1 import execution_pb2

from . import client, output
from .apichannel import Api
from .output import CliError, eprint

WithApi = Callable[..., int]


def add_parser(sub: Any, with_api: argparse.ArgumentParser, run: WithApi,
               positive: Callable[[str], Any]) -> None:
    p = sub.add_parser("rerun", parents=[with_api], help="rerun a finished execution from its failed step",
                       description="Start a new execution that reruns a finished one from the step that failed it"
                                   " (or --from STEP): completed steps keep their results (by reference) and do not"
                                   " run again; a loop reruns only its failed iterations. Same playbook version and"
                                   " payload as the original. Follows it to the end unless --detach.")
    p.add_argument("execution_id", metavar="ID", help="the execution to rerun")
    p.add_argument("--from", dest="from_step", default="", metavar="STEP",
                   help="rerun from this step (its result and those of the steps after it are discarded)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--timeout", type=positive, metavar="S",
                   help="execution timeout in seconds (default: the original's; the client waits at most S+5 s)")
    p.add_argument("--idempotency-key", default="", metavar="K",
                   help="rerunning with K returns the same new execution (default: a fresh key per call)")
    p.add_argument("--detach", action="store_true", help="print the new execution id and return once committed")
    p.set_defaults(handler=lambda a: _handle(a, run))


def _handle(a: argparse.Namespace, run: WithApi) -> int:
    """Arguments are checked before the api is contacted."""
    execution_id = client.parse_execution_id(a.execution_id)
    if a.from_step is not None and a.from_step != a.from_step.strip():
        raise CliError(f"--from: a step name has no surrounding spaces, got {a.from_step!r}", code=2)
    return run(a, lambda api: rerun(api, execution_id, from_step=a.from_step, as_json=a.json, timeout=a.timeout,
                                    idempotency_key=a.idempotency_key, detach=a.detach), needs=("postgres", "nats"))


def rerun(api: Api, execution_id: int, *, from_step: str = "", as_json: bool = False,
          timeout: float | None = None, idempotency_key: str = "", detach: bool = False) -> int:
    request = execution_pb2.RerunExecutionRequest(
        execution_id=execution_id, from_step=from_step, timeout_seconds=timeout or 0.0,
        # a key per call even when none is given: repeated on a transient failure, it never
        # makes two reruns
        idempotency_key=idempotency_key or f"cli-{uuid.uuid4()}")
    try:
        resp = api.call_keyed(api.executions.RerunExecution, request)
    except (InvalidInput, NotFound) as exc:
        raise CliError(str(exc), code=2) from None
    except Conflict as exc:
        raise CliError(f"cannot rerun: {exc}", code=1) from None
    if resp.deduplicated:
        eprint(f"execution {resp.execution_id} reruns {execution_id} (deduplicated: an earlier rerun with this"
               " idempotency key)")
    else:
        eprint(f"execution {resp.execution_id} reruns {execution_id} from {', '.join(resp.rerun_steps)}"
               f" (keeps {', '.join(resp.kept_steps) or 'nothing'}): {resp.playbook_path} v{resp.playbook_version},"
               f" shard {resp.shard_id}")
    if detach:
        if as_json:
            output.print_json({"execution_id": str(resp.execution_id), "rerun_of": str(execution_id),
                               "rerun_steps": list(resp.rerun_steps), "kept_steps": list(resp.kept_steps),
                               "playbook_path": resp.playbook_path, "playbook_version": resp.playbook_version,
                               "shard_id": resp.shard_id, "deduplicated": resp.deduplicated})
        else:
            print(resp.execution_id)
        return 0
    return client.follow_to_end(api, resp.execution_id, as_json=as_json, timeout=timeout, grace=5.0)


__all__ = ["add_parser", "rerun"]
