"""The result store's S3 client: obstore (Python bindings of the Rust ``object_store``
crate's S3 client: SigV4 signing, credential providers, connection pooling) for objects,
and one presigned request for the bucket. Why obstore and not aiobotocore or our own
signer: docs/ARCHITECTURE.md "Result store" (measured by scripts/measure_s3_clients.py).

    PUT / GET / HEAD object   obstore put_async / get_async / head_async (one PUT,
                              never multipart: a result is written whole or not at all)
    HEAD / PUT bucket         a URL presigned by obstore (the same credentials), sent
                              with httpx: object_store has no bucket operations

Addressing is path-style (``{endpoint}/{bucket}/{key}``: SeaweedFS, MinIO and AWS all
take it), at the configured endpoint and region. Credentials: the configured static keys
when both are set, else obstore's default chain, in its order: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``), web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``
+ ``AWS_ROLE_ARN``: EKS IRSA, an STS AssumeRoleWithWebIdentity), container credentials
(ECS task roles, EKS Pod Identity), then the EC2 instance profile (IMDSv2); temporary
credentials are refreshed before they expire. TLS trusts the system roots plus the PEM
file ``ca_file`` names (default ``$SSL_CERT_FILE``, which the httpx client honoured).

Errors are translated here, once (``_translate``, ``_status_error``):

    connect / request errors, timeouts, 5xx, 429   -> Unavailable  (retried, then raised)
    404 (NoSuchKey / NoSuchBucket)                 -> NotFound
    401 / 403                                      -> AccessDenied (a NoetlError: fix the keys)
    any other 4xx, anything else                   -> NoetlError naming the S3 error code

Which failures are transient is S3's classifier in ``noetl_common.retry``
(``s3_transient``, ``s3_status_transient``). Every request has timeouts (connect, whole
request) and is retried at most ``attempts`` times on ``Unavailable`` with capped,
jittered backoff (``retry.retry_transient``; obstore's own retries are off, so the policy
is the project's one); callers bound the whole operation with their own deadline as well.

obstore completes each awaited call from a thread of its Rust runtime (a
``call_soon_threadsafe`` into the loop). A process that finalizes while such a thread is
still inside that call is aborted by CPython 3.11 (SIGABRT at exit); ``close()`` gives
those threads ``SETTLE_SEC`` to get out of it (scripts/measure_s3_clients.py, part
``exits``, counts abnormal exits: docs/ARCHITECTURE.md "Result store" has the numbers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, NoReturn
from urllib.parse import urlsplit

import httpx
import obstore
from obstore.store import S3Store

from noetl_common.errors import NoetlError, NotFound, Unavailable
from noetl_common.retry import obstore_failure, retry_transient, s3_status_transient, s3_transient

logger = logging.getLogger(__name__)

BACKOFF_START_SEC = 0.05
BACKOFF_CAP_SEC = 1.0
# How long a presigned bucket URL is valid (it is used at once).
PRESIGN_SEC = 60
# close(): how long the Rust runtime's threads get to finish completing the last calls.
SETTLE_SEC = 0.02
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_TARGET = re.compile(r"Error performing [A-Z]+ (\S+)")


class AccessDenied(NoetlError):
    """The S3 server refused the credentials or the operation (401/403)."""


class CredentialsUnavailable(Unavailable):
    """No link of the credential chain answered (STS, the container credentials endpoint,
    the instance metadata service): transient while running, a configuration error at start."""


@dataclass(frozen=True, slots=True)
class S3Config:
    """``access_key`` and ``secret_key`` empty: the default credential chain (module doc).
    ``ca_file`` empty: ``$SSL_CERT_FILE`` when set (either way, added to the system roots)."""

    endpoint: str
    bucket: str
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    region: str = "us-east-1"
    timeout_sec: float = 30.0
    connect_timeout_sec: float = 5.0
    attempts: int = 3
    ca_file: str = ""

    @property
    def static_keys(self) -> bool:
        return bool(self.access_key and self.secret_key)


class S3Client:
    """Objects of one bucket."""

    def __init__(self, config: S3Config) -> None:
        parts = urlsplit(config.endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"S3 endpoint must be an http(s)://host[:port] URL, got {config.endpoint!r}")
        if bool(config.access_key) != bool(config.secret_key):
            raise ValueError("S3 static credentials need both the access key and the secret key (or neither: "
                             "the default credential chain)")
        self.config = config
        self.bucket = config.bucket
        self._base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        client_options: dict[str, Any] = {
            "allow_http": parts.scheme == "http",
            "timeout": timedelta(seconds=config.timeout_sec),
            "connect_timeout": timedelta(seconds=config.connect_timeout_sec),
            "pool_max_idle_per_host": "16",
        }
        ca_file = config.ca_file or os.environ.get("SSL_CERT_FILE", "")
        if ca_file:
            with open(ca_file, "rb") as f:
                client_options["root_certificate"] = f.read()
        s3: dict[str, Any] = {
            # Set explicitly: obstore also reads AWS_* variables, which must not move the
            # endpoint (AWS_ENDPOINT_URL_S3 would win over `endpoint`), switch addressing or
            # turn signing off.
            "endpoint": self._base, "aws_endpoint_url_s3": self._base, "region": config.region,
            "virtual_hosted_style_request": False, "skip_signature": False,
        }
        if config.static_keys:
            s3.update(access_key_id=config.access_key, secret_access_key=config.secret_key)
        self._store = S3Store(config.bucket, config=s3, client_options=client_options,  # type: ignore[arg-type]
                              retry_config={"max_retries": 0,
                                            "retry_timeout": timedelta(seconds=config.timeout_sec)})
        self._http: httpx.AsyncClient | None = None
        self._ca_file = ca_file

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
        async def put() -> None:
            await obstore.put_async(self._store, key, data, attributes={"Content-Type": content_type},
                                    use_multipart=False)
        await self._request("PUT", key, put)

    async def get_object(self, key: str) -> bytes:
        async def get() -> bytes:
            got = await obstore.get_async(self._store, key)
            return bytes(await got.bytes_async())
        return await self._request("GET", key, get)

    async def head_object(self, key: str) -> int:
        """The object's size in bytes; NotFound when there is none."""
        async def head() -> int:
            return int((await obstore.head_async(self._store, key))["size"])
        return await self._request("HEAD", key, head)

    # ------------------------------------------------------------ bucket

    async def head_bucket(self) -> None:
        """NotFound when the bucket does not exist, AccessDenied when the keys are refused."""
        await self._bucket("HEAD")

    async def create_bucket(self) -> None:
        """Create the bucket (already owning it is fine)."""
        try:
            await self._bucket("PUT")
        except NoetlError as exc:
            if "BucketAlreadyOwnedByYou" not in str(exc) and "BucketAlreadyExists" not in str(exc):
                raise

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        # Let obstore's runtime threads leave their last call_soon_threadsafe (module doc).
        await asyncio.sleep(SETTLE_SEC)

    # ------------------------------------------------------------ transport

    async def _request(self, method: str, key: str, call: Any) -> Any:
        what = f"{method} s3://{self.bucket}/{key}"

        async def once() -> Any:
            try:
                return await call()
            except Exception as exc:
                if isinstance(exc, NoetlError):
                    raise
                _raise(_translate(exc, what, self._base), exc)

        return await self._retrying(what, once)

    async def _bucket(self, method: Literal["HEAD", "PUT"]) -> None:
        what = f"{method} s3://{self.bucket}"

        async def once() -> None:
            try:
                url = await obstore.sign_async(self._store, method, "", timedelta(seconds=PRESIGN_SEC))
            except Exception as exc:  # credentials could not be had (the default chain found none)
                _raise(_translate(exc, what, self._base), exc)
            try:
                resp = await self._client().request(method, url)
            except httpx.TimeoutException as exc:
                raise Unavailable(f"{what}: the S3 server did not answer in time ({type(exc).__name__})") from exc
            except httpx.TransportError as exc:
                if s3_transient(exc):
                    raise Unavailable(f"{what}: cannot reach the S3 server at {self._base}: {exc}") from exc
                raise NoetlError(f"{what}: {type(exc).__name__}: {exc}") from exc
            if resp.status_code >= 300:
                raise _status_error(resp.status_code, resp.text, what)

        await self._retrying(what, once)

    async def _retrying(self, what: str, once: Any) -> Any:
        """``once`` again on Unavailable, at most ``attempts`` times, capped jittered backoff."""
        return await retry_transient(what, once, deadline_sec=None, attempts=self.config.attempts,
                                     initial=BACKOFF_START_SEC, cap=BACKOFF_CAP_SEC)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            timeout = httpx.Timeout(self.config.timeout_sec, connect=self.config.connect_timeout_sec)
            verify: Any = True
            if self._ca_file:
                import ssl
                verify = ssl.create_default_context()
                verify.load_verify_locations(self._ca_file)
            self._http = httpx.AsyncClient(timeout=timeout, verify=verify, follow_redirects=False)
        return self._http


def _status_error(status: int, body: str, what: str) -> NoetlError:
    match = _CODE.search(body or "")
    code = match.group(1) if match else ""
    message = f"{what}: {code} (HTTP {status})" if code else f"{what}: HTTP {status}"
    if status == 404:
        return NotFound(message)
    if status in (401, 403):
        return AccessDenied(message)
    if s3_status_transient(status):
        return Unavailable(message)
    return NoetlError(message)


def _translate(exc: BaseException, what: str, endpoint: str) -> NoetlError:
    """An obstore failure as the store's errors. obstore raises FileNotFoundError (404),
    PermissionDeniedError (403), UnauthenticatedError (401) and GenericError for the
    rest; the HTTP status, the S3 error code or the transport failure's kind are in its
    message (``obstore_failure`` reads them)."""
    status, kind = obstore_failure(exc)
    text = str(exc)
    if isinstance(exc, FileNotFoundError) and status is None:
        status = 404
    name = type(exc).__name__
    if name == "PermissionDeniedError" and status is None:
        status = 403
    if name == "UnauthenticatedError" and status is None:
        status = 401
    # A request to somewhere else than the endpoint is the credential chain's (STS, the
    # instance metadata service, the container credentials endpoint).
    target = _TARGET.search(text)
    server = f"the S3 server at {endpoint}"
    unavailable: type[Unavailable] = Unavailable
    if target and not target.group(1).startswith(endpoint + "/"):
        what, server = f"{what}: getting credentials", target.group(1).split("?", 1)[0]
        unavailable = CredentialsUnavailable
    if status is not None:
        return _status_error(status, text, what)
    if kind == "Timeout":
        return unavailable(f"{what}: {server} did not answer in time")
    if kind is not None and s3_transient(exc):
        return unavailable(f"{what}: cannot reach {server}: {_summary(text)}")
    return NoetlError(f"{what}: {name}: {_summary(text)}")


def _raise(error: NoetlError, cause: BaseException) -> NoReturn:
    """Raise ``error`` from ``cause`` only when it is an outage: obstore raises a
    FileNotFoundError (an OSError, which ``retry.is_transient`` takes for transient) for a
    404, and a NotFound must not be retried for its cause."""
    if isinstance(error, Unavailable):
        raise error from cause
    raise error from None


def _summary(text: str) -> str:
    """obstore's message without its ``Debug source:`` dump."""
    return text.split("\n\nDebug source:", 1)[0].strip()
