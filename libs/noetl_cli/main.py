"""``noetl-rt``: argument parsing and dispatch; expected errors become a message and an exit code.

Exit codes: 0 success, 1 failure (execution failed, server unreachable or unable to
serve, a part of the local stack not running, stack not healthy), 2 bad input
(arguments, payload, playbook rejected by the server), 3 no local stack recorded
(``dev status``), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from noetl_common.errors import InvalidInput, NoetlError, Overloaded, Unavailable
from noetl_common.roles import Role

from . import client, stackprobe
from .home import Resolved, resolve_api, resolve_dsn, resolve_home, resolve_shard_manager
from .output import CliError, eprint

Handler = Callable[[argparse.Namespace], int]


# The local stack's and the token store's modules load only for the commands that use
# them: a one-RPC command imports neither (docs/ARCHITECTURE.md "CLI start-up").
def _devcmd() -> ModuleType:
    from . import devcmd

    return devcmd


def _tokencmd() -> ModuleType:
    from . import tokencmd

    return tokencmd


def _nats_config(args: argparse.Namespace) -> int:
    """Passwords are variable references ($NOETL_NATS_PASSWORD_<ROLE>) nats-server resolves
    from its environment; nothing secret is printed."""
    from noetl_common import natsperms

    sys.stdout.write(natsperms.authorization_block(kv_bucket=args.kv_bucket, user_prefix=args.user_prefix))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("noetl-runtime")
    except PackageNotFoundError:
        return "unknown"


class _VersionAction(argparse._VersionAction):
    """``--version``: the installed version, looked up only when asked (importlib.metadata
    scans every installed distribution: tens of ms every command would pay)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        self.version = f"%(prog)s {_version()}"
        super().__call__(parser, namespace, values, option_string)


def _common(*, api: bool) -> argparse.ArgumentParser:
    """Options accepted both before and after the subcommand (SUPPRESS keeps the top-level value)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--home", default=argparse.SUPPRESS, metavar="DIR",
                        help="project-local state directory (default $NOETL_HOME or ./.noetl)")
    if api:
        parent.add_argument("--api", default=argparse.SUPPRESS, metavar="TARGET",
                            help="api gRPC target (default $NOETL_API, else the local stack's)")
        parent.add_argument("--token-file", default=argparse.SUPPRESS, metavar="PATH",
                            help="the API token to send (default $NOETL_TOKEN, else the local stack's admin token)")
    return parent


def _positive_of(kind: Callable[[str], float], what: str) -> Callable[[str], Any]:
    """An argparse type: a positive ``kind`` (int or float), else an error naming ``what``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


_positive = _positive_of(float, "a number")
_count = _positive_of(int, "a whole number")


# Each top-level command's parser is added by a function of its own, so a command line
# that names its command builds (and imports) only that one: the whole parser (~60
# subparsers, the schedule/limit/dlq/rerun modules and their protos) is built for
# `--help`, `--version` and anything not recognised (docs/ARCHITECTURE.md "CLI start-up").
Subparsers = Any  # argparse's _SubParsersAction


def _add_run(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[with_api], help="submit a playbook and follow it to the end",
                       description="Submit a playbook file, or a registered one with --path, and follow it to "
                                   "the end (or return its id at once with --detach).")
    p.add_argument("file", nargs="?", help="playbook YAML file (or give --path)")
    p.add_argument("--path", metavar="PATH[@N]", help="a registered playbook by catalog path (latest version, "
                                                      "or version N)")
    p.add_argument("--payload", metavar="JSON", help="JSON object merged over the playbook's workload")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--timeout", type=_positive, metavar="S",
                   help="execution timeout in seconds (the client waits at most S+5 s)")
    p.add_argument("--idempotency-key", default="", metavar="K", help="resubmitting with K returns the same id")
    p.add_argument("--priority", choices=("high", "normal", "low"), default=None,
                   help="the order workers take its commands in, over the playbook's spec.priority")
    p.add_argument("--detach", action="store_true",
                   help="print the execution id and return once submitted (follow later with `watch ID`)")
    p.set_defaults(handler=_run)


def _add_rerun(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    from . import reruncmd

    reruncmd.add_parser(sub, with_api, _with_api, _positive)


def _add_watch(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("watch", parents=[with_api], help="follow a submitted execution to the end")
    p.add_argument("execution_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--timeout", type=_positive, metavar="S", help="stop waiting after S seconds (exit 1)")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.watch(
        api, client.parse_execution_id(a.execution_id), as_json=a.json, timeout=a.timeout),
        needs=("postgres", "nats")))


def _add_list(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("list", parents=[with_api], help="list executions, newest first")
    p.add_argument("--status", help="only executions in this state (pending, running, completed, failed, "
                                    "cancelled)")
    p.add_argument("--path", default="", help="only executions of this catalog path")
    p.add_argument("--limit", type=_count, default=20, metavar="N", help="at most N executions (default 20)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.list_executions(
        api, status=client.parse_status(a.status), path=a.path, limit=a.limit, as_json=a.json)))


def _add_status(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[with_api], help="show an execution")
    p.add_argument("execution_id", metavar="ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.status(
        api, client.parse_execution_id(a.execution_id), as_json=a.json)))


def _add_events(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("events", parents=[with_api], help="list an execution's events")
    p.add_argument("execution_id", metavar="ID")
    p.add_argument("--json", action="store_true")
    p.add_argument("--limit", type=_count, default=0, metavar="N",
                   help="only the last N events")
    p.add_argument("--follow", "-f", action="store_true",
                   help="then print new events as they are recorded, until the execution ends")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.events(
        api, client.parse_execution_id(a.execution_id), as_json=a.json, limit=a.limit, follow=a.follow)))


def _add_trace(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("trace", parents=[with_api], help="the lineage of a step's result (newest first)")
    p.add_argument("execution_id", metavar="ID")
    p.add_argument("step", metavar="STEP")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.trace(
        api, client.parse_execution_id(a.execution_id), a.step, as_json=a.json)))


def _add_cancel(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("cancel", parents=[with_api], help="cancel an execution")
    p.add_argument("execution_id", metavar="ID")
    p.add_argument("--reason", default="cancelled from noetl-rt")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.cancel(
        api, client.parse_execution_id(a.execution_id), reason=a.reason)))


def _add_cluster(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("cluster", parents=[home_only],
                       help="the shard map: leader, members and the shards each holds")
    p.add_argument("--shard-manager", metavar="TARGET",
                   help="shard-manager gRPC target (default $NOETL_SHARD_MANAGER_TARGET, else the local stack's)")
    p.add_argument("--role", default="", help="only this role (api, projector, checkpointer, compactor, reaper, "
                                              "worker)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cluster)


def _add_playbook(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    pb = sub.add_parser("playbook", help="the playbook catalog").add_subparsers(dest="action", metavar="ACTION")
    pb.required = True
    p = pb.add_parser("register", parents=[with_api], help="register a playbook file (a new version)")
    p.add_argument("file")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.playbook_register(api, a.file)))
    p = pb.add_parser("list", parents=[with_api], help="list registered playbooks (latest versions)")
    p.add_argument("--prefix", default="", help="only paths starting with this")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.playbook_list(
        api, prefix=a.prefix, as_json=a.json)))


def _add_credential(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    cr = sub.add_parser("credential", help="named credentials").add_subparsers(dest="action", metavar="ACTION")
    cr.required = True
    p = cr.add_parser("add", parents=[with_api], help="add or replace a credential (the secret from stdin or a file)",
                      description="The secret is read from stdin (or --from-file), never from the command line:"
                                  " a JSON object of the credential's fields, or one value (postgres: the DSN;"
                                  " http_bearer: the token; http_basic: the password, with --username; generic:"
                                  " {\"value\": ...}). On a terminal it is prompted for without echo.")
    p.add_argument("name")
    p.add_argument("--kind", required=True, help="postgres, http_bearer, http_basic, generic")
    p.add_argument("--from-file", metavar="PATH", help="read the secret from this file instead of stdin")
    p.add_argument("--username", help="for --kind http_basic: the user name (not a secret)")
    # Refused with an explanation: a secret in argv is visible to every user (ps, /proc).
    p.add_argument("--dsn", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.set_defaults(handler=_credential_add)
    p = cr.add_parser("list", parents=[with_api], help="list credentials (names and kinds only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: client.credential_list(api, as_json=a.json)))


def _add_token(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    tk = sub.add_parser("token", help="API tokens (docs/DEPLOY.md \"Security\")").add_subparsers(
        dest="action", metavar="ACTION")
    tk.required = True
    roles = [r.value for r in Role]
    p = tk.add_parser("create", parents=[with_api], help="create a token (admin); it is printed once")
    p.add_argument("--role", required=True, choices=roles)
    p.add_argument("--name", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: _tokencmd().create(api, a.role, a.name, as_json=a.json)))
    p = tk.add_parser("list", parents=[with_api], help="list tokens (admin): names and roles, never tokens")
    p.add_argument("--all", action="store_true", help="revoked ones too")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: _tokencmd().list_tokens(
        api, include_revoked=a.all, as_json=a.json)))
    p = tk.add_parser("revoke", parents=[with_api], help="revoke a token (admin) by name or id")
    p.add_argument("name")
    p.set_defaults(handler=lambda a: _with_api(a, lambda api: _tokencmd().revoke(api, a.name)))
    p = tk.add_parser("register", parents=[home_only],
                      help="register a token read from stdin or $NOETL_AUTH_TOKEN, straight in the database")
    p.add_argument("--role", required=True, choices=roles)
    p.add_argument("--name", required=True)
    p.add_argument("--dsn", help="database (default $NOETL_POSTGRES_DSN, else the local stack's)")
    p.set_defaults(handler=lambda a: _tokencmd().register(resolve_dsn(a.dsn, _home(a)).value, a.role, a.name))


def _add_schedule(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    from . import schedulecmd

    schedulecmd.add_parsers(sub, with_api, _with_api)


def _add_limit(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    from . import limitcmd

    limitcmd.add_parsers(sub, with_api, _with_api, _count)


def _add_dlq(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    from . import dlqcmd

    dlqcmd.add_parsers(sub, with_api, _with_api)


def _add_migrate(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("migrate", parents=[home_only], help="apply database migrations")
    p.add_argument("--dsn", help="database (default $NOETL_POSTGRES_DSN, else the local stack's)")
    p.set_defaults(handler=lambda a: _devcmd().migrate(_home(a), dsn=a.dsn))


def _add_nats_config(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    p = sub.add_parser("nats-config", help="print the NATS server's authorization block: a user per role with "
                       "its subject permissions (docs/DEPLOY.md \"Security\")")
    p.add_argument("--kv-bucket", default="noetl_results", metavar="NAME",
                   help="the result cache's KV bucket (NOETL_RESULT_KV_BUCKET; default noetl_results)")
    p.add_argument("--user-prefix", default="noetl_", metavar="PREFIX",
                   help="prefix of the user names (default noetl_: users noetl_api, noetl_worker, ...)")
    p.set_defaults(handler=_nats_config)


def _add_dev(sub: Subparsers, with_api: argparse.ArgumentParser, home_only: argparse.ArgumentParser) -> None:
    dev = sub.add_parser("dev", help="the embedded local stack").add_subparsers(dest="action", metavar="ACTION")
    dev.required = True
    p = dev.add_parser(
        "up", parents=[home_only], help="start Postgres, NATS and every role locally",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a throwaway Postgres and NATS on free loopback ports, migrate, and run each\n"
                    "role as its own process (state, data and logs under <home>/dev).",
        epilog="environment:\n"
               "  NOETL_*                  passed through to every role (e.g. NOETL_SHARD_LEASE_SEC=3)\n"
               "  NOETL_DEV_ROLE_COMMAND   argv template for a role process, with {role}, {module}\n"
               "                           and {python} (default: {python} -m {module})")
    p.add_argument("--detach", action="store_true", help="return once up; the processes keep running")
    p.add_argument("--scale", metavar="ROLE=N,...", help="replicas per role, e.g. api=3,projector=2,worker=3")
    p.add_argument("--timeout", type=_positive, default=90.0, metavar="S",
                   help="give up (and tear down) if not all SERVING within S seconds (default 90)")
    p.set_defaults(handler=lambda a: _devcmd().up(_home(a), scale=a.scale, detach=a.detach, timeout=a.timeout,
                                               role_command=os.environ.get("NOETL_DEV_ROLE_COMMAND")))
    p = dev.add_parser("down", parents=[home_only], help="stop the local stack and delete its data")
    p.set_defaults(handler=lambda a: _devcmd().down(_home(a)))
    p = dev.add_parser("status", parents=[home_only], help="health of every process of the local stack")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=lambda a: _devcmd().status(_home(a), as_json=a.json))


# the top-level commands in the order `--help` lists them
COMMANDS: dict[str, Callable[[Subparsers, argparse.ArgumentParser, argparse.ArgumentParser], None]] = {
    "run": _add_run,
    "rerun": _add_rerun,
    "watch": _add_watch,
    "list": _add_list,
    "status": _add_status,
    "events": _add_events,
    "trace": _add_trace,
    "cancel": _add_cancel,
    "cluster": _add_cluster,
    "playbook": _add_playbook,
    "credential": _add_credential,
    "token": _add_token,
    "schedule": _add_schedule,
    "limit": _add_limit,
    "dlq": _add_dlq,
    "migrate": _add_migrate,
    "nats-config": _add_nats_config,
    "dev": _add_dev,
}
# the top-level options that take a value (the ones `command_of` steps over)
_VALUE_OPTIONS = ("--home", "--api", "--token-file")


def command_of(argv: Sequence[str]) -> str | None:
    """The command an argument list names, when it is plain to see: the first word, after
    only top-level options spelled in full (``--home DIR``, ``--api=X``). None otherwise
    (no command, ``-h``, ``--version``, an abbreviated or unknown option, an unknown
    word): the whole parser then reads it, so its help and errors are argparse's own."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in _VALUE_OPTIONS:
            i += 2
        elif word.startswith("-"):
            if not any(word.startswith(f"{option}=") for option in _VALUE_OPTIONS):
                return None
            i += 1
        else:
            return word if word in COMMANDS else None
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: every command's, or with ``command`` (a key of ``COMMANDS``)
    only that one's, which parses that command's arguments exactly as the whole one does."""
    parser = argparse.ArgumentParser(prog="noetl-rt", description="NoETL runtime: client, migrations, local stack.")
    parser.add_argument("--home", default=None, metavar="DIR",
                        help="project-local state directory (default $NOETL_HOME or ./.noetl)")
    parser.add_argument("--api", default=None, metavar="TARGET",
                        help="api gRPC target host:port (default $NOETL_API, else the local stack's)")
    parser.add_argument("--token-file", default=None, metavar="PATH",
                        help="the API token to send (default $NOETL_TOKEN, else the local stack's admin token)")
    parser.add_argument("--version", action=_VersionAction, version="%(prog)s")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    with_api, home_only = _common(api=True), _common(api=False)
    for name, add in COMMANDS.items():
        if command is None or name == command:
            add(sub, with_api, home_only)
    return parser


def _home(args: argparse.Namespace) -> Path:
    return resolve_home(getattr(args, "home", None))


def _credential_add(args: argparse.Namespace) -> int:
    """Read the secret first (a refused argv or an empty input fails before the api is asked)."""
    name = args.name
    if args.dsn is not None or args.data is not None or getattr(args, "extra", None):
        raise CliError("secrets are not accepted on the command line (every user of this machine can read a"
                       " process's arguments): pipe them on stdin or give --from-file PATH, e.g."
                       f" `noetl-rt credential add {name} --kind {args.kind} < secret.json`", code=2)
    fields = client.read_credential(args.kind, from_file=args.from_file, username=args.username)
    return _with_api(args, lambda api: client.credential_add(api, name, args.kind, fields))


def _with_api(args: argparse.Namespace, fn: Callable[[client.Api], int],
              needs: tuple[str, ...] = ("postgres",)) -> int:
    home = _home(args)
    resolved = resolve_api(getattr(args, "api", None), home)
    return _against(home, resolved, fn, needs, token_file=getattr(args, "token_file", None))


def _against(home: Path, resolved: Resolved, fn: Callable[[client.Api], int], needs: tuple[str, ...],
             what: str = "api", token_file: str | None = None) -> int:
    """Run ``fn`` with a channel to ``resolved``. When that is the local stack, a dead
    server it ``needs`` fails at once, and a failure to reach or be served says which
    part of the stack is down and how to restart it."""
    if resolved.local:
        trouble = stackprobe.stack_trouble(home, needs)
        if trouble:
            raise CliError(trouble, code=1)
    token = stackprobe.resolve_token(home, token_file, resolved.local)
    ca_file = stackprobe.resolve_ca(home, resolved.local)
    try:
        with client.Api(resolved.value, resolved.source, what=what, token=token, ca_file=ca_file) as api:
            return fn(api)
    except (Unavailable, Overloaded) as exc:
        trouble = stackprobe.stack_trouble(home) if resolved.local else ""
        if not trouble:
            raise
        raise CliError(str(exc), code=1, detail=trouble) from None


def _run(args: argparse.Namespace) -> int:
    # Validate everything local before resolving or contacting the api.
    payload = client.parse_payload(args.payload)
    if (args.file is None) == (args.path is None):
        raise CliError("give a playbook file or --path PATH[@VERSION] (one of them)", code=2)
    ref = client.parse_playbook_ref(args.path) if args.path is not None else None
    content = client.read_file(args.file) if args.file is not None else ""
    return _with_api(args, lambda api: client.run(
        api, content, ref=ref, payload=payload, as_json=args.json, timeout=args.timeout,
        idempotency_key=args.idempotency_key, detach=args.detach, priority=args.priority or ""),
        needs=("postgres", "nats"))


def _cluster(args: argparse.Namespace) -> int:
    home = _home(args)
    resolved = resolve_shard_manager(args.shard_manager, home)
    return _against(home, resolved, lambda api: client.cluster(api, role=args.role, as_json=args.json),
                    ("postgres",), what="shard-manager", token_file=getattr(args, "token_file", None))


def _report(exc: BaseException) -> int:
    if isinstance(exc, CliError):
        eprint(f"error: {exc.message}")
        if exc.detail:
            eprint(exc.detail)
        return exc.code
    if isinstance(exc, InvalidInput):
        eprint(f"error: {exc}")
        return 2
    eprint(f"error: {exc}")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_of(words))
    args, extra = parser.parse_known_args(words)
    if extra:  # an extra argument to `credential add` is a secret: refused with an explanation there
        if getattr(args, "handler", None) is not _credential_add:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = extra
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except (CliError, NoetlError) as exc:
        return _report(exc)
    except KeyboardInterrupt:
        eprint("interrupted")
        return 130
    except BrokenPipeError:
        # stdout went away (e.g. `| head`): stop quietly without a traceback at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
