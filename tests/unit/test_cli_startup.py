"""noetl-rt's start-up, structurally (docs/ARCHITECTURE.md "CLI start-up"): a one-RPC
command loads only what it needs, its parser is the whole parser's, and the program
(``noetl_cli.entry``) ends with everything written and the command's exit code. Speed
itself is measured by ``make bench`` (the ``cli`` scenario), not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from noetl_cli.main import COMMANDS, build_parser, command_of

# Modules only other commands need: the local stack's launcher and certificates, the token
# store, the server side of tokens, the schedule/limit/dlq/rerun commands, the protos of
# services a `status` does not call, the installed-version lookup.
NOT_FOR_STATUS = (
    "noetl_cli.devcmd", "noetl_cli.devstack", "noetl_cli.stackcerts", "noetl_cli.localstack",
    "noetl_cli.tokencmd", "noetl_cli.schedulecmd", "noetl_cli.limitcmd", "noetl_cli.dlqcmd",
    "noetl_cli.reruncmd", "noetl_common.auth", "noetl_common.schedules", "noetl_common.db",
    "noetl_proto.v1.catalog_pb2", "noetl_proto.v1.shard_manager_pb2", "noetl_proto.v1.schedule_pb2",
    "noetl_proto.v1.deadletter_pb2", "noetl_proto.v1.concurrency_pb2", "noetl_proto.v1.auth_pb2",
    "noetl_proto.v1.worker_pb2", "importlib.metadata", "cryptography", "psycopg", "nats", "uuid", "getpass",
)

_STATUS_IMPORTS = """
import json, sys
from noetl_cli import main
args = main.build_parser(main.command_of(sys.argv[1:])).parse_args(sys.argv[1:])
api = main.client.Api("127.0.0.1:1")  # a channel connects on its first call: none is made
api.executions, api.health
api.close()
print(json.dumps(sorted(sys.modules)))
"""


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=60,
                          check=False)


def test_a_status_command_loads_no_module_only_other_commands_need(tmp_path: Path) -> None:
    done = _python("-c", _STATUS_IMPORTS, "status", "42", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert {"grpc", "noetl_cli.client", "noetl_proto.v1.execution_pb2"} <= loaded  # what it does need
    unwanted = sorted(m for m in loaded if m.startswith(NOT_FOR_STATUS))
    assert unwanted == []


@pytest.mark.parametrize("argv, command", [
    (["status", "7"], "status"),
    (["--home", "/h", "--api", "x:1", "status", "7"], "status"),
    (["--home=/h", "--token-file=t", "schedule", "list"], "schedule"),
    (["dev", "up", "--detach"], "dev"),
    (["nats-config"], "nats-config"),
    ([], None),
    (["-h"], None),
    (["--version"], None),
    (["--ho", "/h", "status", "7"], None),  # an abbreviation: argparse's own reading decides
    (["--", "status", "7"], None),
    (["bogus"], None),
    (["--home"], None),
])
def test_the_command_a_line_names(argv: list[str], command: str | None) -> None:
    assert command_of(argv) == command


@pytest.mark.parametrize("argv", [
    ["status", "7", "--json"],
    ["--home", "/elsewhere", "status", "7", "--home", "/h", "--api", "x:1"],
    ["run", "pb.yaml", "--payload", "{}", "--priority", "high", "--detach"],
    ["rerun", "42", "--from", "three"],
    ["events", "7", "-f", "--limit", "3"],
    ["schedule", "add", "n", "--path", "p", "--every", "1.5"],
    ["limit", "list"],
    ["dlq", "list"],
    ["token", "create", "--role", "admin", "--name", "n"],
    ["credential", "add", "pg", "--kind", "postgres"],
    ["dev", "up", "--scale", "api=2"],
    ["cluster", "--role", "api"],
])
def test_a_commands_own_parser_reads_its_line_as_the_whole_parser_does(argv: list[str]) -> None:
    command = command_of(argv)
    assert command is not None
    mine, whole = vars(build_parser(command).parse_args(argv)), vars(build_parser().parse_args(argv))
    # handlers are closures made per build: compare which function each one is
    assert mine.pop("handler").__qualname__ == whole.pop("handler").__qualname__
    assert mine == whole


def test_the_whole_parser_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = capsys.readouterr().out
    assert all(f"    {name}" in listed for name in COMMANDS)


@pytest.mark.parametrize("argv, code", [
    (["nats-config"], 0),
    (["status", "abc"], 2),
    (["--version"], 0),
])
def test_the_program_writes_everything_and_exits_with_the_commands_code(tmp_path: Path, argv: list[str],
                                                                        code: int) -> None:
    """``python -m noetl_cli`` (``entry.run``: os._exit at the end) against ``main`` in this process."""
    done = _python("-m", "noetl_cli", *argv, cwd=tmp_path)
    inline = _python("-c", "import sys; from noetl_cli.main import main; sys.exit(main(sys.argv[1:]))", *argv,
                     cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (code, inline.stdout, inline.stderr)
    assert inline.returncode == code
    assert done.stdout or done.stderr
