"""Configuration, read once in each service's ``main()`` and passed down.

Each group is a pydantic-settings class with its own env prefix (seed 004 section 11
names). Nothing below ``main()`` calls ``os.getenv``. ``load()`` turns a validation
failure into a ``ConfigError`` that names the environment variable.
"""

from __future__ import annotations

import os
import socket
from typing import Literal, TypedDict, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from . import pools
from .errors import ConfigError

T = TypeVar("T", bound=BaseSettings)


def _env(prefix: str) -> SettingsConfigDict:
    """Settings read from ``{prefix}*`` variables; unknown ones ignored; ``inf``/``nan``
    rejected for numbers (an infinite lease would never expire)."""
    return SettingsConfigDict(env_prefix=prefix, extra="ignore", allow_inf_nan=False)


class NatsClientOptions(TypedDict):
    """The security keyword arguments of ``natsio.connect`` (``CoreSettings.nats_options``)."""

    ca_file: str
    creds_file: str
    cert_file: str
    key_file: str


class CoreSettings(BaseSettings):
    """Endpoints and identity shared by every role (``NOETL_*``)."""

    model_config = _env("NOETL_")

    postgres_dsn: str = Field(default="", description="libpq connection string of the runtime database")
    nats_url: str = Field(default="", description="NATS server URL(s), comma separated; may carry user:password@")
    # NATS client security (docs/DEPLOY.md "Security"): a creds file (user JWT + nkey
    # seed), the CA that signs the NATS server's certificate (TLS on when set), and an
    # optional client certificate for a server that verifies clients.
    nats_creds_file: str = Field(default="", description="NATS creds file (NOETL_NATS_CREDS_FILE)")
    nats_tls_ca_file: str = Field(default="", description="CA of the NATS server's certificate (TLS on when set)")
    nats_tls_cert_file: str = Field(default="", description="client certificate for NATS (with the key file)")
    nats_tls_key_file: str = Field(default="", description="client key for NATS")
    shard_manager_target: str = Field(default="", description="gRPC target of the shard-manager")
    api_target: str = Field(default="", description="gRPC target of the api role's client API (CLI, sub-playbooks)")
    # The api serves WorkerService (claims, lease renewals, credentials for claimed
    # commands) on its own port, apart from the client API.
    worker_api_listen: str = Field(default="127.0.0.1:0", description="host:port the api serves WorkerService on")
    worker_api_target: str = Field(default="", description="gRPC target of the api's WorkerService (workers)")
    grpc_listen: str = Field(default="127.0.0.1:0", description="host:port this service serves gRPC on")
    metrics_listen: str = Field(default="127.0.0.1:0", description="host:port for Prometheus /metrics")
    # A plaintext port that serves grpc.health.v1 only (the kubelet's gRPC probes cannot
    # speak TLS); "" = none.
    health_listen: str = Field(default="", description="host:port of a plaintext health-only gRPC server")
    instance: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    ready_file: str = Field(default="", description="write {role,pid,grpc,metrics} JSON here once serving")
    log_level: str = "INFO"
    # The role's asyncio event loop: uvloop's (libuv, with its transports and TLS in
    # Cython; docs/PERFORMANCE.md) or the standard library's.
    event_loop: Literal["uvloop", "asyncio"] = Field(default="uvloop", description="uvloop | asyncio")
    shutdown_grace_sec: float = Field(default=5.0, gt=0)
    # Calls a gRPC server holds before the role's event loop takes them up. gRPC's own
    # default holds 1,000 and cancels the calls past that at random (the client sees
    # CANCELLED with no reason), all of them past 3,000: a burst of 2,000 calls in flight on
    # one connection lost some (docs/DEPLOY.md "Calls in flight"). Past twice this, gRPC still
    # cancels new calls: the bound on what a flood of calls can hold in a role's memory.
    grpc_max_pending_calls: int = Field(default=8192, ge=16, le=1_000_000)
    # Tests only: a file of armed fault points (noetl_common.faults).
    faults_file: str = ""

    def nats_options(self) -> NatsClientOptions:
        """The keyword arguments of ``natsio.connect`` these settings give."""
        return {"ca_file": self.nats_tls_ca_file, "creds_file": self.nats_creds_file,
                "cert_file": self.nats_tls_cert_file, "key_file": self.nats_tls_key_file}

    def require(self, *names: str) -> None:
        missing = [f"NOETL_{n.upper()}" for n in names if not getattr(self, n)]
        if missing:
            raise ConfigError(f"missing required setting(s): {', '.join(missing)}")


class ShardSettings(BaseSettings):
    """Shard leases (``NOETL_SHARD_*``)."""

    model_config = _env("NOETL_SHARD_")

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

    model_config = _env("NOETL_COMMAND_")

    lease_sec: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    # A queued command not claimed for this long is republished.
    republish_after_sec: float = Field(default=10.0, gt=0)
    # The engine hands the next command straight to the worker that offered to take it
    # (docs/ARCHITECTURE.md "Handoff"); false: every command is queued and claimed.
    handoff: bool = True


class ScheduleSettings(BaseSettings):
    """Schedules (``NOETL_SCHEDULE_*``): the api validates with them, the reaper fires."""

    model_config = _env("NOETL_SCHEDULE_")

    # The shortest interval a schedule may have.
    min_interval_sec: float = Field(default=1.0, gt=0)
    # catch_up=skip: the latest due tick still fires when it is at most this late.
    misfire_grace_sec: float = Field(default=5.0, ge=0)
    # How often a reaper shard looks for due ticks when none is due sooner.
    poll_sec: float = Field(default=1.0, gt=0)
    # Bound of one SubmitExecution call from the scheduler.
    submit_timeout_sec: float = Field(default=10.0, gt=0)


class ExecutionSettings(BaseSettings):
    """Execution defaults and admission (``NOETL_EXECUTION_*``)."""

    model_config = _env("NOETL_EXECUTION_")

    default_timeout_sec: float = Field(default=3600.0, gt=0)
    # Sweep committed submissions whose nudge was lost.
    sweep_interval_sec: float = Field(default=2.0, gt=0)
    # Admission: running + pending executions, or queued commands, at or above these
    # answer RESOURCE_EXHAUSTED with a retry hint.
    max_active: int = Field(default=10_000, ge=1)
    max_queued_commands: int = Field(default=100_000, ge=1)
    # The most iterations of a collection loop (parallel or sequential) one command runs,
    # one after the other (NOETL_EXECUTION_LOOP_BATCH_MAX; noetl_flow.loops.batch_size).
    # 1: one per command.
    loop_batch_max: int = Field(default=32, ge=1, le=1000)
    # Once a loop's batches have shown their pace, a batch runs at least about this many
    # ms of iterations (NOETL_EXECUTION_LOOP_BATCH_MS; 0: batches shrink to one iteration
    # at the loop's end whatever their pace).
    loop_batch_ms: int = Field(default=100, ge=0, le=60_000)


class AuthSettings(BaseSettings):
    """Identity on every RPC (``NOETL_AUTH_*``; docs/DEPLOY.md "Security").

    Servers check the bearer token of every call (``authorization`` metadata) against
    the hashed tokens in ``noetl.api_token`` and the method's allowed roles; clients send
    ``token``. ``enabled`` false turns the check off (a test of something else, or a
    deployment that authenticates in front of the runtime); the local stack and the chart
    run with it on."""

    model_config = _env("NOETL_AUTH_")

    enabled: bool = True
    # This process's own token (its role's identity: service, worker; or a user's for the CLI).
    token: SecretStr = SecretStr("")
    # How long a verified token is trusted without looking at the table again (a revoked
    # token stops working within this).
    cache_sec: float = Field(default=5.0, ge=0)


class TlsSettings(BaseSettings):
    """TLS of gRPC servers and clients (``NOETL_TLS_*``). With ``ca_file`` set, clients
    verify servers against it; with ``cert_file``/``key_file`` set, servers serve TLS with
    that certificate (and clients present it when the servers ask: ``client_auth`` makes
    every server require a client certificate signed by ``ca_file``, i.e. mutual TLS).
    None set: plaintext (refused by the local stack and the chart's defaults)."""

    model_config = _env("NOETL_TLS_")

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    client_auth: bool = False
    # The name clients expect in server certificates when it is not the target's host
    # (e.g. one certificate for every pod behind a headless Service).
    server_name: str = ""

    @model_validator(mode="after")
    def _pairs(self) -> TlsSettings:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("NOETL_TLS_CERT_FILE and NOETL_TLS_KEY_FILE go together")
        if self.client_auth and not (self.ca_file and self.cert_file):
            raise ValueError("NOETL_TLS_CLIENT_AUTH needs NOETL_TLS_CA_FILE, NOETL_TLS_CERT_FILE and NOETL_TLS_KEY_FILE")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file)


class CredentialSettings(BaseSettings):
    """Credentials at rest (``NOETL_CREDENTIALS_*``): envelope encryption, a data key per
    credential (AES-256-GCM) wrapped by a master key. ``keys`` is ``id:base64key`` entries,
    comma separated: the first encrypts new credentials, every one decrypts (rotation:
    put the new key first, re-encrypt, then drop the old one). Only the api reads it."""

    model_config = _env("NOETL_CREDENTIALS_")

    keys: SecretStr = SecretStr("")


class LimitSettings(BaseSettings):
    """What one request may cost (``NOETL_LIMIT_*``; docs/ARCHITECTURE.md "Limits").

    Every limit is enforced before any work is done for the request it bounds, and a
    request beyond one is refused with ``INVALID_ARGUMENT`` (or ``RESOURCE_EXHAUSTED``)
    naming the setting, its value and what was asked for. The defaults are generous for
    real playbooks (upstream's largest fixture is 11 KB, 25 steps) and keep every role
    within its documented memory bound under hostile input."""

    model_config = _env("NOETL_LIMIT_")

    # A playbook's YAML text, in bytes.
    playbook_bytes: int = Field(default=1024 * 1024, ge=1024)
    # Steps in one playbook (routing and validation are linear in it).
    playbook_steps: int = Field(default=10_000, ge=1)
    # YAML nodes after alias expansion (a billion-laughs document is refused, not expanded).
    yaml_nodes: int = Field(default=200_000, ge=100)
    # Nesting depth of a playbook, a payload or a result (mappings and sequences). At most
    # 256: deeper values break Python's recursive consumers (copy.deepcopy, pydantic) at
    # its default recursion limit of 1000 frames.
    nesting_depth: int = Field(default=100, ge=8, le=256)
    # A submission's payload (JSON text), in bytes.
    payload_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # A workload larger than this travels to workers by reference, not inside each claim.
    inline_workload_bytes: int = Field(default=64 * 1024, ge=0)
    # Items of one loop's collection.
    loop_items: int = Field(default=500_000, ge=1)
    # One task result (encoded JSON), in bytes.
    result_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    # How deep sub-playbooks may nest (a playbook calling itself stops here).
    subplaybook_depth: int = Field(default=16, ge=1, le=1000)
    # A string or sequence a template operator (`*`, `%`, `~`, `+`, filters) may build, in items/characters.
    template_value_size: int = Field(default=10 * 1024 * 1024, ge=1024)
    # Bits of an integer a template may compute (`**`, `*`).
    template_int_bits: int = Field(default=65_536, ge=64)
    # Loop iterations in one template render, nested loops included (also the longest `range`).
    template_iterations: int = Field(default=100_000, ge=1000)
    # Everything one template render builds, added up (values, output, text a loop repeats),
    # in items/characters: bounds the work of a loop that builds values, not only its memory.
    template_render_size: int = Field(default=64 * 1024 * 1024, ge=1024)


class NatsSettings(BaseSettings):
    """JetStream streams (``NOETL_NATS_*``; docs/DEPLOY.md "NATS durability")."""

    model_config = _env("NOETL_NATS_")

    # Replicas of the two streams (R3 on a 3-node JetStream cluster in production).
    stream_replicas: int = Field(default=1, ge=1, le=5)


class ProjectionSettings(BaseSettings):
    model_config = _env("NOETL_PROJECTION_")

    batch_size: int = Field(default=500, ge=1, le=100_000)
    poll_ms: int = Field(default=100, ge=5)
    # How long the projector lets events gather after the engine hints them, unless the hint
    # says an execution ended or a checkpoint barrier was appended (those are projected at
    # once); 0 projects every hinted batch at once (seed 004: the 100 ms micro-batch window).
    batch_window_ms: int = Field(default=50, ge=0, le=10_000)


class CheckpointSettings(BaseSettings):
    model_config = _env("NOETL_CHECKPOINT_")

    interval_ms: int = Field(default=1000, ge=10)


class CompactorSettings(BaseSettings):
    """Retention (``NOETL_RETENTION_DAYS``, ``NOETL_COMPACTOR_*``)."""

    model_config = _env("NOETL_")

    retention_days: float = Field(default=30.0, ge=0)
    compactor_enabled: bool = False
    # Event partitions are created this many days ahead of need.
    partitions_ahead_days: int = Field(default=3, ge=1)
    # How often each held shard looks for executions past the horizon (and partitions
    # are checked), and how much one fenced transaction compacts at most.
    compactor_interval_sec: float = Field(default=60.0, gt=0)
    compactor_batch_executions: int = Field(default=500, ge=1, le=100_000)
    compactor_batch_events: int = Field(default=50_000, ge=1)


class ResultStoreSettings(BaseSettings):
    """Where task results live (``NOETL_RESULT_*``; docs/ARCHITECTURE.md "Result store").

    ``tier`` is where new results are written: ``db`` (Postgres ``noetl.result_payload``)
    or ``s3`` (an S3-compatible object store). Every reader resolves any tier: a
    reference's tier and uri are in ``noetl.result_ref``, so the S3 endpoint is used for
    reads whenever it is configured. ``cache = kv`` adds a NATS KV read-through cache
    (bucket ``kv_bucket``, key = ref id); values above ``kv_max_value_bytes`` are not
    cached. Every store call is bounded by ``timeout_sec``.

    S3 credentials: ``s3_access_key`` and ``s3_secret_key`` when both are set (static
    keys), else the S3 library's default chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, web identity / IRSA, container credentials, the instance
    profile: docs/DEPLOY.md "Result store on S3").
    """

    model_config = _env("NOETL_RESULT_")

    tier: Literal["db", "s3"] = "db"
    cache: Literal["none", "kv"] = "none"
    timeout_sec: float = Field(default=30.0, gt=0)
    s3_endpoint: str = Field(default="", description="http(s)://host:port of the S3-compatible server")
    s3_bucket: str = ""
    s3_region: str = "us-east-1"
    s3_access_key: str = ""
    s3_secret_key: SecretStr = SecretStr("")
    s3_prefix: str = "noetl/results/"
    s3_connect_timeout_sec: float = Field(default=5.0, gt=0)
    # Attempts per S3 request on transient failures (connection errors, 5xx, 429).
    s3_attempts: int = Field(default=3, ge=1, le=10)
    kv_bucket: str = Field(default="noetl_results", pattern=r"^[A-Za-z0-9_-]+$")
    kv_max_value_bytes: int = Field(default=512 * 1024, ge=1)
    kv_timeout_sec: float = Field(default=2.0, gt=0)
    # Entries expire after this long (0 = never; results are immutable).
    kv_ttl_sec: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _s3_complete(self) -> ResultStoreSettings:
        if self.tier == "s3" or self.s3_endpoint:
            names = {"s3_endpoint": self.s3_endpoint, "s3_bucket": self.s3_bucket}
            missing = [f"NOETL_RESULT_{n.upper()}" for n, v in names.items() if not v]
            if missing:
                why = "NOETL_RESULT_TIER=s3" if self.tier == "s3" else "NOETL_RESULT_S3_ENDPOINT"
                raise ValueError(f"{why} needs {', '.join(missing)}")
            if bool(self.s3_access_key) != bool(self.s3_secret_key.get_secret_value()):
                raise ValueError("NOETL_RESULT_S3_ACCESS_KEY and NOETL_RESULT_S3_SECRET_KEY go together: set both "
                                 "(static keys) or neither (the default AWS credential chain)")
            if not self.s3_endpoint.startswith(("http://", "https://")):
                raise ValueError(f"NOETL_RESULT_S3_ENDPOINT must be an http(s):// URL, got {self.s3_endpoint!r}")
        if self.s3_prefix and not self.s3_prefix.endswith("/"):
            self.s3_prefix += "/"
        return self

    @property
    def s3_configured(self) -> bool:
        return bool(self.s3_endpoint)


# WorkerSettings.python_pool 0: this many interpreters at most (each ~25 MiB idle; on 2 cores
# interleaved fan-out runs gave ~690 it/s with 8, ~720 with 16, ~700 with 64), PYTHON_WARM of
# them started with the worker.
PYTHON_POOL_CAP = 16
PYTHON_WARM = 4


class WorkerSettings(BaseSettings):
    """Worker pool (``NOETL_WORKER_*``)."""

    model_config = _env("NOETL_WORKER_")

    # Commands a worker runs at once (asyncio slots: http, postgres and sub-playbook tasks
    # wait without holding a thread; python tasks share the interpreters below). 64: a
    # `max_in_flight: 64` loop is not capped at a smaller width (docs/BENCHMARKS.md).
    concurrency: int = Field(default=64, ge=1, le=1024)
    # Python interpreters for `kind: python`, at most; 0 = min(concurrency, 16). PYTHON_WARM
    # start with the worker, more as tasks find none idle (tools/python.py).
    python_pool: int = Field(default=0, ge=0, le=1024)
    default_task_timeout_sec: float = Field(default=0.0, ge=0)
    # Address space of each python task interpreter, in MiB (0 = unlimited): a task that
    # allocates beyond it fails with MemoryError instead of taking the worker's memory.
    python_memory_mb: int = Field(default=1024, ge=0)
    # Tasks a python interpreter runs before it is replaced (0 = never): module state a task
    # leaves (imports, caches, patched globals) lives no longer than this. A replacement
    # costs about 45 ms of CPU: at the former fixed 1,000, about 45 µs per task, more than
    # a batched task's exchange with its child costs both sides (about 32 µs,
    # docs/PERFORMANCE.md).
    python_tasks_per_child: int = Field(default=10_000, ge=0)
    # Most claims one ClaimCommands call carries (concurrent claims are group-committed).
    claim_batch: int = Field(default=64, ge=1, le=1000)
    # A batch of loop iterations stops starting new ones once it has run this long; the
    # rest go back to the loop (NOETL_WORKER_BATCH_BUDGET_SEC; runner.execute_command).
    batch_budget_sec: float = Field(default=0.25, gt=0)
    # How long an outage of the result store or of the runtime database is waited out
    # before a result the worker holds is reported REFERENCE_NOT_AVAILABLE.
    infra_retry_sec: float = Field(default=600.0, gt=0)
    # Where the duckdb tool keeps file databases (a task's `database` must resolve inside it)
    # and its extension directory; empty: <temp dir>/noetl-duckdb-<uid>.
    duckdb_dir: str = ""
    # The only directory `script: {source: {type: file}}` may read (a task's path resolves
    # beside its playbook's catalog path under it); empty: file scripts are refused.
    script_dir: str = ""
    # The pools this worker serves (comma-separated, its own first), its labels
    # (`key=value,key=value`) and the tool kinds it runs (comma-separated; empty: every
    # kind): it takes only commands placed in its pools whose required labels it has
    # (noetl_common.pools).
    pool: str = "default"
    labels: str = ""
    tools: str = ""

    @field_validator("pool")
    @classmethod
    def _pool_name(cls, value: str) -> str:
        pools.parse_pools(value)  # ValueError names the bad name
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: str) -> str:
        pools.parse_labels(value)  # ValueError names the bad entry
        return value

    @property
    def python_pool_size(self) -> int:
        """The python interpreters at most (``python_pool``, 0: min(concurrency, PYTHON_POOL_CAP))."""
        return self.python_pool or min(self.concurrency, PYTHON_POOL_CAP)


class TracingSettings(BaseSettings):
    """OpenTelemetry tracing (``NOETL_OTEL_*``; docs/DEPLOY.md "Tracing"). Off by default.

    ``exporter``: ``none`` (no provider, no interceptors: tracing costs nothing),
    ``otlp`` (OTLP/HTTP protobuf to ``endpoint``, e.g. ``http://otel-collector:4318``;
    ``/v1/traces`` is appended when the URL has no path), ``console`` (one JSON document
    per span on stdout) or ``jsonl`` (one JSON line per span appended to ``file``, whose
    ``{role}``, ``{pid}`` and ``{instance}`` are expanded: a file per process)."""

    model_config = _env("NOETL_OTEL_")

    exporter: Literal["none", "otlp", "console", "jsonl"] = "none"
    endpoint: str = Field(default="", description="OTLP/HTTP collector URL (exporter otlp)")
    file: str = Field(default="", description="span file of exporter jsonl ({role}, {pid}, {instance} expanded)")
    # Default: noetl-<role>.
    service_name: str = ""
    # Fraction of new traces recorded (a trace continued from a parent follows the parent's decision).
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    timeout_sec: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _exporter_complete(self) -> TracingSettings:
        if self.exporter == "otlp":
            if not self.endpoint:
                raise ValueError("NOETL_OTEL_EXPORTER=otlp needs NOETL_OTEL_ENDPOINT (e.g. http://otel-collector:4318)")
            if not self.endpoint.startswith(("http://", "https://")):
                raise ValueError(f"NOETL_OTEL_ENDPOINT must be an http(s):// URL, got {self.endpoint!r}")
        if self.exporter == "jsonl" and not self.file:
            raise ValueError("NOETL_OTEL_EXPORTER=jsonl needs NOETL_OTEL_FILE (e.g. /tmp/spans/{role}-{pid}.jsonl)")
        return self


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
