"""What one loop iteration costs the worker process itself: a batch command of ``--items``
iterations of the fan-out's python task (``result = i * 2``, input ``{i: "{{ i }}"}``)
run through ``runner.execute_command`` with a real python sandbox pool and an in-memory
result store, so no Postgres, NATS or gRPC time is in the figure.

    .venv/bin/python scripts/measure_worker_iteration.py [--items 32] [--runs 200]

Prints this process's CPU (user + system) per iteration; the sandbox children's own CPU
is not in it. To compare two builds, run it interleaved with ``PYTHONPATH=<other
checkout>/libs:<other checkout>/services/worker``. docs/PERFORMANCE.md "Measured and not
kept" cites it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource

from noetl_proto.v1 import messages_pb2
from noetl_store import MemoryResultStore
from noetl_worker.runner import execute_command
from noetl_worker.tools import PythonPool, Tools


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def batch(items: int) -> messages_pb2.Command:
    spec = {"step": "fan", "tool": {"kind": "python", "input": {"i": "{{ i }}"}, "code": "result = i * 2"}}
    context = {"loop": {"instance": "fan:1", "index": 0, "count": items, "iterator": "i", "mode": "parallel"},
               "iter": {"i": 0, "_index": 0}, "loop_index": 0, "batch_items": list(range(items)),
               "workload": {"n": items}, "steps": {}, "ctx": {}}
    return messages_pb2.Command(command_id=f"1:fan:1:0+{items}", execution_id=1, step="fan", attempt=1,
                                kind="python", spec_json=json.dumps(spec), context_json=json.dumps(context))


async def measure(items: int, runs: int) -> None:
    async with PythonPool(2) as pool:
        tools = Tools(python=pool)
        store = MemoryResultStore()
        command = batch(items)
        for _ in range(max(1, runs // 10)):  # warm: the children, the template and code caches
            await execute_command(command, store, tools, batch_budget_sec=60)
        start = _cpu()
        for _ in range(runs):
            result = await execute_command(command, store, tools, batch_budget_sec=60)
            assert len(result.iterations) == items
        spent = _cpu() - start
    print(f"{runs} batches of {items}: {spent / (runs * items) * 1e6:.1f} us of worker CPU per iteration")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(measure(args.items, args.runs))


if __name__ == "__main__":
    main()
