"""Entry point of the worker role (``noetl-worker`` / ``python -m noetl_worker``).

Needs NOETL_POSTGRES_DSN, NOETL_NATS_URL, NOETL_API_TARGET and
NOETL_SHARD_MANAGER_TARGET; tuning under NOETL_WORKER_* (NOETL_WORKER_PYTHON_MEMORY_MB:
each python interpreter's memory limit) and NOETL_COMMAND_*; where results are stored
under NOETL_RESULT_* (tier db|s3, cache none|kv); the largest result a task may return:
NOETL_LIMIT_RESULT_BYTES.
"""

from __future__ import annotations

from noetl_common import harden
from noetl_common.config import (
    CommandSettings,
    CoreSettings,
    LimitSettings,
    NatsSettings,
    ResultStoreSettings,
    ShardSettings,
    WorkerSettings,
    load,
)
from noetl_common.service import run_service

from .service import WorkerService


def build() -> WorkerService:
    core = load(CoreSettings)
    core.require("postgres_dsn", "nats_url", "api_target", "shard_manager_target")
    return WorkerService(core, load(ShardSettings), load(CommandSettings), load(WorkerSettings),
                         results=load(ResultStoreSettings), limits=load(LimitSettings),
                         nats=load(NatsSettings))


def main() -> int:
    # before anything else (no thread yet): /proc/<pid>/environ must not show the secrets
    harden.reexec_without_secrets_in_environ()
    return run_service(build)


if __name__ == "__main__":
    raise SystemExit(main())
