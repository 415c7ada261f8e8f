"""What one python task exchange with a warm child costs the worker, one request at a
time (what a batch of loop iterations does today) against k requests written at once to
the same child and their k replies read back (pipelined: the sandbox protocol unchanged).

    .venv/bin/python scripts/measure_python_pipelining.py [--tasks 2000] [--depths 8,32]

Prints wall time per task and the worker process's CPU per task (user + system; the
child's own CPU is not counted). The measure behind ``PythonLane``: a parallel batch's
python iterations written ahead to one child.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

from noetl_store import encode_json
from noetl_worker.tools.python import HEADER, PythonPool

CODE = "result = x"


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def _report(what: str, n: int, wall: float, cpu: tuple[float, float], cpu0: tuple[float, float]) -> None:
    print(f"{what}: wall {1e6 * wall / n:.0f} us/task, worker CPU {1e6 * (cpu[0] - cpu0[0]) / n:.0f} us/task "
          f"(system {1e6 * (cpu[1] - cpu0[1]) / n:.0f})")


async def main(tasks: int, depths: list[int]) -> None:
    async with PythonPool(1) as pool:
        for _ in range(50):  # warm: the child compiles and caches the code once
            await pool.run(CODE, {"x": 1})
        cpu0, t0 = _cpu(), time.perf_counter()
        for _ in range(tasks):
            await pool.run(CODE, {"x": 1})
        _report("one at a time", tasks, time.perf_counter() - t0, _cpu(), cpu0)
        child = await pool._idle.get()  # the pool's own child, driven directly
        try:
            for k in depths:
                payload = encode_json({"code": CODE, "input": {"x": 1}, "context": {}, "libs": {}})
                frames = (HEADER.pack(len(payload)) + payload) * k
                cpu0, t0 = _cpu(), time.perf_counter()
                for _ in range(tasks // k):
                    assert child.proc.stdin is not None
                    child.proc.stdin.write(frames)
                    await child.proc.stdin.drain()
                    for _ in range(k):
                        reply = await child.receive()
                        assert reply.get("status") == "ok", reply
                _report(f"pipelined, {k} at once", k * (tasks // k), time.perf_counter() - t0, _cpu(), cpu0)
        finally:
            pool._idle.put_nowait(child)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--depths", default="8,32", help="requests written at once (comma-separated)")
    args = parser.parse_args()
    asyncio.run(main(args.tasks, [int(d) for d in args.depths.split(",") if d]))
