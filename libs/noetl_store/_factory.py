"""``make_result_store``: the one place a service turns ``ResultStoreSettings`` into a store.

    [LRU in process] -> [NATS KV read-through, cache=kv] -> PostgresResultStore (tier db)
                                                          | S3ResultStore       (tier s3)

Both write the configured tier and read every tier (S3 reads whenever an endpoint is
configured). At start the S3 bucket is checked: a missing bucket or refused keys are a
``ConfigError`` naming the setting; a server that is merely down is logged (results then
fail with REFERENCE_NOT_AVAILABLE until it is back, like any other outage).
"""

from __future__ import annotations

import logging
from typing import Any

from noetl_common.config import ResultStoreSettings
from noetl_common.db import Pool
from noetl_common.errors import ConfigError, NotFound, Unavailable

from ._kv import KvCachedResultStore
from ._postgres import PostgresResultStore, S3ResultStore
from ._s3 import AccessDenied, CredentialsUnavailable, S3Client, S3Config
from ._store import CachedResultStore, ResultStore

logger = logging.getLogger(__name__)


def s3_client(settings: ResultStoreSettings) -> S3Client:
    return S3Client(S3Config(
        endpoint=settings.s3_endpoint, bucket=settings.s3_bucket, access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(), region=settings.s3_region,
        timeout_sec=settings.timeout_sec, connect_timeout_sec=settings.s3_connect_timeout_sec,
        attempts=settings.s3_attempts))


async def check_bucket(objects: S3Client) -> None:
    """ConfigError when the bucket is missing, the keys are refused or no credentials can be
    found (no static keys and no link of the default chain answered); a warning when only the
    S3 server cannot be reached now."""
    try:
        await objects.head_bucket()
    except NotFound as exc:
        raise ConfigError(f"NOETL_RESULT_S3_BUCKET: bucket {objects.bucket!r} does not exist at "
                          f"{objects.config.endpoint}") from exc
    except AccessDenied as exc:
        which = ("NOETL_RESULT_S3_ACCESS_KEY / NOETL_RESULT_S3_SECRET_KEY" if objects.config.static_keys
                 else "the default AWS credential chain (NOETL_RESULT_S3_ACCESS_KEY unset)")
        raise ConfigError(f"{which}: the S3 server at {objects.config.endpoint} refused them for bucket "
                          f"{objects.bucket!r} ({exc})") from exc
    except CredentialsUnavailable as exc:
        raise ConfigError(
            "S3 credentials: NOETL_RESULT_S3_ACCESS_KEY / NOETL_RESULT_S3_SECRET_KEY are unset and the default "
            "AWS credential chain found none (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, web identity: "
            "AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, container credentials, instance profile): "
            f"{exc}") from exc
    except Unavailable as exc:
        logger.warning("result store: S3 server not reachable at start (%s); results stored in tier s3 "
                       "fail until it is", exc)


async def make_result_store(settings: ResultStoreSettings, pool: Pool, js: Any = None, *,
                            lru_items: int = 0, check: bool = True, max_result_bytes: int = 0) -> ResultStore:
    """The result store a service uses. ``js`` (a JetStream context) is needed for
    ``cache=kv``; ``lru_items`` > 0 adds an in-process LRU in front; ``check`` verifies the
    S3 bucket at start; ``max_result_bytes`` > 0 makes a put of a larger value (encoded
    JSON) raise ``ResultTooLarge`` (the worker passes ``NOETL_LIMIT_RESULT_BYTES``)."""
    objects = s3_client(settings) if settings.s3_configured else None
    store: ResultStore
    if objects is not None:
        if check:
            try:
                await check_bucket(objects)
            except ConfigError:
                await objects.close()
                raise
        if settings.tier == "s3":
            store = S3ResultStore(pool, objects, prefix=settings.s3_prefix, timeout_sec=settings.timeout_sec,
                                  owns_objects=True, max_bytes=max_result_bytes)
        else:
            store = PostgresResultStore(pool, objects=objects, timeout_sec=settings.timeout_sec, owns_objects=True,
                                        max_bytes=max_result_bytes)
    else:
        store = PostgresResultStore(pool, timeout_sec=settings.timeout_sec, max_bytes=max_result_bytes)
    if settings.cache == "kv":
        if js is None:
            raise ConfigError("NOETL_RESULT_CACHE=kv needs NATS (NOETL_NATS_URL)")
        kv = KvCachedResultStore(store, js, bucket=settings.kv_bucket, max_value_bytes=settings.kv_max_value_bytes,
                                 timeout_sec=settings.kv_timeout_sec, ttl_sec=settings.kv_ttl_sec)
        await kv.create()
        store = kv
    if lru_items > 0:
        store = CachedResultStore(store, max_items=lru_items)
    logger.info("result store: tier=%s cache=%s%s", settings.tier, settings.cache,
                f" s3={settings.s3_endpoint}/{settings.s3_bucket}" if objects is not None else "")
    return store
