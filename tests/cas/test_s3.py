"""S3Store specifics against the real S3 server: the one door (retries, translation,
give-up), the checksum settings, and loop handling. Faults are injected by wrapping
the real aiobotocore client below the door."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from urllib.parse import urlsplit

import boto3
import pytest
from botocore import exceptions as bx
from botocore.config import Config

from cas.chunks import ChunkStore
from cas.errors import ObjectMissing, StoreRejected, StoreUnavailable
from cas.s3 import S3Config, S3Store
from tests.proxy import proxy

pytestmark = pytest.mark.s3


class FlakyClient:
    """Proxies the real client; `method` raises `make_error()` on its first `failures` calls."""

    def __init__(self, real, method: str, failures: int, make_error) -> None:
        self.real, self.method, self.failures, self.make_error = real, method, failures, make_error
        self.calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self.real, name)
        if name != self.method:
            return attr

        async def call(**kwargs):
            self.calls += 1
            if self.calls <= self.failures:
                raise self.make_error()
            return await attr(**kwargs)

        return call


def flaky_store(config: S3Config, method: str, failures: int, make_error, **overrides):
    holder: dict[str, FlakyClient] = {}

    def wrap(real):
        holder["client"] = FlakyClient(real, method, failures, make_error)
        return holder["client"]

    store = S3Store(dataclasses.replace(config, **overrides), wrap_client=wrap)
    return store, holder


def connection_error():
    return bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")


def client_error(code: str, status: int):
    return bx.ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def test_transient_failure_once_is_retried(s3_config, aio):
    """A connection error on the first put is retried by the door; the put succeeds once."""
    store, held = flaky_store(s3_config, "put_object", 1, connection_error)
    try:
        assert aio.run(store.put_if_absent("r/1", b"data")) is True
        assert held["client"].calls == 2
        assert aio.run(store.get("r/1")) == b"data"
    finally:
        aio.run(store.aclose())


@pytest.mark.parametrize("code, status", [("SlowDown", 503), ("InternalError", 500)])
def test_retryable_server_errors_are_retried(s3_config, aio, code, status):
    """5xx / SlowDown answers are retried like transport errors."""
    store, held = flaky_store(s3_config, "get_object_bytes", 2, lambda: client_error(code, status))
    try:
        aio.run(store.put_if_absent("r/2", b"abc"))
        assert aio.run(store.get("r/2")) == b"abc"
        assert held["client"].calls == 3
    finally:
        aio.run(store.aclose())


def test_conditional_conflict_is_retried_until_the_answer_is_known(s3_config, aio):
    """409 ConditionalRequestConflict (a concurrent conditional write in flight) is retried;
    the retry then sees the object (412) and reports "existed", not a guess."""
    seed = S3Store(s3_config)
    aio.run(seed.put_if_absent("c/1", b"first"))
    aio.run(seed.aclose())
    store, held = flaky_store(
        s3_config, "put_object", 1, lambda: client_error("ConditionalRequestConflict", 409)
    )
    try:
        assert aio.run(store.put_if_absent("c/1", b"second")) is False
        assert held["client"].calls == 2
    finally:
        aio.run(store.aclose())


def test_always_failing_gives_store_unavailable(s3_config, aio):
    """Failing every attempt: exactly max_attempts tries, then StoreUnavailable from the cause."""
    store, held = flaky_store(s3_config, "get_object_bytes", 99, connection_error, max_attempts=3)
    try:
        with pytest.raises(StoreUnavailable) as e:
            aio.run(store.get("x/1"))
        assert held["client"].calls == 3
        assert isinstance(e.value.__cause__, bx.EndpointConnectionError)
        assert (e.value.op, e.value.key) == ("get", "x/1")
        assert not isinstance(e.value, StoreRejected)
    finally:
        aio.run(store.aclose())


def test_an_open_breaker_fails_calls_at_once_until_a_probe_is_answered(s3_config, aio):
    """Outage memory: threshold failed attempts open the door's breaker; while it is open
    every call fails with StoreUnavailable without reaching the client (no retry schedule),
    a verdict (404) counts as an answer, and after the window one probe goes through and
    its success closes the breaker."""
    store, held = flaky_store(
        s3_config, "get_object_bytes", 4, connection_error, max_attempts=5, breaker_threshold=2,
        breaker_backoff_s=0.3,
    )  # fmt: skip
    try:
        aio.run(store.put_if_absent("b/1", b"v"))
        with pytest.raises(StoreUnavailable, match="circuit open"):
            aio.run(store.get("b/1"))  # two attempts fail, the third is refused
        assert held["client"].calls == 2 and store.breaker.state().state == "open"
        for _ in range(5):
            with pytest.raises(StoreUnavailable, match="circuit open"):
                aio.run(store.get("b/1"))
        assert held["client"].calls == 2 and store.breaker.state().skipped == 6
        aio.run(asyncio.sleep(0.35))
        with pytest.raises(StoreUnavailable, match="circuit open"):
            aio.run(store.get("b/1"))  # the probe fails: open again, for twice as long
        assert held["client"].calls == 3 and store.breaker.state().retry_in_s > 0.3
        aio.run(asyncio.sleep(0.65))
        with pytest.raises(StoreUnavailable):
            aio.run(store.get("b/1"))  # the 4th failure; the 5th attempt is refused
        aio.run(asyncio.sleep(1.25))
        assert aio.run(store.get("b/1")) == b"v"  # the probe is answered: closed
        assert store.breaker.state().up and held["client"].calls == 5
        with pytest.raises(ObjectMissing):
            aio.run(store.get("b/none"))
        assert store.breaker.state().failures == 0
    finally:
        aio.run(store.aclose())


def test_a_probe_whose_caller_stops_waiting_still_closes_the_breaker(s3_config, aio):
    """The probe runs on when its caller is cancelled (a restore whose sibling chunk read
    was refused cancels it) and its answer closes the breaker; before, such a probe never
    reported, and calls in pairs kept the breaker open."""
    store, held = flaky_store(
        s3_config, "get_object_bytes", 1, connection_error, max_attempts=1, breaker_threshold=1,
        breaker_backoff_s=0.2,
    )  # fmt: skip

    async def cancelled_probe() -> None:
        probe = asyncio.ensure_future(store.get("p/1"))
        await asyncio.sleep(0)  # the probe has been admitted and sent
        with pytest.raises(StoreUnavailable, match="circuit open"):
            await store.get("p/1")  # a sibling, refused while the probe is out
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        for _ in range(200):  # the probe's answer arrives after its caller left
            if store.breaker.state().up:
                return
            await asyncio.sleep(0.01)

    try:
        aio.run(store.put_if_absent("p/1", b"v"))
        with pytest.raises(StoreUnavailable):
            aio.run(store.get("p/1"))  # the one failure: open
        assert store.breaker.state().state == "open"
        aio.run(asyncio.sleep(0.25))
        aio.run(cancelled_probe())
        assert store.breaker.state().up and held["client"].calls == 2
        assert aio.run(store.get("p/1")) == b"v"
    finally:
        aio.run(store.aclose())


@pytest.mark.parametrize("direct", [True, False])
def test_a_whole_object_is_read_directly_unless_the_direct_get_is_off(s3_config, aio, direct):
    """get (a manifest's read) takes the direct GET where it is on: no GET goes through
    aiobotocore's sender; with it off, the one GET does. The bytes are the same."""
    store = S3Store(dataclasses.replace(s3_config, direct_get=direct))
    sent: list[str] = []

    async def read() -> bytes:
        client = await store.client()
        client.meta.events.register(
            "before-send.s3", lambda request, **_: sent.append(request.method)
        )
        await store.put_if_absent("whole/1", b"manifest" * 10_000)
        sent.clear()
        return await store.get("whole/1")

    try:
        assert aio.run(read()) == b"manifest" * 10_000
        assert sent.count("GET") == (0 if direct else 1)
    finally:
        aio.run(store.aclose())


def test_outage_is_not_a_missing_chunk(s3_config, keyring, aio):
    """ChunkStore over a failing S3 raises StoreUnavailable, never ChunkMissing (an outage
    is not a verdict on the chunk)."""
    ok = S3Store(s3_config)
    ref = aio.run(ChunkStore(ok, keyring).put(b"payload" * 10))
    aio.run(ok.aclose())
    store, _ = flaky_store(s3_config, "get_object_into", 99, connection_error, max_attempts=2)
    try:
        with pytest.raises(StoreUnavailable):
            aio.run(ChunkStore(store, keyring).get_many([ref]))
    finally:
        aio.run(store.aclose())


def test_unreachable_endpoint_gives_store_unavailable(s3_config, aio):
    """A real closed port: connection refused on every attempt -> StoreUnavailable."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = dataclasses.replace(
        s3_config, endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2, connect_timeout_s=1
    )
    store = S3Store(cfg)
    try:
        with pytest.raises(StoreUnavailable):
            aio.run(store.put_if_absent("k", b"v"))
    finally:
        aio.run(store.aclose())


def test_refusals_are_not_retried(s3_config, aio):
    """Wrong credentials and a missing bucket are verdicts: StoreRejected at once, with the code."""
    bad_creds = S3Store(dataclasses.replace(s3_config, secret_key="wrong"))
    no_bucket = S3Store(dataclasses.replace(s3_config, bucket="kvpack-no-such-bucket"))
    try:
        for call in (bad_creds.get("k"), bad_creds.get_into("k", memoryview(bytearray(8)))):
            with pytest.raises(StoreRejected) as e:
                aio.run(call)
            assert e.value.code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied")
        assert isinstance(e.value.__cause__, bx.ClientError)  # the direct GET's, translated
        no_bucket_calls = (
            no_bucket.get("k"),
            no_bucket.get_into("k", memoryview(bytearray(8))),
            no_bucket.put_if_absent("k", b"v"),
        )
        for call in no_bucket_calls:
            with pytest.raises(StoreRejected) as e:
                aio.run(call)
            assert e.value.code == "NoSuchBucket"
    finally:
        aio.run(bad_creds.aclose())
        aio.run(no_bucket.aclose())


def test_truncated_stream_is_retried(s3_config, aio):
    """A body that ends early (IncompleteRead) on the first attempt is fetched again whole."""
    store, held = flaky_store(
        s3_config,
        "get_object_into",
        1,
        lambda: bx.IncompleteReadError(actual_bytes=1, expected_bytes=4),
    )
    try:
        aio.run(store.put_if_absent("t/1", b"full"))
        out = bytearray(4)
        assert aio.run(store.get_into("t/1", memoryview(out))) == 4 and out == b"full"
    finally:
        aio.run(store.aclose())


def _checksum_headers(headers) -> set[str]:
    return {k.lower() for k in headers if "checksum" in k.lower() or k.lower() == "x-amz-trailer"}


def test_checksum_settings_reach_the_wire(s3_config, s3_server, aio):
    """botocore's default adds CRC32 request checksums and asks for response checksums;
    S3Store's "when_required" sends neither, and still works against the server."""
    seen: list[tuple[str, set[str]]] = []

    def record(request, **_):
        seen.append((request.method, _checksum_headers(request.headers)))

    default = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )
    default.meta.events.register("before-send.s3", record)
    key = s3_config.key_prefix + "default/1"
    default.put_object(Bucket=s3_config.bucket, Key=key, Body=b"hello")
    default.get_object(Bucket=s3_config.bucket, Key=key)["Body"].read()
    default.close()
    assert seen[0][0] == "PUT" and "x-amz-sdk-checksum-algorithm" in seen[0][1]
    assert seen[1][0] == "GET" and "x-amz-checksum-mode" in seen[1][1]

    seen.clear()
    store = S3Store(dataclasses.replace(s3_config, direct_get=False))  # every GET via botocore

    async def ours():
        (await store.client()).meta.events.register("before-send.s3", record)
        assert await store.put_if_absent("ours/1", b"hello")
        assert await store.get("ours/1") == b"hello"
        await store.aclose()

    aio.run(ours())
    assert [m for m, _ in seen] == ["PUT", "GET"]
    assert all(h == set() for _, h in seen)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_store_survives_a_new_event_loop(s3_config):
    """Successive asyncio.run calls: the client of the ended loop is dropped (it cannot be
    closed from another loop, hence the filtered warning), a new one made."""
    store = S3Store(s3_config)
    asyncio.run(store.put_if_absent("l/1", b"one"))

    async def second():
        try:
            return await store.get("l/1")
        finally:
            await store.aclose()

    assert asyncio.run(second()) == b"one"


def test_missing_key_translates_once(s3_config, aio):
    """NoSuchKey (GET) and a bare 404 (HEAD) both become ObjectMissing with the caller's key."""
    store = S3Store(s3_config)
    try:
        for call in (store.get("m/1"), store.stat("m/1")):
            with pytest.raises(ObjectMissing) as e:
                aio.run(call)
            assert e.value.key == "m/1"
            assert isinstance(e.value.__cause__, bx.ClientError)
    finally:
        aio.run(store.aclose())


def test_a_cut_connection_costs_the_direct_read_no_attempt(s3_config, aio):
    """The direct GET's kept connection is cut between two reads (through a TCP proxy): the
    second read goes out again on a new connection inside the same attempt, so the door
    sees no failure. Then a proxy that stops forwarding: the read times out and the door
    retries, and it comes back once the path heals."""
    endpoint = urlsplit(s3_config.endpoint_url)
    with proxy(endpoint.hostname, endpoint.port) as path:
        config = dataclasses.replace(
            s3_config, endpoint_url=f"http://127.0.0.1:{path.port}", read_timeout_s=0.5
        )
        store = S3Store(config)
        try:
            aio.run(store.put_if_absent("cut/1", b"payload"))
            out = bytearray(16)
            assert aio.run(store.get_into("cut/1", memoryview(out))) == 7
            before = path.connections
            path.heal()  # cuts every open connection, then forwards again
            assert aio.run(store.get_into("cut/1", memoryview(out))) == 7
            assert out[:7] == b"payload" and path.connections == before + 1
            assert store.breaker.state().failures == 0
            path.stall()
            threading.Timer(0.8, path.heal).start()
            assert aio.run(store.get_into("cut/1", memoryview(out))) == 7
        finally:
            aio.run(store.aclose())
