"""``noetl-rt dev up|down|status`` and ``noetl-rt migrate``: the CLI side of the local stack."""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from noetl_common import db
from noetl_common.errors import InvalidInput, NoetlError

from . import devstack
from .home import resolve_dsn, state_path
from .output import CliError, eprint, print_json, table
from .ports import PortTaken
from .stackprobe import stack_trouble  # noqa: F401  (re-exported)
from .supervise import RoleCommand, StackError, describe_exit


def _progress(line: str) -> None:
    eprint(f"  {line}")


def _stack_error(exc: StackError) -> CliError:
    if exc.log_tail:
        detail = f"--- last lines of {exc.log} ---\n{exc.log_tail}\n--- end of {exc.instance} log ---"
    else:
        detail = f"({exc.instance} wrote nothing to {exc.log})" if exc.log else ""
    outcome = ("the stack was torn down" if exc.torn_down else
               "the rest of the stack is left as it is (`noetl-rt dev status`)")
    return CliError(f"{exc}; {outcome}", code=1, detail=detail)


def _summary(state: devstack.StackState, title: str = "local stack up") -> str:
    rows: list[tuple[str, str]] = [("api", state.api), ("shard-manager", state.shard_manager),
                                   ("postgres", state.postgres_dsn), ("nats", state.nats_url),
                                   ("logs", str(state.log_dir)), ("state", str(state_path(state.home)))]
    procs = ", ".join(f"{role}={len(ps)}" for role, ps in state.services.items())
    rows.insert(2, ("processes", procs))
    return title + "\n" + table([(f"  {k}", v) for k, v in rows])


def role_command_from(template: str | None) -> RoleCommand | None:
    """``$NOETL_DEV_ROLE_COMMAND``: argv template for role processes, with ``{role}`` and
    ``{module}`` placeholders (e.g. ``coverage run -m {module}``); None = the default."""
    if not template:
        return None
    argv = shlex.split(template)
    if not argv:
        return None

    def command(role: str) -> list[str]:
        module = f"noetl_{role.replace('-', '_')}"
        return [a.replace("{role}", role).replace("{module}", module).replace("{python}", sys.executable)
                for a in argv]

    return command


def up(home: Path, *, scale: str | None, detach: bool, timeout: float,
       role_command: str | None = None) -> int:
    try:
        replicas = devstack.parse_scale(scale)
    except InvalidInput as exc:
        raise CliError(str(exc), code=2) from None
    if timeout <= 0:
        raise CliError(f"--timeout must be positive, got {timeout}", code=2)
    existing = devstack.StackState.load(home)
    healing = bool(existing and existing.phase == "up" and existing.alive() and existing.dead_parts())
    eprint(f"{'healing' if healing else 'starting'} the local stack under {home}")
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM tears down like Ctrl-C
    try:
        state = devstack.up(home, replicas, timeout=timeout, progress=_progress,
                            role_command=role_command_from(role_command))
    except devstack.StackRunning as exc:
        raise CliError(str(exc), code=1) from None
    except StackError as exc:
        raise _stack_error(exc) from None
    except PortTaken as exc:
        raise CliError(f"cannot restart the local stack in place: {exc}; stop that process and run "
                       "`noetl-rt dev up` again, or `noetl-rt dev down` to start afresh (deletes the stack's data)",
                       code=1) from None
    except KeyboardInterrupt:
        outcome = "what was restarted keeps running" if healing else "the stack was torn down"
        raise CliError(f"interrupted; {outcome}", code=130) from None
    except NoetlError as exc:
        raise CliError(f"cannot start the local stack: {exc}", code=1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if state.healed:
        if scale:
            eprint("--scale does not apply to a running stack: it keeps its replicas")
        print(_summary(state, f"local stack up (restarted in place: {', '.join(state.healed)})"), flush=True)
        state.forget_children()
        return 0
    print(_summary(state), flush=True)
    if detach:
        state.forget_children()
        eprint("running in the background; stop it with `noetl-rt dev down`")
        return 0
    return _foreground(state)


def _foreground(state: devstack.StackState) -> int:
    """Stay up until Ctrl-C / SIGTERM, reporting processes that exit; then an orderly down."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    eprint("press Ctrl-C to stop")
    reported: set[str] = set()
    try:
        state_file = state_path(state.home)
        while not stop.wait(0.5):
            if not state_file.exists():
                eprint("the local stack was stopped (`noetl-rt dev down`)")
                for p in state.processes():
                    p.reap()
                return 0
            for p in state.processes():
                if p.instance not in reported and not p.alive():
                    reported.add(p.instance)
                    eprint(f"{p.instance} (pid {p.pid}) {describe_exit(p.exit_code())}; log: {p.log}")
                    tail = p.log_tail(10)
                    if tail:
                        eprint("\n".join("    " + ln for ln in tail.splitlines()))
        eprint("stopping the local stack")
        # Ignore further signals while tearing down: the teardown must finish.
        for sig in old:
            signal.signal(sig, signal.SIG_IGN)
        state.shutdown(progress=_progress)
        eprint("local stack stopped")
        return 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def down(home: Path) -> int:
    if devstack.down(home, progress=_progress):
        eprint("local stack stopped")
    else:
        eprint(f"no local stack recorded under {home}; nothing to stop")
    return 0


def status(home: Path, *, as_json: bool) -> int:
    report = devstack.status(home)
    if report is None:
        raise CliError(f"no local stack recorded under {home} (start one with `noetl-rt dev up`)", code=3)
    if as_json:
        print_json(report.to_json())
    else:
        print(f"local stack under {report.home}")
        print(table([
            ("  api", report.api),
            ("  postgres", f"{report.postgres_dsn}  ({_server_state(report.postgres_alive, report.postgres_pid)})"),
            ("  nats", f"{report.nats_url}  ({_server_state(report.nats_alive, report.nats_pid)})"),
        ]))
        rows = [(s["instance"], role, s["pid"], s["health"], s["grpc"], s["metrics"])
                for role, procs in report.services.items() for s in procs]
        print(table(rows, header=("INSTANCE", "ROLE", "PID", "HEALTH", "GRPC", "METRICS")))
    dead = report.dead()
    if dead:
        eprint(f"not running: {', '.join(dead)}; `noetl-rt dev up` restarts {'it' if len(dead) == 1 else 'them'} "
               "in place (data kept)")
    return 0 if report.healthy else 1


def _server_state(alive: bool, pid: int) -> str:
    return f"running, pid {pid}" if alive else f"DEAD, pid {pid or '?'} gone"


def migrate(home: Path, *, dsn: str | None) -> int:
    resolved = resolve_dsn(dsn, home)
    try:
        applied = db.migrate(resolved.value)
    except NoetlError as exc:
        raise CliError(f"migration failed ({resolved.source}): {exc}", code=1) from None
    if applied:
        print(f"applied migrations: {', '.join(f'{v:04d}' for v in applied)}")
    else:
        print("schema is up to date (no migrations to apply)")
    return 0
