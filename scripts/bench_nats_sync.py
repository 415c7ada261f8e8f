"""What `sync_interval: always` costs a JetStream publish on this machine (docs/DEPLOY.md
"Faults and durability", docs/BENCHMARKS.md "Durability and settings").

Starts a throwaway nats-server twice, with the server's default sync (every 2 minutes)
and with `jetstream { sync_interval: always }` (an fsync before every acknowledgement),
creates the runtime's streams, and publishes the way the runtime does: one message
awaiting its PubAck (a worker's result, an engine's notice), then 64 concurrently (an
engine batch's notices). Rounds alternate between the two servers so the host's drift
hits both alike. Prints median and p99 latency of a lone publish and the throughput of
concurrent ones.

    .venv/bin/python scripts/bench_nats_sync.py [--rounds 5] [--messages 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from noetl_cli.localstack import free_port, nats_server_binary
from noetl_common import natsio


def start(root: Path, sync_always: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    conf = root / "nats.conf"
    lines = [f"listen: 127.0.0.1:{port}", "jetstream {", f"  store_dir: {root / 'js'}"]
    if sync_always:
        lines.append("  sync_interval: always")
    conf.write_text("\n".join([*lines, "}"]) + "\n")
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                if s.recv(4096).startswith(b"INFO"):
                    return proc, f"nats://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nats-server did not start")


async def measure(url: str, messages: int) -> tuple[list[float], float]:
    nc = await natsio.connect(url, name="bench-nats-sync")
    try:
        js = nc.jetstream()
        await natsio.ensure_streams(js)
        payload = b"x" * 200  # a result envelope's size
        lone = []
        for i in range(messages):
            t = time.perf_counter()
            await natsio.publish(js, natsio.events_subject(0, natsio.KIND_CALL), payload, msg_id=f"l{i}-{t}")
            lone.append(time.perf_counter() - t)
        t = time.perf_counter()
        for start in range(0, messages, 64):
            await asyncio.gather(*(natsio.publish(js, natsio.events_subject(0, natsio.KIND_CALL), payload,
                                                  msg_id=f"c{start + j}-{t}") for j in range(64)))
        rate = messages / (time.perf_counter() - t)
        return lone, rate
    finally:
        await nc.close()


def main() -> None:
    logging.getLogger(natsio.__name__).setLevel(logging.ERROR)  # the closes on purpose are not news
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args()
    results: dict[str, tuple[list[float], list[float]]] = {"default": ([], []), "always": ([], [])}
    for _ in range(args.rounds):
        for name in ("default", "always"):
            root = Path(tempfile.mkdtemp(prefix="noetl-nats-sync-"))
            proc, url = start(root, name == "always")
            try:
                lone, rate = asyncio.run(measure(url, args.messages))
            finally:
                proc.kill()
                proc.wait()
                shutil.rmtree(root, ignore_errors=True)
            results[name][0].extend(lone)
            results[name][1].append(rate)
    for name, (lone, rates) in results.items():
        lone.sort()
        p99 = lone[int(len(lone) * 0.99) - 1]
        print(f"sync {name:>7}: lone publish median {statistics.median(lone) * 1000:.3f} ms, "
              f"p99 {p99 * 1000:.3f} ms; 64 concurrent: {statistics.median(rates):,.0f} msg/s (median of rounds)")


if __name__ == "__main__":
    main()
