"""Configuration is validated at start with a message naming the variable
(``noetl_common.config.load``), and a role started with a bad value exits 2 saying so
(``noetl_common.service.run_service``) before it connects to anything."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import uvloop

from noetl_common.config import (
    CheckpointSettings,
    CommandSettings,
    CoreSettings,
    ProjectionSettings,
    ShardSettings,
    load,
)
from noetl_common.errors import ConfigError
from noetl_common.service import event_loop_factory

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No NOETL_* setting of the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("NOETL_"):
            monkeypatch.delenv(name)
    yield


def config_error(cls: type, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load(cls)
    return str(info.value)


def test_defaults_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with nothing set every group loads (so the failures below are the values)."""
    shard = load(ShardSettings)
    assert (shard.count, shard.heartbeat_sec, shard.lease_sec) == (16, 10.0, 30.0)
    assert 0 < shard.margin_sec < shard.lease_sec
    assert load(CommandSettings).lease_sec == 30.0
    assert load(ProjectionSettings).batch_size == 500
    assert load(CheckpointSettings).interval_ms == 1000
    monkeypatch.setenv("NOETL_SHARD_COUNT", "4")
    monkeypatch.setenv("NOETL_SHARD_HEARTBEAT_SEC", "1")
    monkeypatch.setenv("NOETL_SHARD_LEASE_SEC", "3")
    monkeypatch.setenv("NOETL_COMMAND_LEASE_SEC", "2")
    monkeypatch.setenv("NOETL_PROJECTION_BATCH_SIZE", "1")
    assert (load(ShardSettings).count, load(ShardSettings).lease_sec) == (4, 3.0)
    assert load(CommandSettings).lease_sec == 2.0
    assert load(ProjectionSettings).batch_size == 1


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", "", "99999"])
def test_bad_shard_count(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    message = config_error(ShardSettings, {"NOETL_SHARD_COUNT": value}, monkeypatch)
    assert "NOETL_SHARD_COUNT" in message, message


@pytest.mark.parametrize(("lease", "heartbeat"), [("10", "10"), ("5", "10"), ("1", "1"), ("3", "2")])
def test_shard_lease_must_outlive_heartbeats(lease: str, heartbeat: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease not greater than (twice) the heartbeat would expire between renewals."""
    message = config_error(ShardSettings, {"NOETL_SHARD_LEASE_SEC": lease, "NOETL_SHARD_HEARTBEAT_SEC": heartbeat},
                           monkeypatch)
    assert "NOETL_SHARD_LEASE_SEC" in message and "NOETL_SHARD_HEARTBEAT_SEC" in message, message


@pytest.mark.parametrize(("name", "value"), [
    ("NOETL_SHARD_LEASE_SEC", "0"), ("NOETL_SHARD_LEASE_SEC", "inf"), ("NOETL_SHARD_LEASE_SEC", "nan"),
    ("NOETL_SHARD_HEARTBEAT_SEC", "0"), ("NOETL_SHARD_HEARTBEAT_SEC", "-1"),
])
def test_bad_shard_timings(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    message = config_error(ShardSettings, {name: value}, monkeypatch)
    assert name in message, message


@pytest.mark.parametrize("value", ["0", "-2", "inf", "nan", "soon"])
def test_bad_command_lease(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero (or endless) claim lease would reap every task at once (or never)."""
    message = config_error(CommandSettings, {"NOETL_COMMAND_LEASE_SEC": value}, monkeypatch)
    assert "NOETL_COMMAND_LEASE_SEC" in message, message


@pytest.mark.parametrize("value", ["0", "-5", "ten", "1000000"])
def test_bad_projection_batch_size(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    message = config_error(ProjectionSettings, {"NOETL_PROJECTION_BATCH_SIZE": value}, monkeypatch)
    assert "NOETL_PROJECTION_BATCH_SIZE" in message, message


def test_bad_checkpoint_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    message = config_error(CheckpointSettings, {"NOETL_CHECKPOINT_INTERVAL_MS": "0"}, monkeypatch)
    assert "NOETL_CHECKPOINT_INTERVAL_MS" in message, message


def test_event_loop_is_uvloop_unless_asked_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(CoreSettings).event_loop == "uvloop"
    factory = event_loop_factory("uvloop")
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    assert event_loop_factory("asyncio") is None  # asyncio.Runner's default loop
    message = config_error(CoreSettings, {"NOETL_EVENT_LOOP": "trio"}, monkeypatch)
    assert "NOETL_EVENT_LOOP" in message and "uvloop" in message and "asyncio" in message, message


# Endpoints that would be contacted if the role got past its configuration: nothing listens
# there, so a role that accepted the bad value would fail differently (or hang) instead.
UNREACHABLE = {"NOETL_POSTGRES_DSN": "postgresql://nobody@127.0.0.1:1/none",
               "NOETL_NATS_URL": "nats://127.0.0.1:1", "NOETL_SHARD_MANAGER_TARGET": "127.0.0.1:1",
               "NOETL_API_TARGET": "127.0.0.1:1"}


@pytest.mark.parametrize(("module", "name", "value"), [
    ("noetl_projector", "NOETL_PROJECTION_BATCH_SIZE", "0"),
    ("noetl_api", "NOETL_COMMAND_LEASE_SEC", "0"),
    ("noetl_shard_manager", "NOETL_SHARD_COUNT", "x"),
    ("noetl_worker", "NOETL_SHARD_LEASE_SEC", "1"),
    ("noetl_reaper", "NOETL_EVENT_LOOP", "trio"),
])
def test_role_started_with_a_bad_value_exits_2_naming_it(module: str, name: str, value: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    env.update(UNREACHABLE, **{name: value, "NOETL_LOG_LEVEL": "INFO"})
    proc = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert name in proc.stdout, proc.stdout
    assert "invalid configuration" in proc.stdout, proc.stdout
