"""noetl-rt schedule ...: argument parsing and the rows it prints (noetl_cli.schedulecmd)."""

from __future__ import annotations

import pytest

from noetl_cli.main import build_parser
from noetl_cli.schedulecmd import schedule_dict
from noetl_client import values
from noetl_proto.v1 import schedule_pb2


def test_add_takes_a_cron_or_an_interval() -> None:
    a = build_parser().parse_args(["schedule", "add", "nightly", "--path", "etl/load", "--cron", "0 2 * * *",
                                   "--tz", "Europe/Berlin", "--catch-up", "once", "--payload", '{"d": 1}'])
    assert (a.name, a.path, a.cron, a.tz, a.every, a.catch_up, a.payload) == (
        "nightly", "etl/load", "0 2 * * *", "Europe/Berlin", None, "once", '{"d": 1}')
    a = build_parser().parse_args(["schedule", "add", "tick", "--path", "p", "--every", "1.5"])
    assert (a.every, a.catch_up, a.paused) == (1.5, "skip", False)


@pytest.mark.parametrize("argv", [
    ["schedule", "add", "x", "--path", "p"],                                  # neither
    ["schedule", "add", "x", "--path", "p", "--cron", "* * * * *", "--every", "1"],  # both
    ["schedule", "add", "x", "--path", "p", "--every", "1", "--catch-up", "never"],
])
def test_add_refuses_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


@pytest.mark.parametrize("action", ["pause", "resume", "delete"])
def test_changes_name_the_schedule(action: str) -> None:
    a = build_parser().parse_args(["schedule", action, "nightly"])
    assert (a.action, a.name) == (action, "nightly")


def test_schedule_dict_shows_policy_and_next_runs() -> None:
    s = schedule_pb2.Schedule(name="n", playbook_path="p", interval_ms=1500, payload=values.to_struct({"a": 1}),
                              catch_up=schedule_pb2.CATCH_UP_POLICY_ALL)
    s.next_runs.add().FromJsonString("2026-01-01T00:00:01Z")
    d = schedule_dict(s)
    assert (d["catch_up"], d["payload"], d["next_runs"], d["last_tick"]) == ("all", {"a": 1},
                                                                           ["2026-01-01T00:00:01Z"], "")
