"""Entry point of the api role: ``python -m noetl_api`` / ``noetl-api``.

Needs NOETL_POSTGRES_DSN, NOETL_NATS_URL and NOETL_SHARD_MANAGER_TARGET; the result
store is configured under NOETL_RESULT_* like the workers': the api reads every tier.
NOETL_CREDENTIALS_KEYS (``id:base64key,...``) holds the master keys of the stored
credentials: required once any credential is stored (credentials.py); only the api has it.
"""

from __future__ import annotations

from noetl_common.config import (
    CommandSettings,
    CoreSettings,
    CredentialSettings,
    ExecutionSettings,
    LimitSettings,
    NatsSettings,
    ResultStoreSettings,
    ScheduleSettings,
    ShardSettings,
    load,
)
from noetl_common.service import run_service

from .service import ApiService


def main() -> int:
    return run_service(lambda: ApiService(load(CoreSettings), load(ShardSettings), load(CommandSettings),
                                          load(ExecutionSettings), load(ResultStoreSettings),
                                          load(LimitSettings), load(NatsSettings),
                                          load(CredentialSettings), load(ScheduleSettings)))
