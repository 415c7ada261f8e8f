"""Compactor throughput (events/s per shard) on synthetic executions.

    .venv/bin/python scripts/bench_compactor.py                    # throwaway Postgres, 2000 x 20 events
    .venv/bin/python scripts/bench_compactor.py --executions 5000 --events 40
    .venv/bin/python scripts/bench_compactor.py --dsn "host=... dbname=..."   # a migrated database

Prints one JSON line (``noetl_compactor.bench.measure``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from noetl_compactor.bench import measure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", help="a migrated database (default: start a throwaway Postgres)")
    parser.add_argument("--executions", type=int, default=2000)
    parser.add_argument("--events", type=int, default=20, help="events per execution (>= 4)")
    parser.add_argument("--chain", type=int, default=3, help="references in the last step's chain")
    parser.add_argument("--batch-executions", type=int, default=500)
    parser.add_argument("--runs", type=int, default=1, help="repeat on fresh data, report each run")
    args = parser.parse_args()
    server = home = None
    dsn = args.dsn
    if not dsn:
        from noetl_cli.localstack import start_postgres
        from noetl_common.db import migrate

        home = Path(tempfile.mkdtemp(prefix="noetl-bench-"))
        server = start_postgres(home / "pg")
        dsn = server.dsn
        migrate(dsn)
    try:
        for run in range(args.runs):
            figures = asyncio.run(measure(dsn, executions=args.executions, events=args.events, chain=args.chain,
                                          shard=run, batch_executions=args.batch_executions))
            print(json.dumps(figures), flush=True)
    finally:
        if server is not None:
            server.stop("immediate")
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
