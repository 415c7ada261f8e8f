"""localstack: a throwaway Postgres and NATS start on free ports and stop without leftovers."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import psycopg
import pytest

from noetl_cli import localstack
from noetl_cli.supervise import group_members

pytestmark = pytest.mark.integration


def test_postgres_and_nats_start_and_stop_cleanly(session_dir: Path) -> None:
    root = session_dir / "servers"
    pg = localstack.start_postgres(root / "pg")
    nats = localstack.start_nats(root / "nats")
    try:
        assert pg.pid > 0 and localstack.pid_alive(pg.pid)
        with psycopg.connect(pg.dsn) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("noetl",)
        assert localstack.pid_alive(nats.pid)
        with socket.create_connection(("127.0.0.1", nats.port), timeout=2) as s:
            assert s.recv(4096).startswith(b"INFO")
        postgres_children = [p for p in _children_of(pg.pid)]
        assert postgres_children, "postgres runs its background processes"
    finally:
        nats.stop()
        pg.stop("fast")
    assert not localstack.pid_alive(nats.pid)
    assert not group_members(nats.pid)
    assert not localstack.pid_alive(pg.pid)
    assert not [p for p in postgres_children if localstack.pid_alive(p)]
    assert not (Path(pg.datadir) / "postmaster.pid").exists()


def test_stop_pid_kills_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    started = time.monotonic()
    localstack.stop_pid(proc.pid, timeout=0.5)
    assert time.monotonic() - started < 5
    assert not localstack.pid_alive(proc.pid)
    proc.wait(5)  # stop_pid reaped it already; this only settles the Popen object
    proc.stdout.close()


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found
