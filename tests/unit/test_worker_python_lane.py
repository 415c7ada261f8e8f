"""A python lane (``PythonLane``): the tasks of one batch written ahead to one child of
the pool. They still run one at a time, in the order they were made; a timeout runs from
a task's own start; a task that overruns, crashes its interpreter, runs out of memory or
is cancelled costs the child, and the tasks behind it run in another; the child goes back
to the pool for anyone else when the lane ends."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from waiting import until

from noetl_worker.tools import PythonPool
from noetl_worker.tools.outcome import ToolOutcome
from noetl_worker.tools.python import PythonLane

# what each task reports: its child, its place in that child's sequence, its input, when it ran
TRACE = ("import os, sys, time\nsys.seq = getattr(sys, 'seq', 0) + 1\nt0 = time.monotonic()\n"
         "time.sleep(s)\nreturn [os.getpid(), sys.seq, n, t0, time.monotonic()]")


def traced(out: ToolOutcome) -> list[Any]:
    assert out.status == "ok", out.error
    assert isinstance(out.data, list)
    return out.data


async def test_a_lanes_tasks_run_in_one_child_one_at_a_time_in_the_order_they_were_made() -> None:
    async with PythonPool(2) as pool:
        async with pool.lane() as lane:
            outs = await asyncio.gather(*(lane.run(TRACE, {"n": n, "s": 0.005}) for n in range(20)))
        runs = [traced(o) for o in outs]
        assert len({pid for pid, *_ in runs}) == 1
        seqs = [seq for _, seq, *_ in runs]
        assert seqs == list(range(seqs[0], seqs[0] + 20))  # in the order made, none skipped
        assert [n for _, _, n, *_ in runs] == list(range(20))
        assert all(later[3] >= earlier[4] for earlier, later in itertools.pairwise(runs))  # never two at once
        assert pool.idle == pool.alive == 2  # the child is back in the pool


async def test_requests_are_written_before_the_replies_before_them_come_back() -> None:
    async with PythonPool(1) as pool, pool.lane() as lane:
        runs = [asyncio.ensure_future(lane.run(TRACE, {"n": n, "s": 0.3 if n == 0 else 0})) for n in range(5)]
        await until(lambda: len(lane.pending) == 5, timeout=5, what="all five requests to be written",
                    interval=0.005)
        assert not any(r.done() for r in runs)  # the first still runs: the others are queued in its child
        assert [traced(o)[2] for o in await asyncio.gather(*runs)] == list(range(5))


async def test_a_timeout_runs_from_the_tasks_own_start() -> None:
    async with PythonPool(1) as pool, pool.lane() as lane:
        # the third is answered 0.6 s after it was written, 0.2 s after its start
        outs = await asyncio.gather(*(lane.run(TRACE, {"n": n, "s": 0.2}, timeout_sec=0.35) for n in range(3)))
        assert [traced(o)[2] for o in outs] == [0, 1, 2]
        assert pool.replacements == 0


async def test_a_task_that_overruns_costs_its_child_and_the_ones_behind_it_run_in_another() -> None:
    async with PythonPool(1) as pool:
        async with pool.lane() as lane:
            outs = await asyncio.gather(*(lane.run(TRACE, {"n": n, "s": 30 if n == 1 else 0}, timeout_sec=0.3)
                                          for n in range(4)))
        assert outs[1].error is not None and outs[1].error.code == "TIMEOUT"
        assert outs[1].error.message == "task exceeded its timeout of 0.3 s"
        first, rest = traced(outs[0]), [traced(o) for o in outs[2:]]
        assert [r[2] for r in rest] == [2, 3]
        assert {r[0] for r in rest} != {first[0]} and len({r[0] for r in rest}) == 1
        assert pool.replacements == 1
        assert (await pool.run("return 'after'", {}, timeout_sec=5)).data == "after"


async def test_a_task_that_ends_its_interpreter_fails_alone() -> None:
    async with PythonPool(1) as pool, pool.lane() as lane:
        code = "import os\nif n == 1:\n    os._exit(3)\nreturn n"
        outs = await asyncio.gather(*(lane.run(code, {"n": n}, timeout_sec=10) for n in range(4)))
        assert [o.data for o in outs] == [0, None, 2, 3]
        assert outs[1].error is not None and outs[1].error.code == "SANDBOX_EXITED"
        assert "exited with code 3" in outs[1].error.message


async def test_a_task_past_the_memory_limit_fails_alone_and_the_ones_behind_it_run_in_a_fresh_child() -> None:
    async with PythonPool(1, memory_mb=256) as pool, pool.lane() as lane:
        code = "import os\nif n == 1:\n    x = bytearray(512 * 1024 * 1024)\nreturn [n, os.getpid()]"
        runs = [asyncio.ensure_future(lane.run(code, {"n": n}, timeout_sec=30)) for n in range(4)]
        first = await runs[0]
        # The worker busy while the child answers the rest: all the replies wait in the pipe
        # together, the one after the out-of-memory one included.
        time.sleep(1.0)  # noqa: ASYNC251 - the point: the event loop held up
        outs = [first, *await asyncio.gather(*runs[1:])]
        assert outs[1].error is not None and outs[1].error.code == "MEMORY_LIMIT"
        values = [o.data for o in outs if o.ok]
        assert [v[0] for v in values] == [0, 2, 3]
        assert values[0][1] not in {v[1] for v in values[1:]}  # not in the interpreter that ran out


async def test_cancelling_a_lane_kills_its_child_and_the_pool_recovers(tmp_path: Path) -> None:
    started = tmp_path / "started"
    async with PythonPool(1) as pool:
        code = f"import pathlib, time\npathlib.Path({str(started)!r}).write_text('1')\ntime.sleep(30)"

        async def batch() -> list[ToolOutcome]:
            async with pool.lane() as lane:
                return await asyncio.gather(*(lane.run(code, {}) for _ in range(3)))

        task = asyncio.ensure_future(batch())
        await until(started.exists, timeout=10, what="the first task to start", interval=0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await pool.run("return 'after cancel'", {}, timeout_sec=5)).data == "after cancel"
        assert pool.replacements == 1


async def test_lanes_and_single_tasks_share_the_children_one_reader_at_a_time() -> None:
    """A lane's child goes back to the pool only once the lane stopped reading its pipe."""
    async with PythonPool(2) as pool:

        async def lane_of(k: int) -> list[Any]:
            async with pool.lane() as lane:
                return [o.data for o in await asyncio.gather(*(lane.run("return n", {"n": n}) for n in range(k)))]

        for _ in range(10):
            outs = await asyncio.gather(*(lane_of(k) for k in (1, 3, 5)),
                                        *(pool.run("return 'single'", {}, timeout_sec=5) for _ in range(4)))
            assert outs[:3] == [[0], [0, 1, 2], [0, 1, 2, 3, 4]]
            assert all(isinstance(o, ToolOutcome) and o.data == "single" for o in outs[3:])
        assert pool.replacements == 0


async def test_a_lanes_child_serves_the_next_task_as_soon_as_the_lane_ends() -> None:
    """It goes back to the pool only once the lane stopped reading its pipe: the next task,
    made at once, is the child's only reader."""
    async with PythonPool(1) as pool:
        for n in range(5):
            async with pool.lane() as lane:
                assert (await lane.run("return n", {"n": n})).data == n
            assert (await pool.run("return 'next'", {})).data == "next"  # no timeout: in this very task
        assert pool.replacements == 0


async def test_an_unused_lane_takes_no_child() -> None:
    async with PythonPool(1) as pool:
        lane = PythonLane(pool)
        await lane.close()
        assert lane.child is None and pool.idle == 1
        start = time.perf_counter()
        assert (await pool.run("return 1", {}, timeout_sec=5)).data == 1
        assert time.perf_counter() - start < 1


async def test_a_lanes_pace_leaves_out_the_lanes_it_shared_the_pool_with_but_not_its_tasks_waits() -> None:
    """What sizes a loop's later batches (runner: the summary's ``ms``): four lanes of quick
    tasks at once report about a quarter of their wall time each; tasks that wait report
    their own time, however many lanes there are."""
    async with PythonPool(4) as pool:

        async def lane_of(code: str, k: int) -> tuple[float, float, float]:
            async with pool.lane() as lane:
                await lane.acquire()
                start = time.monotonic()
                outs = await asyncio.gather(*(lane.run(code, {"n": n}) for n in range(k)))
                assert all(o.ok for o in outs)
                wall = 1000 * (time.monotonic() - start)
            return wall, lane.pace_ms(wall), lane.task_ms

        quick = await asyncio.gather(*(lane_of("return n", 300) for _ in range(4)))
        for wall, pace, task_ms in quick:
            assert task_ms <= pace < wall / 2.5  # about wall / 4: four lanes held children throughout
        waiting = await asyncio.gather(*(lane_of("import time\ntime.sleep(0.05)\nreturn n", 3) for _ in range(4)))
        for wall, pace, task_ms in waiting:
            assert pace >= task_ms >= 150 and pace <= wall
        assert pool.lanes == 0


# A task that writes a reply of its own on the protocol pipe (the child's private copy of
# its stdout: the write end of a pipe that is not its stderr), one that is not a reply
# object, then keeps running: the worker must not wait for that interpreter to exit.
FORGED = """import fcntl, os, struct, time
err = os.readlink('/proc/self/fd/2')
for name in os.listdir('/proc/self/fd'):
    fd = int(name)
    path = os.readlink(f'/proc/self/fd/{fd}')
    if path.startswith('pipe:') and path != err and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
        os.write(fd, struct.pack('>I', 3) + b'[1]')
time.sleep(60)"""


async def test_a_forged_reply_costs_the_child_without_waiting_for_it_to_exit() -> None:
    async with PythonPool(1) as pool:
        out = await asyncio.wait_for(pool.run(FORGED, {}), timeout=20)
        assert out.error is not None and out.error.code == "SANDBOX_EXITED"
        async with pool.lane() as lane:
            outs = await asyncio.wait_for(asyncio.gather(lane.run(FORGED, {}), lane.run("return 2", {})), 20)
        assert outs[0].error is not None and outs[0].error.code == "SANDBOX_EXITED"
        assert outs[1].data == 2  # behind it, in another child
