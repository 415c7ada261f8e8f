"""What an S3 client costs the result store: the hand-written httpx + SigV4 client the
store used until issue 17, against the maintained libraries that could replace it
(docs/ARCHITECTURE.md "Result store" has the table and the choice).

    .venv/bin/python scripts/measure_s3_clients.py [--rounds 10] [--ops 20] [--import-runs 9]

Clients (each over the same real S3 server, SeaweedFS on loopback, path-style, static keys):

    httpx+sigv4   the removed client (``libs/noetl_store/_s3.py`` and ``_sigv4.py`` taken
                  from git at ``--legacy-ref`` into the bench dir, imported from there)
    obstore       obstore's ``S3Store`` (Rust object_store), ``put_async`` / ``get_async``
    aiobotocore   aiobotocore's S3 client (botocore + aiohttp), ``put_object`` /
                  ``get_object``
    S3Client      ``noetl_store.S3Client`` of this tree (the store's client as built)

The libraries that are not the project's dependencies are installed (pinned, ``pip
install --target``) into ``bench/.venv-s3clients/<name>`` (gitignored) and put on the path
of this process and of the import-time children only.

Measured:

* import time: a fresh interpreter per run imports the client's library (httpx for the
  removed client: its only third-party import) and then builds one client ready to
  send; ``--import-runs`` runs per client, interleaved; median and quartiles in ms.
* installed size: the bench dir of each library, and the part of it that the project does
  not already install (distributions absent from this venv).
* exits: ``--exit-runs`` fresh processes per client do one PUT and one GET and exit at
  once, with and without the client's ``close()``; a non-zero exit status (SIGABRT: a
  Rust runtime thread still inside its ``call_soon_threadsafe`` while CPython finalizes)
  is counted.
* per operation: each round, in a shuffled client order, ``--ops`` PUTs of distinct keys
  then ``--ops`` GETs of them of 1 KiB, and ``--big-ops`` of 1 MiB (the test server's
  volumes hold 512 MB); the wall time of each
  operation and this process's CPU time (every thread: the Rust runtime's and aiohttp's
  included) over each block, per operation. The table gives the median over every
  operation (wall) or every round (CPU), with quartiles, in ms.

The numbers of a 2-core machine shared with the S3 server: compare the clients with each
other, not with another machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LIBS = REPO / "bench" / ".venv-s3clients"
PINS = {"obstore": ["obstore==0.12.1"], "aiobotocore": ["aiobotocore==3.10.0"]}
# The last commit of main with the hand-written client (issue 17 replaced it).
LEGACY_REF = "c62e6f3"
CLIENTS = ("httpx+sigv4", "obstore", "aiobotocore", "S3Client")
SIZES = (1024, 1024 * 1024)
BUCKET = "bench-s3"
REGION = "us-east-1"


# ---------------------------------------------------------------- the libraries


def _have(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def ensure_libs(legacy_ref: str) -> dict[str, Path | None]:
    """{client: the dir to put on sys.path (None: the project's own venv has it)}."""
    paths: dict[str, Path | None] = {"S3Client": None}
    for name, pins in PINS.items():
        if _have(name):
            paths[name] = None
            continue
        target = LIBS / name
        stamp = target / ".installed"
        if not (stamp.exists() and stamp.read_text() == json.dumps(pins)):
            print(f"installing {', '.join(pins)} into {target.relative_to(REPO)}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "--only-binary=:all:", "--upgrade", "--target", str(target), *pins],
                           check=True, timeout=600)
            stamp.write_text(json.dumps(pins))
        paths[name] = target
    legacy = LIBS / "legacy"
    package = legacy / "noetl_s3_legacy"
    stamp = legacy / ".ref"
    if not (stamp.exists() and stamp.read_text() == legacy_ref):
        package.mkdir(parents=True, exist_ok=True)
        for name in ("_s3.py", "_sigv4.py"):
            text = subprocess.run(["git", "-C", str(REPO), "show", f"{legacy_ref}:libs/noetl_store/{name}"],
                                  check=True, capture_output=True, text=True).stdout
            (package / name).write_text(text)
        (package / "__init__.py").write_text("")
        stamp.write_text(legacy_ref)
    paths["httpx+sigv4"] = legacy
    return paths


def _dist_size(dist: importlib.metadata.Distribution) -> int:
    located = (Path(str(f.locate())) for f in dist.files or [])
    return sum(p.stat().st_size for p in located if p.exists())


def installed_size(paths: dict[str, Path | None]) -> dict[str, dict[str, float]]:
    """MB on disk of each library with the dependencies it brought: all of them, and those
    the project does not install itself (call before the bench dirs are on sys.path)."""
    project = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    out: dict[str, dict[str, float]] = {}
    for name in ("obstore", "aiobotocore"):
        target = paths.get(name)
        if target is None:  # a project dependency: the library itself (its dependencies are the project's)
            size = _dist_size(importlib.metadata.distribution(name))
            out[name] = {"total_mb": size / 1e6, "new_mb": size / 1e6}
            continue
        total = new = 0
        for dist in importlib.metadata.distributions(path=[str(target)]):
            size = _dist_size(dist)
            total += size
            if dist.metadata["Name"].lower() not in project:
                new += size
        out[name] = {"total_mb": total / 1e6, "new_mb": new / 1e6}
    return out


# ---------------------------------------------------------------- import time

IMPORT_CODE = {
    "httpx+sigv4": ("import httpx", "httpx.AsyncClient(timeout=30.0)"),
    "obstore": ("import obstore, obstore.store",
                "obstore.store.S3Store('b', endpoint='http://127.0.0.1:9', region='us-east-1', "
                "access_key_id='a', secret_access_key='s', client_options={'allow_http': True})"),
    "aiobotocore": ("import aiobotocore.session, aiobotocore.config",
                    "__import__('asyncio').run(_aio())"),
}
AIO_CLIENT = """
async def _aio():
    s = aiobotocore.session.get_session()
    async with s.create_client('s3', endpoint_url='http://127.0.0.1:9', region_name='us-east-1',
                               aws_access_key_id='a', aws_secret_access_key='s',
                               config=aiobotocore.config.AioConfig(s3={'addressing_style': 'path'})):
        pass
"""


def import_child(name: str, path: str) -> None:
    if path:
        sys.path.insert(0, path)
    imp, build = IMPORT_CODE[name]
    scope: dict[str, Any] = {}
    t0 = time.perf_counter()
    exec(imp, scope)
    t1 = time.perf_counter()
    if name == "aiobotocore":
        exec(AIO_CLIENT, scope)
    exec(build, scope)
    t2 = time.perf_counter()
    print(json.dumps({"import": (t1 - t0) * 1e3, "client": (t2 - t0) * 1e3}))


def import_times(paths: dict[str, Path | None], runs: int, seed: int) -> dict[str, dict[str, list[float]]]:
    rng = random.Random(seed)
    out: dict[str, dict[str, list[float]]] = {n: {"import": [], "client": []} for n in IMPORT_CODE}
    for _ in range(runs):
        order = list(IMPORT_CODE)
        rng.shuffle(order)
        for name in order:
            path = paths.get(name)
            res = subprocess.run([sys.executable, __file__, "--import-child", name, "--path", str(path or "")],
                                 check=True, capture_output=True, text=True, timeout=120)
            got = json.loads(res.stdout.strip().splitlines()[-1])
            out[name]["import"].append(got["import"])
            out[name]["client"].append(got["client"])
    return out


# ---------------------------------------------------------------- the clients


class Obstore:
    def __init__(self, endpoint: str, ak: str, sk: str) -> None:
        import obstore
        from obstore.store import S3Store
        self.obs = obstore
        self.s = S3Store(BUCKET, endpoint=endpoint, region=REGION, access_key_id=ak, secret_access_key=sk,
                         virtual_hosted_style_request=False,
                         client_options={"allow_http": True, "timeout": "30s", "connect_timeout": "5s"})

    async def put(self, key: str, data: bytes) -> None:
        await self.obs.put_async(self.s, key, data)

    async def get(self, key: str) -> bytes:
        return bytes(await (await self.obs.get_async(self.s, key)).bytes_async())

    async def close(self) -> None:
        pass


class Aiobotocore:
    def __init__(self, endpoint: str, ak: str, sk: str) -> None:
        self.args = (endpoint, ak, sk)
        self.cm: Any = None
        self.c: Any = None

    async def open(self) -> None:
        import aiobotocore.session
        from aiobotocore.config import AioConfig
        endpoint, ak, sk = self.args
        config = AioConfig(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=30,
                           retries={"max_attempts": 3, "mode": "standard"},
                           request_checksum_calculation="when_required",
                           response_checksum_validation="when_required")
        self.cm = aiobotocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ak, aws_secret_access_key=sk,
            config=config)
        self.c = await self.cm.__aenter__()

    async def put(self, key: str, data: bytes) -> None:
        await self.c.put_object(Bucket=BUCKET, Key=key, Body=data)

    async def get(self, key: str) -> bytes:
        resp = await self.c.get_object(Bucket=BUCKET, Key=key)
        async with resp["Body"] as body:
            return bytes(await body.read())

    async def close(self) -> None:
        await self.cm.__aexit__(None, None, None)


class Ours:
    """The store's S3 client (``MODULE``: noetl_store now, the hand-written one for Legacy)."""

    MODULE = "noetl_store"

    def __init__(self, endpoint: str, ak: str, sk: str) -> None:
        mod = importlib.import_module(self.MODULE)
        self.c = mod.S3Client(mod.S3Config(endpoint, BUCKET, ak, sk, region=REGION))

    async def put(self, key: str, data: bytes) -> None:
        await self.c.put_object(key, data)

    async def get(self, key: str) -> bytes:
        return bytes(await self.c.get_object(key))

    async def close(self) -> None:
        await self.c.close()


class Legacy(Ours):
    """The hand-written httpx + SigV4 client this project had before obstore (installed
    by the script as ``noetl_s3_legacy``)."""

    MODULE = "noetl_s3_legacy._s3"


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0], xs[0]) if xs else (0.0, 0.0, 0.0)
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


async def operations(endpoint: str, ak: str, sk: str, rounds: int, ops: int, big_ops: int, seed: int,
                     names: tuple[str, ...]) -> dict[str, Any]:
    makers: dict[str, Any] = {"httpx+sigv4": Legacy, "obstore": Obstore, "aiobotocore": Aiobotocore, "S3Client": Ours}
    clients = {n: makers[n](endpoint, ak, sk) for n in names}
    for c in clients.values():
        if isinstance(c, Aiobotocore):
            await c.open()
    rng = random.Random(seed)
    payloads = {size: rng.randbytes(size) for size in SIZES}
    wall: dict[tuple[str, int, str], list[float]] = {}
    cpu: dict[tuple[str, int, str], list[float]] = {}
    # warm-up and correctness: each client reads back what each other client wrote
    for writer_name, writer in clients.items():
        await writer.put(f"check/{writer_name}", payloads[1024])
    for reader_name, reader in clients.items():
        for writer_name in clients:
            assert await reader.get(f"check/{writer_name}") == payloads[1024], (reader_name, writer_name)
    for r in range(rounds):
        order = list(clients)
        rng.shuffle(order)
        for name in order:
            c = clients[name]
            for size in SIZES:
                data = payloads[size]
                n = ops if size < 1024 * 1024 else big_ops
                keys = [f"bench/{name}/{size}/{r}/{i}.json" for i in range(n)]
                for op in ("put", "get"):
                    samples = wall.setdefault((name, size, op), [])
                    c0 = time.process_time()
                    for key in keys:
                        t0 = time.perf_counter()
                        if op == "put":
                            await c.put(key, data)
                        else:
                            got = await c.get(key)
                            assert len(got) == size
                        samples.append((time.perf_counter() - t0) * 1e3)
                    cpu.setdefault((name, size, op), []).append((time.process_time() - c0) * 1e3 / n)
    for c in clients.values():
        await c.close()
    return {"rounds": rounds, "ops": ops, "big_ops": big_ops,
            "rows": [{"client": n, "size": s, "op": o, "wall": quartiles(wall[(n, s, o)]),
                      "cpu": quartiles(cpu[(n, s, o)])} for (n, s, o) in wall]}


# ---------------------------------------------------------------- exit


def exit_child(name: str, path: str, endpoint: str, ak: str, sk: str, close: bool) -> None:
    """One PUT and one GET, then (``close``: the client's close()) the interpreter exits."""
    if path:
        sys.path.insert(0, path)
    makers: dict[str, Any] = {"httpx+sigv4": Legacy, "obstore": Obstore, "aiobotocore": Aiobotocore, "S3Client": Ours}

    async def run() -> None:
        c = makers[name](endpoint, ak, sk)
        if isinstance(c, Aiobotocore):
            await c.open()
        k = f"exit/{os.getpid()}"
        await c.put(k, b"{}")
        assert await c.get(k) == b"{}"
        if close or isinstance(c, Aiobotocore):  # aiobotocore's session must be left
            await c.close()

    asyncio.run(run())


def exit_codes(paths: dict[str, Path | None], names: tuple[str, ...], runs: int, endpoint: str, ak: str,
               sk: str) -> dict[str, dict[str, int]]:
    """{client (+close): {"runs": n, "abnormal": exits with a non-zero status}}."""
    out: dict[str, dict[str, int]] = {}
    # aiobotocore's client is always left (its context manager); obstore's store has no close
    variants = [(n, n == "aiobotocore") for n in names] + [("S3Client", True)] * ("S3Client" in names)
    for _ in range(runs):
        for name, close in variants:
            label = f"{name}{' + close()' if close else ''}"
            res = subprocess.run([sys.executable, __file__, "--exit-child", name, "--path",
                                  str(paths.get(name) or ""), "--endpoint", endpoint, "--keys", f"{ak}:{sk}",
                                  *(["--close"] if close else [])], capture_output=True, timeout=120)
            row = out.setdefault(label, {"runs": 0, "abnormal": 0})
            row["runs"] += 1
            row["abnormal"] += res.returncode != 0
    return out


# ---------------------------------------------------------------- main


def fmt(q: tuple[float, float, float] | list[float]) -> str:
    return f"{q[1]:7.2f} [{q[0]:.2f}, {q[2]:.2f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--ops", type=int, default=20, help="1 KiB operations per client and op, per round")
    # the test server's volumes hold 512 MB: 4 clients x 10 rounds x 5 MiB fit
    ap.add_argument("--big-ops", type=int, default=5, help="1 MiB operations per client and op, per round")
    ap.add_argument("--import-runs", type=int, default=9)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--legacy-ref", default=LEGACY_REF)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json", action="store_true", help="print the raw result as JSON as well")
    ap.add_argument("--parts", default="imports,ops,exits", help="what to measure (comma-separated)")
    ap.add_argument("--exit-runs", type=int, default=40,
                    help="fresh processes per client that exit right after their last request")
    ap.add_argument("--import-child", help=argparse.SUPPRESS)
    ap.add_argument("--exit-child", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--keys", default="", help=argparse.SUPPRESS)
    ap.add_argument("--close", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.import_child:
        import_child(args.import_child, args.path)
        return 0
    if args.exit_child:
        ak, _, sk = args.keys.partition(":")
        exit_child(args.exit_child, args.path, args.endpoint, ak, sk, args.close)
        return 0

    paths = ensure_libs(args.legacy_ref)
    result: dict[str, Any] = {"sizes": installed_size(paths)}
    for path in paths.values():
        if path is not None:
            sys.path.insert(0, str(path))
    names = tuple(n for n in args.clients.split(",") if n)
    parts = set(args.parts.split(","))
    result["imports"] = {n: {k: quartiles(v) for k, v in t.items()}
                         for n, t in import_times(paths, args.import_runs if "imports" in parts else 0,
                                                  args.seed).items()
                         if "imports" in parts}

    from noetl_cli.localstack import start_s3

    with tempfile.TemporaryDirectory(prefix="noetl-s3-bench-") as root:
        server = start_s3(root, buckets=(BUCKET,))
        try:
            if "ops" in parts:
                result["ops"] = asyncio.run(operations(server.endpoint, server.access_key, server.secret_key,
                                                       args.rounds, args.ops, args.big_ops, args.seed, names))
            if "exits" in parts:
                result["exits"] = exit_codes(paths, names, args.exit_runs, server.endpoint, server.access_key,
                                             server.secret_key)
        finally:
            server.stop()

    if args.json:
        print(json.dumps(result, indent=2))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n")
    print("installed (MB): the library and the dependencies it brings / those the project lacks")
    for name, s in result["sizes"].items():
        print(f"  {name:<12} {s['total_mb']:6.1f} / {s['new_mb']:6.1f}")
    print(f"\nimport, and import + one client ready (ms, median [quartiles], {args.import_runs} fresh "
          "interpreters each, interleaved)")
    for name, t in result["imports"].items():
        print(f"  {name:<12} import {fmt(t['import']):>24}   + client {fmt(t['client']):>24}")
    ops = result.get("ops", {"rounds": 0, "ops": 0, "big_ops": 0, "rows": []})
    print(f"\nper operation against SeaweedFS ({ops['rounds']} rounds x {ops['ops']} (1 KiB) or {ops['big_ops']} "
          "(1 MiB) operations per client and op, interleaved; ms, median [quartiles])")
    print(f"  {'client':<12} {'size':>8} {'op':<4} {'wall':>24} {'process CPU':>24}")
    for row in sorted(ops["rows"], key=lambda r: (r["size"], r["op"] == "get", CLIENTS.index(r["client"]))):
        size = "1 KiB" if row["size"] == 1024 else "1 MiB"
        print(f"  {row['client']:<12} {size:>8} {row['op']:<4} {fmt(row['wall']):>24} {fmt(row['cpu']):>24}")
    print("\nprocesses that exit right after their last request (one PUT, one GET): abnormal exits")
    for label, row in result.get("exits", {}).items():
        print(f"  {label:<22} {row['abnormal']:>3} / {row['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
