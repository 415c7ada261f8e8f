"""Configuration, read once in each service's ``main()`` and passed down.

Each group is a pydantic-settings class with its own env prefix (seed 004 section 11
names). Nothing below ``main()`` calls ``os.getenv``. ``load()`` turns a validation
failure into a ``ConfigError`` that names the environment variable.
"""

from __future__ import annotations

import os
import socket
from typing import TypeVar

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigError

T = TypeVar("T", bound=BaseSettings)


class CoreSettings(BaseSettings):
    """Endpoints and identity shared by every role (``NOETL_*``)."""

    model_config = SettingsConfigDict(env_prefix="NOETL_", extra="ignore")

    postgres_dsn: str = Field(default="", description="libpq connection string of the runtime database")
    nats_url: str = Field(default="", description="NATS server URL(s), comma separated")
    shard_manager_target: str = Field(default="", description="gRPC target of the shard-manager")
    api_target: str = Field(default="", description="gRPC target of the api role (workers, CLI)")
    grpc_listen: str = Field(default="127.0.0.1:0", description="host:port this service serves gRPC on")
    metrics_listen: str = Field(default="127.0.0.1:0", description="host:port for Prometheus /metrics")
    instance: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    ready_file: str = Field(default="", description="write {role,pid,grpc,metrics} JSON here once serving")
    log_level: str = "INFO"
    shutdown_grace_sec: float = Field(default=5.0, gt=0)

    def require(self, *names: str) -> None:
        missing = [f"NOETL_{n.upper()}" for n in names if not getattr(self, n)]
        if missing:
            raise ConfigError(f"missing required setting(s): {', '.join(missing)}")


class ShardSettings(BaseSettings):
    """Shard leases (``NOETL_SHARD_*``)."""

    model_config = SettingsConfigDict(env_prefix="NOETL_SHARD_", extra="ignore")

    count: int = Field(default=16, ge=1, le=4096)
    heartbeat_sec: float = Field(default=10.0, gt=0)
    lease_sec: float = Field(default=30.0, gt=0)
    # A member stops touching a shard this long before its lease runs out.
    margin_sec: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _lease_outlives_heartbeats(self) -> ShardSettings:
        if self.lease_sec < 2 * self.heartbeat_sec:
            raise ValueError(
                f"NOETL_SHARD_LEASE_SEC ({self.lease_sec}) must be at least twice "
                f"NOETL_SHARD_HEARTBEAT_SEC ({self.heartbeat_sec})"
            )
        if self.margin_sec == 0:
            self.margin_sec = min(self.heartbeat_sec, self.lease_sec / 4)
        if self.margin_sec >= self.lease_sec:
            raise ValueError("NOETL_SHARD_MARGIN_SEC must be below NOETL_SHARD_LEASE_SEC")
        return self


class CommandSettings(BaseSettings):
    """Command claim leases and retry budget (``NOETL_COMMAND_*``)."""

    model_config = SettingsConfigDict(env_prefix="NOETL_COMMAND_", extra="ignore")

    lease_sec: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    # A queued command not claimed for this long is republished.
    republish_after_sec: float = Field(default=10.0, gt=0)


class ExecutionSettings(BaseSettings):
    """Execution defaults and admission (``NOETL_EXECUTION_*``)."""

    model_config = SettingsConfigDict(env_prefix="NOETL_EXECUTION_", extra="ignore")

    default_timeout_sec: float = Field(default=3600.0, gt=0)
    # Sweep committed submissions whose nudge was lost.
    sweep_interval_sec: float = Field(default=2.0, gt=0)
    # Admission: running + pending executions, or queued commands, at or above these
    # answer RESOURCE_EXHAUSTED with a retry hint.
    max_active: int = Field(default=10_000, ge=1)
    max_queued_commands: int = Field(default=100_000, ge=1)


class ProjectionSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NOETL_PROJECTION_", extra="ignore")

    batch_size: int = Field(default=500, ge=1, le=100_000)
    poll_ms: int = Field(default=100, ge=5)
    batch_window_ms: int = Field(default=0, ge=0)


class CheckpointSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NOETL_CHECKPOINT_", extra="ignore")

    interval_ms: int = Field(default=1000, ge=10)


class CompactorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NOETL_", extra="ignore")

    retention_days: float = Field(default=30.0, ge=0)
    compactor_enabled: bool = False
    # Event partitions are created this many days ahead of need.
    partitions_ahead_days: int = Field(default=3, ge=1)


class WorkerSettings(BaseSettings):
    """Worker pool (``NOETL_WORKER_*``)."""

    model_config = SettingsConfigDict(env_prefix="NOETL_WORKER_", extra="ignore")

    concurrency: int = Field(default=8, ge=1, le=1024)
    # Warm Python interpreters for `kind: python`; 0 = same as concurrency.
    python_pool: int = Field(default=0, ge=0, le=1024)
    default_task_timeout_sec: float = Field(default=0.0, ge=0)
    fetch_batch: int = Field(default=16, ge=1)


def load(cls: type[T], **overrides: object) -> T:
    """Build a settings object from the environment, with a clear ConfigError on bad values."""
    try:
        return cls(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        prefix = str(cls.model_config.get("env_prefix", ""))
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            name = f"{prefix}{field}".upper() if field else cls.__name__
            problems.append(f"{name}: {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from exc
