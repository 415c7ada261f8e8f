"""AWS Signature Version 4 for S3 requests (header authentication), standard library only.

    canonical request = METHOD \\n canonical URI \\n canonical query \\n
                        canonical headers \\n signed headers \\n payload sha256
    string to sign    = "AWS4-HMAC-SHA256" \\n amz-date \\n scope \\n sha256(canonical request)
    signing key       = HMAC chain "AWS4"+secret -> date -> region -> service -> "aws4_request"
    Authorization     = AWS4-HMAC-SHA256 Credential=<key>/<scope>, SignedHeaders=..., Signature=...

S3 flavour: the URI path is encoded once (``/`` kept), the payload hash travels in
``x-amz-content-sha256`` and is signed (so the server verifies the body). Pinned by the
examples of the AWS S3 SigV4 documentation (tests/unit/test_s3_sigv4.py).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from datetime import UTC, datetime
from urllib.parse import quote

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode("utf-8"), hashlib.sha256).digest()


def uri_encode(text: str, *, keep_slash: bool) -> str:
    """RFC 3986 encoding as SigV4 wants it: unreserved characters kept, everything else
    %XX (upper case); ``/`` kept in paths."""
    return quote(text, safe="-_.~/" if keep_slash else "-_.~")


def canonical_query(query: Mapping[str, str]) -> str:
    pairs = sorted((uri_encode(k, keep_slash=False), uri_encode(v, keep_slash=False)) for k, v in query.items())
    return "&".join(f"{k}={v}" for k, v in pairs)


def signing_key(secret_key: str, day: str, region: str, service: str) -> bytes:
    key = _hmac(("AWS4" + secret_key).encode("utf-8"), day)
    key = _hmac(key, region)
    key = _hmac(key, service)
    return _hmac(key, "aws4_request")


def sign(method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str], payload_sha256: str, *,
         access_key: str, secret_key: str, region: str, service: str = "s3",
         now: datetime | None = None) -> dict[str, str]:
    """The headers to add to a request: ``x-amz-date``, ``x-amz-content-sha256`` and
    ``Authorization``. ``path`` is the unencoded absolute path (``/bucket/key``);
    ``headers`` must include ``host``; every header given is signed."""
    at = (now or datetime.now(UTC)).astimezone(UTC)
    amz_date = at.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    all_headers = {k.lower(): " ".join(str(v).split()) for k, v in headers.items()}
    all_headers["x-amz-date"] = amz_date
    all_headers["x-amz-content-sha256"] = payload_sha256
    names = sorted(all_headers)
    canonical_headers = "".join(f"{n}:{all_headers[n]}\n" for n in names)
    signed_headers = ";".join(names)
    canonical_request = "\n".join([
        method.upper(), uri_encode(path or "/", keep_slash=True), canonical_query(query),
        canonical_headers, signed_headers, payload_sha256,
    ])
    scope = f"{day}/{region}/{service}/aws4_request"
    string_to_sign = "\n".join([
        ALGORITHM, amz_date, scope, hashlib.sha256(canonical_request.encode("utf-8")).hexdigest(),
    ])
    signature = hmac.new(signing_key(secret_key, day, region, service), string_to_sign.encode("utf-8"),
                         hashlib.sha256).hexdigest()
    return {
        "x-amz-date": amz_date,
        "x-amz-content-sha256": payload_sha256,
        "Authorization": (f"{ALGORITHM} Credential={access_key}/{scope}, SignedHeaders={signed_headers}, "
                          f"Signature={signature}"),
    }
