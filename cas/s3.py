"""S3Store: objects in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS, Ceph RGW).

- data path: aiobotocore, one lazily created client per event loop, at most
  `max_concurrency` requests in flight (a semaphore; the memory cost of a
  caller's batch is max_concurrency × object size). get_into, the chunk reader's
  call, sends a GET the client presigned on a plain connection that reads the body
  straight into the caller's buffer (cas/s3_get.py), unless a proxy is set for the
  endpoint or `direct_get` is off; get (a manifest's read) takes the same path into a
  buffer of the body's size, so it leaves the loop free for the chunks' reads.
- administration (ensure_bucket): boto3, synchronous, off the data path.
- one door: every data-path call goes through S3Store._call, which owns
  retries (a tuple of retryable errors, capped exponential backoff with
  jitter) and logs without bodies.
- outage memory: the door's circuit breaker (cas/breaker.py) counts attempts
  the store could not answer; once it opens, every call (and every remaining
  retry of a call in flight) fails at once with StoreUnavailable until a probe
  after the backoff window gets an answer. An outage then costs a caller
  nothing, not a retry schedule per call.
- one table: `translate` reads every S3 error response (the door's and
  ensure_bucket's alike) with `raise ... from e`: NoSuchKey/404 ->
  ObjectMissing, 412 on put-if-absent -> "existed", refusals (403,
  NoSuchBucket, 400) -> StoreRejected, 5xx/429/throttling -> another attempt,
  and anything still failing after the last attempt -> StoreUnavailable.
  Messages carry the server's request id. botocore's own retries are off so
  that exactly one layer retries.

Checksums: botocore >= 1.36 adds CRC32 request checksums (aws-chunked bodies
with trailers) and validates response checksums by default. Many
S3-compatible servers reject or mangle those bodies, and every chunk is
already sealed and digest-checked by cas.seal, so both are set to
"when_required" (tests/cas/test_s3.py shows what the default would send).
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import random
import ssl
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import UTC
from functools import partial
from typing import Any, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore import exceptions as bx
from botocore.config import Config

from cas.breaker import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_BACKOFF_S,
    DEFAULT_THRESHOLD,
    Admission,
    Breaker,
)
from cas.buffers import Landed
from cas.errors import ObjectMissing, ObjectTooLarge, StoreRejected, StoreUnavailable
from cas.s3_get import DirectGet
from cas.store import ObjectInfo

log = logging.getLogger("cas.s3")
T = TypeVar("T")

# Transport failures worth another attempt; anything else is a verdict.
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    bx.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ...
    bx.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    bx.IncompleteReadError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
    # the direct GET's (cas/s3_get.py)
    http.client.HTTPException,
    TimeoutError,
    ssl.SSLError,
)
RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        # A concurrent conditional write is still in flight: the next attempt
        # answers 412 (existed) or 200 (created), never a guess.
        "ConditionalRequestConflict",
    }
)
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
EXISTED_CODES = frozenset({"PreconditionFailed", "412"})
OWNED_CODES = frozenset({"BucketAlreadyOwnedByYou"})
PRESIGN_S = 300  # a presigned GET is sent at once; this only bounds a leaked URL


@dataclass(frozen=True)
class S3Config:
    """Where the bucket is and how hard to try. Frozen: pass it, don't mutate globals."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = None
    max_concurrency: int = 8
    max_attempts: int = 5
    backoff_s: float = 0.1  # first retry delay; doubles per attempt
    max_backoff_s: float = 2.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    breaker_threshold: int = DEFAULT_THRESHOLD  # failed attempts in a row that open it
    breaker_backoff_s: float = DEFAULT_BACKOFF_S  # the first window; doubles per failed probe
    breaker_max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    direct_get: bool = True  # chunk reads straight into their buffers (cas/s3_get.py)

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise ValueError(f"S3Config.bucket must be a bucket name, got {self.bucket!r}")
        if self.prefix.startswith("/"):
            raise ValueError(f"S3Config.prefix must not start with '/', got {self.prefix!r}")
        if self.max_concurrency < 1:
            raise ValueError(f"S3Config.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_attempts < 1:
            raise ValueError(f"S3Config.max_attempts must be >= 1, got {self.max_attempts}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("S3Config needs both access_key and secret_key, or neither")

    @property
    def key_prefix(self) -> str:
        """The prefix as it is glued to keys: "" or ending in one "/"."""
        p = self.prefix.strip("/")
        return f"{p}/" if p else ""

    @classmethod
    def from_env(cls, bucket: str, prefix: str = "", **overrides: Any) -> S3Config:
        """Endpoint and credentials from AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / ..."""
        env = {
            "endpoint_url": os.environ.get("AWS_ENDPOINT_URL") or None,
            "access_key": os.environ.get("AWS_ACCESS_KEY_ID") or None,
            "secret_key": os.environ.get("AWS_SECRET_ACCESS_KEY") or None,
            "region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
        }
        env = {k: v for k, v in env.items() if v is not None}
        return cls(bucket=bucket, prefix=prefix, **{**env, **overrides})

    def client_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"region_name": self.region}
        if self.endpoint_url:
            kw["endpoint_url"] = self.endpoint_url
        if self.access_key is not None:
            kw["aws_access_key_id"] = self.access_key
            kw["aws_secret_access_key"] = self.secret_key
        return kw

    def reads_direct(self) -> bool:
        """Whether get_into reads through cas/s3_get.py: asked for, and no proxy in the
        environment for the endpoint (botocore honours one; the direct GET does not)."""
        if not self.direct_get:
            return False
        url = urllib.parse.urlsplit(self.endpoint_url or "https://s3.amazonaws.com")
        if url.scheme not in urllib.request.getproxies_environment():
            return True
        return bool(urllib.request.proxy_bypass(url.hostname or ""))

    def botocore_options(self) -> dict[str, Any]:
        return {
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # the door retries
            "connect_timeout": self.connect_timeout_s,
            "read_timeout": self.read_timeout_s,
            "max_pool_connections": self.max_concurrency,
            "s3": {"addressing_style": "path" if self.endpoint_url else "auto"},
        }


def boto3_client(config: S3Config) -> Any:  # boto3 ships no types
    """A synchronous boto3 client for administration (and the raw baseline in bench-store)."""
    import boto3

    return boto3.client("s3", config=Config(**config.botocore_options()), **config.client_kwargs())


def ensure_bucket(config: S3Config) -> None:
    """Create the bucket if it does not exist (boto3; administration, not the data path)."""
    client = boto3_client(config)
    try:
        try:
            client.head_bucket(Bucket=config.bucket)
            return
        except bx.ClientError as e:
            if not isinstance(translate("ensure_bucket", config.bucket, e), ObjectMissing):
                raise _verdict("ensure_bucket", config.bucket, e) from e
        kw: dict[str, Any] = {"Bucket": config.bucket}
        if config.region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": config.region}
        try:
            client.create_bucket(**kw)
        except bx.ClientError as e:
            if _code(e) not in OWNED_CODES:
                raise _verdict("ensure_bucket", config.bucket, e) from e
    except RETRYABLE_ERRORS as e:
        raise StoreUnavailable("ensure_bucket", config.bucket, _describe(e)) from e
    finally:
        client.close()


def translate(op: str, key: str, e: bx.ClientError) -> BaseException | None:
    """The one table from an S3 error response to what it means here: a typed error, or
    None when the request is worth another attempt. Every caller goes through it."""
    code, status = _code(e), _status(e)
    if code == "NoSuchBucket":
        return StoreRejected(op, key, code, _message(e))
    if code in MISSING_CODES or status == 404:
        return ObjectMissing(key)
    if code in EXISTED_CODES or status == 412:
        return _Existed()
    if code in RETRYABLE_CODES or status >= 500 or status == 429:
        return None
    return StoreRejected(op, key, code, _message(e))


def _verdict(op: str, key: str, e: bx.ClientError) -> BaseException:
    """translate(), with a retryable error read as an outage (for callers that do not
    retry, like ensure_bucket)."""
    return translate(op, key, e) or StoreUnavailable(op, key, _describe(e))


class _Existed(Exception):
    """Internal: a conditional put found the key taken (412)."""


@dataclass
class _Connection:
    loop: asyncio.AbstractEventLoop
    client: Any
    stack: AsyncExitStack
    slots: asyncio.Semaphore


class _Client:
    """The aiobotocore client, with one call of ours beside its own: get_object_into, a
    GET whose body lands straight in the caller's buffer. Tests wrap this object."""

    def __init__(self, client: Any, direct: DirectGet | None) -> None:
        self._client, self._direct = client, direct

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    # botocore's argument style, so that a test's wrapper treats it like get_object
    async def get_object_into(
        self, *, Bucket: str, Key: str, Out: memoryview, Landed: Landed | None = None
    ) -> int:
        if self._direct is None:  # `Landed` is not called: the bytes land on the loop's thread
            return await self._through_client(Bucket, Key, Out)
        url = await self._presigned(Bucket, Key)
        return await asyncio.to_thread(self._direct.get_into, url, Key, Out, Landed)

    async def get_object_bytes(self, *, Bucket: str, Key: str) -> bytes:
        """A whole object's body: by the direct GET where it is on (off the loop, on the
        connections it keeps for the chunks' reads), else through the client."""
        if self._direct is None:
            resp = await self._client.get_object(Bucket=Bucket, Key=Key)
            async with resp["Body"] as body:
                data: bytes = await body.read()
                return data
        url = await self._presigned(Bucket, Key)
        return await asyncio.to_thread(self._direct.get, url)

    async def _presigned(self, bucket: str, key: str) -> str:
        params = {"Bucket": bucket, "Key": key}
        url: str = await self._client.generate_presigned_url(
            "get_object", Params=params, ExpiresIn=PRESIGN_S
        )
        return url

    async def _through_client(self, bucket: str, key: str, out: memoryview) -> int:
        resp = await self._client.get_object(Bucket=bucket, Key=key)
        async with resp["Body"] as body:
            size = resp["ContentLength"]
            if size > len(out):
                raise ObjectTooLarge(key, size, len(out))
            n = 0
            while n < size:  # stream straight into the caller's area
                got = await body.readinto(out[n:size])
                if not got:
                    raise bx.IncompleteReadError(actual_bytes=n, expected_bytes=size)
                n += got
            return n


class S3Store:
    """ObjectStore on an S3 bucket. `wrap_client` lets tests put a fault injector around
    the real aiobotocore client (restic-style wrappers), below the retrying door."""

    remote = True
    # get_into reports the bytes as they land, so that chunks open behind the direct GET
    # (cas/trail.py); through the aiobotocore client it does not, and they open after.
    lands = True

    def __init__(self, config: S3Config, *, wrap_client: Callable[[Any], Any] | None = None):
        self.config = config
        self._prefix = config.key_prefix
        self._wrap = wrap_client
        self._conn: _Connection | None = None
        self.breaker = Breaker(
            f"s3://{config.bucket}/{self._prefix}",
            threshold=config.breaker_threshold,
            backoff_s=config.breaker_backoff_s,
            max_backoff_s=max(config.breaker_backoff_s, config.breaker_max_backoff_s),
        )
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        c = self.config
        return f"S3Store(s3://{c.bucket}/{self._prefix} at {c.endpoint_url or 'aws'})"

    def ensure_bucket(self) -> None:
        ensure_bucket(self.config)

    # -- the client: created lazily under a lock, one per event loop ---------------

    async def _connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None and conn.loop is loop:
            return conn
        if self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        assert self._lock is not None
        async with self._lock:
            conn = self._conn
            if conn is not None and conn.loop is loop:
                return conn
            if conn is not None and not conn.loop.is_closed():
                raise RuntimeError(f"{self!r} is in use on another running event loop")
            # A previous loop has ended (e.g. successive asyncio.run calls): start afresh.
            stack = AsyncExitStack()
            session = get_session()
            client = await stack.enter_async_context(
                session.create_client(
                    "s3",
                    config=AioConfig(**self.config.botocore_options()),
                    **self.config.client_kwargs(),
                )
            )
            direct = None
            if self.config.reads_direct():
                direct = DirectGet(
                    connect_timeout_s=self.config.connect_timeout_s,
                    read_timeout_s=self.config.read_timeout_s,
                    keep=self.config.max_concurrency,
                    ca_bundle=os.environ.get("AWS_CA_BUNDLE"),
                )
                stack.callback(direct.close)
            client = _Client(client, direct)
            if self._wrap is not None:
                client = self._wrap(client)
            self._conn = _Connection(
                loop, client, stack, asyncio.Semaphore(self.config.max_concurrency)
            )
            return self._conn

    async def client(self) -> Any:
        """The aiobotocore client of the running loop (for event hooks in tests)."""
        return (await self._connection()).client

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.loop is asyncio.get_running_loop():
            await conn.stack.aclose()

    # -- the door ---------------------------------------------------------------------

    async def _call(self, op: str, key: str, request: Callable[[Any], Awaitable[T]]) -> T:
        cfg = self.config
        last: BaseException | None = None
        for attempt in range(1, cfg.max_attempts + 1):
            admission = self.breaker.admit()
            if admission is Admission.REFUSED:
                state = self.breaker.state()
                cause = (
                    f"circuit open after {state.failures} failed attempts; next probe in "
                    f"{state.retry_in_s:.1f}s"
                )
                raise StoreUnavailable(op, key, cause) from last
            conn = await self._connection()
            sent = asyncio.ensure_future(_sent(conn, request))
            sent.add_done_callback(partial(self._answered, op, key))
            try:
                # The probe runs on when its caller stops waiting (cas/breaker.py).
                probe = admission is Admission.PROBE
                result = await (asyncio.shield(sent) if probe else sent)
            except bx.ClientError as e:
                verdict = translate(op, key, e)
                if verdict is not None:
                    raise verdict from e
                last = e
            except RETRYABLE_ERRORS as e:
                last = e
            else:
                return result
            if attempt < cfg.max_attempts:
                delay = min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (attempt - 1))
                delay *= random.uniform(0.5, 1.0)
                log.warning(
                    "s3 %s %s: attempt %d/%d failed (%s); retrying in %.2fs",
                    op, key, attempt, cfg.max_attempts, _describe(last), delay,
                )  # fmt: skip
                await asyncio.sleep(delay)
        log.error("s3 %s %s: giving up after %d attempts", op, key, cfg.max_attempts)
        assert last is not None
        raise StoreUnavailable(op, key, _describe(last)) from last

    def _answered(self, op: str, key: str, sent: asyncio.Future[Any]) -> None:
        """A call's end, told to the breaker before its caller sees it: a transport
        failure is a failure, any other end an answer (a verdict, a body too large, a
        read its reader stopped); a cancelled call tells nothing."""
        if sent.cancelled():
            return
        e = sent.exception()
        failed = isinstance(e, RETRYABLE_ERRORS) or (
            isinstance(e, bx.ClientError) and translate(op, key, e) is None
        )
        if failed:
            self.breaker.failure()
        else:
            self.breaker.success()

    # -- ObjectStore ------------------------------------------------------------------

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"invalid object key {key!r}")
        return self._prefix + key

    async def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        full = self._key(key)
        body = data if isinstance(data, bytes | bytearray) else bytes(data)
        try:
            await self._call(
                "put",
                key,
                lambda c: c.put_object(
                    Bucket=self.config.bucket, Key=full, Body=body, IfNoneMatch="*"
                ),
            )
        except _Existed:
            return False
        return True

    async def get(self, key: str) -> bytes:
        full = self._key(key)

        return await self._call(
            "get", key, lambda c: c.get_object_bytes(Bucket=self.config.bucket, Key=full)
        )

    async def get_into(self, key: str, out: memoryview, landed: Landed | None = None) -> int:
        full = self._key(key)
        try:
            return await self._call(
                "get",
                key,
                lambda c: c.get_object_into(
                    Bucket=self.config.bucket, Key=full, Out=out, Landed=landed
                ),
            )
        except ObjectTooLarge as e:
            raise ObjectTooLarge(key, e.size, e.capacity) from None  # the caller's key

    async def stat(self, key: str) -> ObjectInfo:
        full = self._key(key)
        head = await self._call(
            "stat", key, lambda c: c.head_object(Bucket=self.config.bucket, Key=full)
        )
        return ObjectInfo(head["ContentLength"], head["LastModified"].astimezone(UTC))

    async def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            await self._call(
                "delete", key, lambda c: c.delete_object(Bucket=self.config.bucket, Key=full)
            )
        except ObjectMissing:
            return

    async def list_keys(self, prefix: str) -> list[str]:
        full = self._prefix + prefix
        keys: list[str] = []
        kw: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": full}
        while True:
            page = await self._call("list", prefix, lambda c: c.list_objects_v2(**kw))
            keys.extend(o["Key"][len(self._prefix) :] for o in page.get("Contents", ()))
            if not page.get("IsTruncated"):
                return sorted(keys)
            kw["ContinuationToken"] = page["NextContinuationToken"]


def _code(e: bx.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: bx.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _request_id(e: bx.ClientError) -> str:
    meta = e.response.get("ResponseMetadata", {})
    return str(meta.get("RequestId") or meta.get("HTTPHeaders", {}).get("x-amz-request-id", ""))


def _message(e: bx.ClientError) -> str:
    message = str(e.response.get("Error", {}).get("Message", "")) or str(e)
    request = _request_id(e)
    return f"{message} (request {request})" if request else message


async def _sent(conn: _Connection, request: Callable[[Any], Awaitable[T]]) -> T:
    async with conn.slots:
        return await request(conn.client)


def _describe(e: BaseException | None) -> str:
    if isinstance(e, bx.ClientError):
        request = _request_id(e)
        return f"{_code(e)} (HTTP {_status(e)}{f', request {request}' if request else ''})"
    return f"{type(e).__name__}: {e}"
