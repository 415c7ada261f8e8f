"""noetl-rt argument parsing, local input validation, scale specs, address resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

import noetl_cli
from noetl_cli import devstack
from noetl_cli.client import parse_execution_id, parse_payload, parse_playbook_ref, parse_status
from noetl_cli.devcmd import role_command_from
from noetl_cli.home import resolve_api, resolve_dsn, resolve_home, write_state
from noetl_cli.main import build_parser, main
from noetl_cli.output import CliError
from noetl_common.errors import InvalidInput
from noetl_proto.v1 import common_pb2


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("NOETL_API", "NOETL_HOME", "NOETL_POSTGRES_DSN", "NOETL_DEV_ROLE_COMMAND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def playbook(tmp_path: Path) -> Path:
    path = tmp_path / "pb.yaml"
    path.write_text("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t, path: t}\nworkflow: []\n")
    return path


# ---------------------------------------------------------------- parsing


def test_run_arguments() -> None:
    args = build_parser().parse_args(
        ["run", "pb.yaml", "--payload", '{"a": 1}', "--json", "--timeout", "12.5", "--idempotency-key", "k1"])
    assert (args.file, args.payload, args.json, args.timeout, args.idempotency_key) == (
        "pb.yaml", '{"a": 1}', True, 12.5, "k1")
    assert args.api is None and args.home is None


@pytest.mark.parametrize("argv", [
    ["--home", "/h", "--api", "x:1", "status", "7"],
    ["status", "7", "--home", "/h", "--api", "x:1"],
    ["--home", "/elsewhere", "status", "7", "--home", "/h", "--api", "x:1"],
])
def test_global_options_before_or_after_the_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.home, args.api, args.execution_id) == ("/h", "x:1", "7")


def test_dev_up_arguments() -> None:
    args = build_parser().parse_args(["dev", "up", "--detach", "--scale", "api=3,worker=2", "--timeout", "30"])
    assert (args.detach, args.scale, args.timeout) == (True, "api=3,worker=2", 30.0)
    assert build_parser().parse_args(["dev", "up"]).timeout == 90.0


def test_credential_and_playbook_arguments() -> None:
    args = build_parser().parse_args(["credential", "add", "pg", "--kind", "postgres", "--from-file", "s.json"])
    assert (args.name, args.kind, args.from_file, args.username) == ("pg", "postgres", "s.json", None)
    args = build_parser().parse_args(["playbook", "register", "a.yaml"])
    assert args.file == "a.yaml"


@pytest.mark.parametrize("argv", [
    ["run", "f.yaml", "--timeout", "-1"], ["list", "--limit", "0"], ["list", "--limit", "x"], ["watch"], ["run", "f.yaml", "--timeout", "x"], ["dev"], ["playbook"],
    ["credential", "add", "n"], ["dev", "up", "--timeout", "0"], ["nonsense"],
])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "fragment"), [
    (["run"], "give a playbook file or --path"),
    (["run", "f.yaml", "--path", "tests/x"], "give a playbook file or --path"),
    (["run", "--path", "@3"], "--path needs a catalog path"),
    (["run", "--path", "tests/x@v2"], "the version after @ must be a number"),
    (["run", "--path", "tests/x@0"], "the version must be positive"),
    (["list", "--status", "done"], "--status must be one of pending, running, completed, failed, cancelled"),
    (["watch", "x1"], "execution id must be a number"),
])
def test_bad_local_input_exits_2_before_contacting_the_api(
        argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    # An address nothing listens on: exit 2 proves the input was checked first.
    assert main(["--api", "127.0.0.1:1", *argv]) == 2
    captured = capsys.readouterr()
    assert fragment in captured.err and captured.out == "" and "Traceback" not in captured.err


def test_playbook_ref_and_status_parsing() -> None:
    assert (parse_playbook_ref("tests/x").path, parse_playbook_ref("tests/x").version) == ("tests/x", 0)
    assert (parse_playbook_ref("tests/x@12").path, parse_playbook_ref("tests/x@12").version) == ("tests/x", 12)
    assert parse_status(None) == 0
    assert parse_status("Running") == common_pb2.EXECUTION_STATUS_RUNNING
    assert parse_status("FAILED") == common_pb2.EXECUTION_STATUS_FAILED


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err


# ---------------------------------------------------------------- payload and ids


def test_parse_payload() -> None:
    assert parse_payload(None) is None
    assert parse_payload('{"a": [1, 2]}') == {"a": [1, 2]}


@pytest.mark.parametrize(("text", "fragment"), [
    ("[1, 2]", "must be a JSON object"), ('"s"', "got str"), ("3", "got int"), ("null", "got NoneType"),
    ("{nope", "not valid JSON"), ("[" * 40 + "]" * 40, "must be a JSON object"),
    ('{"a":' * 33 + "1" + "}" * 33, "nests deeper than 32 levels"),
])
def test_bad_payload(text: str, fragment: str) -> None:
    with pytest.raises(CliError) as exc:
        parse_payload(text)
    assert exc.value.code == 2 and fragment in exc.value.message


@pytest.mark.parametrize("payload", ["[1]", "42", "{bad json"])
def test_run_rejects_bad_payload_before_contacting_the_api(
        payload: str, playbook: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An address nothing listens on: exit 2 proves the payload was checked first.
    assert main(["--api", "127.0.0.1:1", "run", str(playbook), "--payload", payload]) == 2
    captured = capsys.readouterr()
    assert "--payload" in captured.err and captured.out == ""
    assert "Traceback" not in captured.err


def test_run_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--api", "127.0.0.1:1", "run", "missing.yaml"]) == 2
    assert "file not found: missing.yaml" in capsys.readouterr().err


def test_run_without_any_api_address(playbook: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(playbook)]) == 2
    err = capsys.readouterr().err
    assert "no api address" in err and "NOETL_API" in err


def test_unreachable_api(playbook: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--api", "127.0.0.1:1", "run", str(playbook)]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the api at 127.0.0.1:1" in err and "Traceback" not in err


def test_execution_id() -> None:
    assert parse_execution_id("123") == 123
    for bad in ("abc", "-4", "0"):
        with pytest.raises(CliError):
            parse_execution_id(bad)


def test_status_with_a_bad_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--api", "127.0.0.1:1", "status", "abc"]) == 2
    assert "execution id must be a number" in capsys.readouterr().err


# ---------------------------------------------------------------- scale


def test_parse_scale() -> None:
    scale = devstack.parse_scale("api=3,projector=2")
    assert scale == {"shard-manager": 1, "api": 3, "projector": 2, "checkpointer": 1, "compactor": 1,
                     "reaper": 1, "worker": 1}
    assert devstack.parse_scale(None) == dict.fromkeys(devstack.ROLES, 1)
    assert devstack.parse_scale(" worker = 4 , ")["worker"] == 4
    assert devstack.parse_scale("shard-manager=2")["shard-manager"] == 2


@pytest.mark.parametrize(("spec", "fragment"), [
    ("foo=1", "unknown role 'foo'"),
    ("api=0", "at least 1"),
    ("api=-2", "at least 1"),
    ("api=x", "whole number"),
    ("api", "not ROLE=N"),
])
def test_parse_scale_rejects(spec: str, fragment: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        devstack.parse_scale(spec)
    assert fragment in str(exc.value)


def test_dev_up_bad_scale_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev", "up", "--scale", "api=x"]) == 2
    assert "whole number" in capsys.readouterr().err


# ---------------------------------------------------------------- resolution


def test_home_resolution(tmp_path: Path) -> None:
    assert resolve_home(None, {}, cwd=tmp_path) == tmp_path / ".noetl"
    assert resolve_home(None, {"NOETL_HOME": "h"}, cwd=tmp_path) == tmp_path / "h"
    assert resolve_home("/abs", {"NOETL_HOME": "h"}, cwd=tmp_path) == Path("/abs")


def test_api_resolution_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with pytest.raises(CliError) as exc:
        resolve_api(None, home, {})
    assert exc.value.code == 2
    write_state(home, {"api": "state:1", "postgres_dsn": "host=state"})
    assert resolve_api(None, home, {}).value == "state:1"
    assert resolve_api(None, home, {"NOETL_API": "env:1"}).value == "env:1"
    assert resolve_api("flag:1", home, {"NOETL_API": "env:1"}).value == "flag:1"
    assert resolve_dsn(None, home, {}).value == "host=state"
    assert resolve_dsn(None, home, {"NOETL_POSTGRES_DSN": "host=env"}).value == "host=env"
    assert resolve_dsn("host=flag", home, {"NOETL_POSTGRES_DSN": "host=env"}).value == "host=flag"


def test_cli_reads_the_state_file_under_home(tmp_path: Path, playbook: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    write_state(tmp_path / "h", {"api": "127.0.0.1:1"})
    assert main(["--home", str(tmp_path / "h"), "run", str(playbook)]) == 1
    assert "cannot reach the api at 127.0.0.1:1 (from the local stack" in capsys.readouterr().err


def test_migrate_without_a_database(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate"]) == 2
    assert "no database" in capsys.readouterr().err


def test_dev_status_without_a_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev", "status", "--json", "--home", str(tmp_path / "none")]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "no local stack" in captured.err


def test_dev_down_without_a_stack_is_a_no_op(tmp_path: Path) -> None:
    assert main(["dev", "down", "--home", str(tmp_path / "none")]) == 0
    assert not (tmp_path / "none").exists()


def test_role_command_template() -> None:
    assert role_command_from(None) is None
    cmd = role_command_from("coverage run -m {module} --name {role}")
    assert cmd is not None
    assert list(cmd("shard-manager")) == ["coverage", "run", "-m", "noetl_shard_manager", "--name", "shard-manager"]


def test_public_exports() -> None:
    assert sorted(noetl_cli.__all__) == sorted([
        "ROLES", "ServiceProcess", "StackError", "StackRunning", "StackState", "StackStatus", "down", "heal",
        "parse_scale", "status", "up"])
    assert noetl_cli.ROLES == ("shard-manager", "api", "projector", "checkpointer", "compactor", "reaper",
                               "worker")


def test_cluster_without_any_shard_manager_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "--home", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no shard-manager address" in err and "NOETL_SHARD_MANAGER_TARGET" in err


def test_cluster_with_an_unreachable_shard_manager(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "--shard-manager", "127.0.0.1:1"]) == 1
    assert "cannot reach the shard-manager at 127.0.0.1:1 (from --shard-manager)" in capsys.readouterr().err
