"""A small S3 client (path-style addressing, SigV4 headers) over httpx: PUT / GET / HEAD
of objects, HEAD / PUT of the bucket. Enough for the result store; nothing more.

Errors are translated here, once (``_translate``):

    httpx timeout, network error, 5xx, 429     -> Unavailable  (retried, then raised)
    404 (NoSuchKey / NoSuchBucket)             -> NotFound
    401 / 403                                  -> AccessDenied (a NoetlError: fix the keys)
    any other 4xx, other transport errors      -> NoetlError naming the S3 error code

Which failures are transient is S3's classifier in ``noetl_common.retry``
(``s3_transient``, ``s3_status_transient``). Every request has httpx timeouts (connect,
read, write, pool) and is retried at most ``attempts`` times on ``Unavailable`` with
capped, jittered backoff (``retry.retry_transient``); callers bound the whole operation
with their own deadline as well.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from noetl_common.errors import NoetlError, NotFound, Unavailable
from noetl_common.retry import retry_transient, s3_status_transient, s3_transient

from ._sigv4 import EMPTY_SHA256, sign, uri_encode

logger = logging.getLogger(__name__)

BACKOFF_START_SEC = 0.05
BACKOFF_CAP_SEC = 1.0
_CODE = re.compile(rb"<Code>([^<]+)</Code>")


class AccessDenied(NoetlError):
    """The S3 server refused the credentials or the operation (401/403)."""


@dataclass(frozen=True, slots=True)
class S3Config:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"
    timeout_sec: float = 30.0
    connect_timeout_sec: float = 5.0
    attempts: int = 3


class S3Client:
    """Objects of one bucket. ``transport`` is for tests (an httpx transport)."""

    def __init__(self, config: S3Config, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        parts = urlsplit(config.endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"S3 endpoint must be an http(s)://host[:port] URL, got {config.endpoint!r}")
        self.config = config
        self.bucket = config.bucket
        self._base = f"{parts.scheme}://{parts.netloc}"
        self._host = parts.netloc
        self._root = parts.path.rstrip("/")
        timeout = httpx.Timeout(config.timeout_sec, connect=config.connect_timeout_sec)
        self._http = httpx.AsyncClient(timeout=timeout, transport=transport, follow_redirects=False,
                                       limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def key_of(self, uri: str) -> str:
        """The object key of an ``s3://bucket/key`` uri of this bucket; ValueError otherwise."""
        prefix = f"s3://{self.bucket}/"
        if not uri.startswith(prefix):
            raise ValueError(f"{uri!r} is not an object of bucket {self.bucket!r}")
        return uri[len(prefix):]

    # ------------------------------------------------------------ objects

    async def put_object(self, key: str, data: bytes, *, content_type: str = "application/json") -> None:
        await self._request("PUT", key, body=data, headers={"content-type": content_type})

    async def get_object(self, key: str) -> bytes:
        resp = await self._request("GET", key)
        return resp.content

    async def head_object(self, key: str) -> int:
        """The object's size in bytes; NotFound when there is none."""
        resp = await self._request("HEAD", key)
        return int(resp.headers.get("content-length") or 0)

    # ------------------------------------------------------------ bucket

    async def head_bucket(self) -> None:
        """NotFound when the bucket does not exist, AccessDenied when the keys are refused."""
        await self._request("HEAD", None)

    async def create_bucket(self) -> None:
        """Create the bucket (already owning it is fine)."""
        try:
            await self._request("PUT", None)
        except NoetlError as exc:
            if "BucketAlreadyOwnedByYou" not in str(exc) and "BucketAlreadyExists" not in str(exc):
                raise

    async def close(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------ transport

    def _path(self, key: str | None) -> str:
        return f"{self._root}/{self.bucket}" + (f"/{key}" if key is not None else "")

    async def _request(self, method: str, key: str | None, *, body: bytes = b"",
                       headers: dict[str, str] | None = None) -> httpx.Response:
        what = f"{method} s3://{self.bucket}/{key or ''}"
        return await retry_transient(what, lambda: self._once(method, key, body, headers or {}, what),
                                     deadline_sec=None, attempts=self.config.attempts, initial=BACKOFF_START_SEC,
                                     cap=BACKOFF_CAP_SEC)

    async def _once(self, method: str, key: str | None, body: bytes, headers: dict[str, str],
                    what: str) -> httpx.Response:
        path = self._path(key)
        payload_hash = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        signed = {"host": self._host, **{k.lower(): v for k, v in headers.items()}}
        auth = sign(method, path, {}, signed, payload_hash, access_key=self.config.access_key,
                    secret_key=self.config.secret_key, region=self.config.region)
        send = {k: v for k, v in signed.items() if k != "host"}
        send.update(auth)
        try:
            resp = await self._http.request(method, self._base + uri_encode(path, keep_slash=True), content=body or None,
                                            headers=send)
        except httpx.TimeoutException as exc:
            raise Unavailable(f"{what}: the S3 server did not answer in time ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            if s3_transient(exc):
                raise Unavailable(f"{what}: cannot reach the S3 server at {self._base}: {exc}") from exc
            raise NoetlError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code < 300:
            return resp
        raise _translate(resp, what)


def _translate(resp: httpx.Response, what: str) -> NoetlError:
    status = resp.status_code
    match = _CODE.search(resp.content or b"")
    code = match.group(1).decode(errors="replace") if match else ""
    message = f"{what}: {code} (HTTP {status})" if code else f"{what}: HTTP {status}"
    if status == 404:
        return NotFound(message)
    if status in (401, 403):
        return AccessDenied(message)
    if s3_status_transient(status):
        return Unavailable(message)
    return NoetlError(message)

