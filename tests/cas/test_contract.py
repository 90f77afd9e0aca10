"""The ObjectStore contract: the same tests against every backend (local directory, S3)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from cas.errors import ObjectMissing, ObjectTooLarge
from cas.store import ObjectStore


def test_is_an_object_store(object_store):
    """Both backends satisfy the ObjectStore protocol (runtime_checkable)."""
    assert isinstance(object_store, ObjectStore)


def test_put_get_roundtrip(object_store, aio):
    """put_if_absent on a new key creates it; get and get_into return the same bytes."""
    data = bytes(range(256)) * 40 + b"tail"
    assert aio.run(object_store.put_if_absent("chunks/ab/abc", data)) is True
    assert aio.run(object_store.get("chunks/ab/abc")) == data
    out = bytearray(len(data) + 100)
    n = aio.run(object_store.get_into("chunks/ab/abc", memoryview(out)))
    assert n == len(data) and bytes(out[:n]) == data


def test_put_accepts_memoryview(object_store, aio):
    """A memoryview body is stored as its bytes (the chunk store passes views)."""
    buf = memoryview(b"0123456789")[2:7]
    assert aio.run(object_store.put_if_absent("m/v", buf)) is True
    assert aio.run(object_store.get("m/v")) == b"23456"


def test_put_if_absent_never_overwrites(object_store, aio):
    """A second put on an existing key returns False and leaves the first bytes in place."""
    assert aio.run(object_store.put_if_absent("k/1", b"first")) is True
    assert aio.run(object_store.put_if_absent("k/1", b"second")) is False
    assert aio.run(object_store.get("k/1")) == b"first"


def test_concurrent_put_if_absent_has_one_winner(object_store, aio):
    """8 concurrent writers of different bytes: exactly one creates, and its bytes are stored."""

    async def race():
        bodies = [f"writer-{i}".encode() * 1000 for i in range(8)]
        created = await asyncio.gather(*(object_store.put_if_absent("race/x", b) for b in bodies))
        return bodies, created

    bodies, created = aio.run(race())
    assert created.count(True) == 1
    assert aio.run(object_store.get("race/x")) == bodies[created.index(True)]


def test_missing_key_raises_object_missing(object_store, aio):
    """get, get_into and stat of an absent key raise ObjectMissing carrying the key."""
    for call in (
        object_store.get("no/such"),
        object_store.get_into("no/such", memoryview(bytearray(8))),
        object_store.stat("no/such"),
    ):
        with pytest.raises(ObjectMissing) as e:
            aio.run(call)
        assert e.value.key == "no/such"


def test_get_into_refuses_an_object_larger_than_the_buffer(object_store, aio):
    """get_into never writes past its buffer: ObjectTooLarge names size and capacity."""
    aio.run(object_store.put_if_absent("big/1", b"x" * 100))
    with pytest.raises(ObjectTooLarge) as e:
        aio.run(object_store.get_into("big/1", memoryview(bytearray(99))))
    assert (e.value.size, e.value.capacity) == (100, 99)


def test_delete_is_idempotent(object_store, aio):
    """delete removes the object; deleting it again (or a never-stored key) is fine."""
    aio.run(object_store.put_if_absent("d/1", b"x"))
    aio.run(object_store.delete("d/1"))
    aio.run(object_store.delete("d/1"))
    aio.run(object_store.delete("d/never"))
    with pytest.raises(ObjectMissing):
        aio.run(object_store.get("d/1"))
    assert aio.run(object_store.put_if_absent("d/1", b"again")) is True


def test_list_keys_by_prefix(object_store, aio):
    """list_keys returns exactly the keys under a prefix, sorted, including partial names."""
    keys = ["chunks/aa/aa1", "chunks/aa/aa2", "chunks/ab/ab1", "manifests/i/m1"]
    for k in reversed(keys):
        aio.run(object_store.put_if_absent(k, k.encode()))
    assert aio.run(object_store.list_keys("chunks/")) == keys[:3]
    assert aio.run(object_store.list_keys("chunks/aa/")) == keys[:2]
    assert aio.run(object_store.list_keys("chunks/a")) == keys[:3]
    assert aio.run(object_store.list_keys("manifests/i/m")) == keys[3:]
    assert aio.run(object_store.list_keys("")) == keys
    assert aio.run(object_store.list_keys("nothing/")) == []


def test_stat_reports_size_and_recent_utc_time(object_store, aio):
    """stat gives the stored size and a UTC modification time close to now."""
    aio.run(object_store.put_if_absent("s/1", b"12345"))
    info = aio.run(object_store.stat("s/1"))
    assert info.size == 5
    assert info.modified.tzinfo is not None
    assert abs(info.modified - datetime.now(UTC)) < timedelta(minutes=5)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b"])
def test_bad_keys_are_refused(object_store, aio, key):
    """Keys that could escape the store's root or prefix raise ValueError."""
    if key == "a/../b" and type(object_store).__name__ == "S3Store":
        pytest.skip("S3 keys are opaque; '..' cannot escape a bucket")
    with pytest.raises(ValueError):
        aio.run(object_store.put_if_absent(key, b"x"))
