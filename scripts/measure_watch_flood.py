"""Many WatchExecution streams on one running execution, and what they cost everyone else.

    .venv/bin/noetl-rt dev up   # in another shell
    PYTHONPATH=. .venv/bin/python scripts/measure_watch_flood.py [--streams 2000]

Submits a python step that sleeps 20 s, opens ``--streams`` WatchExecution streams on it
(one thread each, one channel), and 5 s later submits a one-step canary and times it to
COMPLETED (GetExecution every 50 ms). Prints the canary's time and how the streams ended.
docs/ARCHITECTURE.md (the projector's paragraph) cites it.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid

import grpc

from noetl_cli.apichannel import Api
from noetl_cli.stackstate import StackState
from noetl_proto.v1 import execution_pb2

HEADER = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {{name: {name}, path: scripts/{name}}}\n"
SLEEPER = HEADER.format(name="watched") + (
    "workflow:\n  - step: start\n    tool: {kind: python, code: \"import time\\ntime.sleep(20)\"}\n")
CANARY = HEADER.format(name="canary") + "workflow:\n  - step: start\n    tool: {kind: python, code: \"result = 42\"}\n"
TERMINAL = {execution_pb2.Execution.DESCRIPTOR.fields_by_name["status"].enum_type.values_by_name[n].number
            for n in ("EXECUTION_STATUS_COMPLETED", "EXECUTION_STATUS_FAILED", "EXECUTION_STATUS_CANCELLED")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--home", default=".noetl", help="the local stack's home (noetl-rt dev up)")
    args = parser.parse_args()
    state = StackState.load(args.home)
    if state is None:
        raise SystemExit(f"no local stack under {args.home}: start one with `noetl-rt dev up`")
    api = Api(state.api, token=state.tokens.get("admin", ""), ca_file=state.ca_file)

    def submit(text: str) -> int:
        request = execution_pb2.SubmitExecutionRequest(playbook_yaml=text, idempotency_key=str(uuid.uuid4()))
        return int(api.executions.SubmitExecution(request, timeout=30).execution_id)

    watched = submit(SLEEPER)
    ends: dict[str, int] = {}
    lock = threading.Lock()

    def watch() -> None:
        try:
            for _ in api.executions.WatchExecution(execution_pb2.WatchExecutionRequest(execution_id=watched),
                                                   timeout=60):
                pass
            end = "OK"
        except grpc.RpcError as exc:
            end = exc.code().name  # type: ignore[attr-defined]
        with lock:
            ends[end] = ends.get(end, 0) + 1

    threads = [threading.Thread(target=watch, daemon=True) for _ in range(args.streams)]
    for thread in threads:
        thread.start()
    time.sleep(5)
    t0 = time.monotonic()
    canary = submit(CANARY)
    while True:
        status = api.executions.GetExecution(execution_pb2.GetExecutionRequest(execution_id=canary),
                                             timeout=30).execution.status
        if status in TERMINAL or time.monotonic() - t0 > 60:
            break
        time.sleep(0.05)
    print(f"canary: {execution_pb2.Execution.DESCRIPTOR.fields_by_name['status'].enum_type.values_by_number[status].name}"
          f" in {time.monotonic() - t0:.2f} s with {args.streams} streams open")
    for thread in threads:
        thread.join(timeout=90)
    print(f"streams ended: {ends}")


if __name__ == "__main__":
    main()
