"""``noetl-rt rerun``: arguments are checked before any RPC (bad input exits 2)."""

from __future__ import annotations

import pytest

from noetl_cli.main import build_parser, main


def test_rerun_parses_from_and_the_run_options() -> None:
    args = build_parser().parse_args(["rerun", "42", "--from", "three", "--json", "--detach", "--timeout", "5",
                                      "--idempotency-key", "k"])
    assert (args.execution_id, args.from_step, args.json, args.detach, args.timeout, args.idempotency_key) == (
        "42", "three", True, True, 5.0, "k")
    defaults = build_parser().parse_args(["rerun", "42"])
    assert defaults.from_step == "" and not defaults.detach and defaults.idempotency_key == ""


@pytest.mark.parametrize(("argv", "message"), [
    (["rerun", "abc"], "execution id must be a number"),
    (["rerun", "0"], "execution id must be positive"),
    (["rerun", "7", "--from", " two"], "no surrounding spaces"),
])
def test_bad_arguments_exit_2_before_contacting_the_api(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--api", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err
