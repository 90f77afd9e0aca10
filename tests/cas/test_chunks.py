"""ChunkStore on every backend: dedup, ordering, verification and faults.

Faults come from wrappers around the real backend (tests/cas/faults.py); in
each case the typed error is raised and no bytes are returned.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from cas.chunks import ChunkRef, ChunkStore
from cas.errors import ChunkCorrupt, ChunkMissing, UnknownKey
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.seal import ChunkSeal, sealed_size
from tests.cas.faults import FlipByte, Missing, Truncate


def blob(n: int, seed: int = 0) -> bytes:
    return (bytes([seed % 251]) + os.urandom(16)) * (n // 17) + b"!" * (n % 17)


def test_put_get_roundtrip(chunk_store, aio):
    """put returns (id, plaintext size); get returns the plaintext; the object is sealed."""
    data = blob(10_000)
    ref = aio.run(chunk_store.put(data))
    assert ref == ChunkRef(chunk_store.chunk_id(data), len(data))
    assert aio.run(chunk_store.get(ref)) == data
    stored = aio.run(chunk_store.objects.get(chunk_store.key(ref.id)))
    assert data[:64] not in stored and len(stored) == sealed_size(len(data), "k1")
    assert chunk_store.key(ref.id) == f"chunks/{ref.id.hex[:2]}/{ref.id.hex}"


def test_dedup_inside_a_namespace(chunk_store, aio):
    """Equal plaintext in one namespace: one id, one object, byte-identical seal."""
    data = blob(5000)
    first = aio.run(chunk_store.put(data))
    key = chunk_store.key(first.id)
    before = aio.run(chunk_store.objects.get(key))
    again = aio.run(chunk_store.put(bytearray(data)))
    assert again == first
    assert aio.run(chunk_store.objects.list_keys("chunks/")) == [key]
    assert aio.run(chunk_store.objects.get(key)) == before


def test_namespaces_give_different_ids(object_store, keyring, aio):
    """The same plaintext under two namespaces gets unrelated ids and two objects."""
    a = ChunkStore(object_store, keyring, namespace="tenant-a")
    b = ChunkStore(object_store, keyring, namespace="tenant-b")
    data = blob(3000)
    ra, rb = aio.run(a.put(data)), aio.run(b.put(data))
    assert ra.id != rb.id
    assert len(aio.run(object_store.list_keys("chunks/"))) == 2
    # A ref from one namespace never opens in the other: its plaintext does not hash
    # to the id under that namespace's digest key.
    with pytest.raises(ChunkCorrupt, match="hash"):
        aio.run(b.get(ra))


def test_put_digests_once_and_verifies_without_digesting_again(chunk_store, aio, digest_calls):
    """put digests a chunk once (none when the caller passes the id it computed), and its
    check of its own sealed output decrypts and compares instead of hashing again."""
    calls = digest_calls
    data = blob(5000, seed=9)
    ref = aio.run(chunk_store.put(data))
    assert len(calls) == 1
    given = chunk_store.chunk_id(data + b"!")
    calls.clear()
    aio.run(chunk_store.put(data + b"!", chunk_id=given))
    assert calls == []
    assert aio.run(chunk_store.get(ref)) == data  # a read re-hashes, as it must


def test_get_many_returns_one_buffer_in_ref_order(chunk_store, aio):
    """get_many lays every chunk end to end in ref order, repeats and empties included."""
    blobs = [blob(1000 + 37 * i, seed=i) for i in range(12)] + [b""]
    refs = aio.run(chunk_store.put_many(blobs))
    assert [r.size for r in refs] == [len(b) for b in blobs]
    order = list(reversed(refs)) + [refs[3], refs[3]]
    out = aio.run(chunk_store.get_many(order))
    assert isinstance(out, memoryview)
    assert out.tobytes() == b"".join(blobs[::-1]) + blobs[3] * 2
    assert aio.run(chunk_store.get_many([])).nbytes == 0


def test_get_many_with_small_concurrency_bound(object_store, keyring, aio):
    """max_concurrency=1 still fetches everything, in order (the bound serialises, not drops)."""
    store = ChunkStore(object_store, keyring, max_concurrency=1)
    blobs = [blob(2000, seed=i) for i in range(5)]
    refs = aio.run(store.put_many(blobs))
    assert aio.run(store.get_many(refs)).tobytes() == b"".join(blobs)


def test_contains_and_delete(chunk_store, aio):
    """contains follows the object; delete is idempotent; a deleted chunk is ChunkMissing."""
    ref = aio.run(chunk_store.put(b"payload"))
    assert aio.run(chunk_store.contains(ref.id))
    aio.run(chunk_store.delete(ref.id))
    aio.run(chunk_store.delete(ref.id))
    assert not aio.run(chunk_store.contains(ref.id))
    with pytest.raises(ChunkMissing) as e:
        aio.run(chunk_store.get(ref))
    assert e.value.chunk_id == ref.id


def test_eight_concurrent_puts_of_one_chunk(object_store, keyring, aio):
    """8 writers (separate ChunkStores) put the same chunk at once: all succeed, one object."""
    data = blob(200_000)
    stores = [ChunkStore(object_store, keyring, namespace="test") for _ in range(8)]

    async def race():
        return await asyncio.gather(*(s.put(data) for s in stores))

    refs = aio.run(race())
    assert len(set(refs)) == 1
    assert aio.run(object_store.list_keys("chunks/")) == [stores[0].key(refs[0].id)]
    assert aio.run(stores[0].get(refs[0])) == data


@pytest.mark.parametrize(
    "at, reason",
    [
        (0, "bad magic"),
        (4, "version"),
        (8, "tag"),  # first ciphertext byte (header is 4 + 2 + len("k1"))
        (30, "tag"),  # ciphertext
        (-1, "tag"),  # tag
    ],
)
def test_flipped_byte_is_corrupt(chunk_store, aio, at, reason):
    """One flipped bit anywhere in the sealed object -> ChunkCorrupt, from get and get_many."""
    ref = aio.run(chunk_store.put(blob(4000)))
    flipped = ChunkStore(FlipByte(chunk_store.objects, at), chunk_store.keyring, namespace="test")
    for call in (flipped.get(ref), flipped.get_many([ref])):
        with pytest.raises(ChunkCorrupt) as e:
            aio.run(call)
        assert e.value.chunk_id == ref.id and reason in e.value.reason


def test_flipped_key_id_is_a_typed_error(chunk_store, aio):
    """A flipped key-id byte names a key the ring lacks (UnknownKey) or a bad label
    (ChunkCorrupt); either way nothing is returned."""
    ref = aio.run(chunk_store.put(blob(4000)))
    flipped = ChunkStore(FlipByte(chunk_store.objects, 6), chunk_store.keyring, namespace="test")
    with pytest.raises((UnknownKey, ChunkCorrupt)):
        aio.run(flipped.get(ref))


def test_truncated_object_is_corrupt(chunk_store, aio):
    """An object that lost bytes -> ChunkCorrupt (size check before the tag check)."""
    ref = aio.run(chunk_store.put(blob(4000)))
    for drop in (1, 16, 4000):
        cut = ChunkStore(Truncate(chunk_store.objects, drop), chunk_store.keyring, namespace="test")
        with pytest.raises(ChunkCorrupt):
            aio.run(cut.get(ref))


def test_missing_object_is_chunk_missing(chunk_store, aio):
    """A store that lost the object -> ChunkMissing carrying the id; contains says False."""
    ref = aio.run(chunk_store.put(b"x" * 100))
    gone = ChunkStore(Missing(chunk_store.objects), chunk_store.keyring, namespace="test")
    with pytest.raises(ChunkMissing) as e:
        aio.run(gone.get_many([ref]))
    assert e.value.chunk_id == ref.id
    assert not aio.run(gone.contains(ref.id))


def test_get_many_fails_whole_when_one_chunk_is_corrupt(chunk_store, aio):
    """One corrupt chunk among many: get_many raises for it and returns no buffer."""
    refs = aio.run(chunk_store.put_many([blob(3000, seed=i) for i in range(6)]))
    bad_key = chunk_store.key(refs[4].id)
    flipped = FlipByte(chunk_store.objects, 40, only=bad_key)
    store = ChunkStore(flipped, chunk_store.keyring, namespace="test")
    with pytest.raises(ChunkCorrupt) as e:
        aio.run(store.get_many(refs))
    assert e.value.chunk_id == refs[4].id


def test_ref_with_wrong_size_is_corrupt(chunk_store, aio):
    """A ref claiming another plaintext size never returns bytes (size is checked)."""
    ref = aio.run(chunk_store.put(b"y" * 500))
    for size in (499, 501):
        with pytest.raises(ChunkCorrupt):
            aio.run(chunk_store.get(ChunkRef(ref.id, size)))


def test_validly_sealed_wrong_plaintext_fails_the_rehash(chunk_store, aio):
    """A holder of the seal key that labels other plaintext with an id: the tag verifies,
    the re-hash does not -> ChunkCorrupt (the digest check is not redundant)."""
    data, other = b"the real block" * 10, b"another block!" * 10
    chunk_id = chunk_store.chunk_id(data)
    forged = ChunkSeal(chunk_store.keyring).seal(chunk_id, other)
    aio.run(chunk_store.objects.put_if_absent(chunk_store.key(chunk_id), forged))
    with pytest.raises(ChunkCorrupt) as e:
        aio.run(chunk_store.get(ChunkRef(chunk_id, len(data))))
    assert "hash" in e.value.reason


def test_put_replaces_a_damaged_existing_object(chunk_store, aio):
    """put finding a truncated object at its key ("existed" with an impossible size)
    replaces it, so dedup never pins a broken chunk."""
    data = blob(3000)
    chunk_id = chunk_store.chunk_id(data)
    aio.run(chunk_store.objects.put_if_absent(chunk_store.key(chunk_id), b"KVPC-truncated"))
    ref = aio.run(chunk_store.put(data))
    assert aio.run(chunk_store.get(ref)) == data


def test_unknown_key_id_is_a_typed_error(chunk_store, aio):
    """A chunk sealed by a key this keyring lacks -> UnknownKey naming the key id."""
    ref = aio.run(chunk_store.put(b"z" * 300))
    ring = chunk_store.keyring
    stranger = Keyring(ring.digest_secret, {"k7": os.urandom(32)}, "k7")
    other = ChunkStore(chunk_store.objects, stranger, namespace="test")
    with pytest.raises(UnknownKey) as e:
        aio.run(other.get(ref))
    assert e.value.key_id == "k1"


def test_key_rotation(chunk_store, aio):
    """After rotation: old chunks still open, new chunks seal with the new key id, ids
    (and dedup) are unchanged, and the old ring cannot open the new chunks."""
    old_data, new_data = b"sealed before" * 50, b"sealed after" * 50
    old_ref = aio.run(chunk_store.put(old_data))
    rotated = chunk_store.keyring.rotate()
    store = ChunkStore(chunk_store.objects, rotated, namespace="test")
    assert aio.run(store.get(old_ref)) == old_data
    new_ref = aio.run(store.put(new_data))
    header = aio.run(store.objects.get(store.key(new_ref.id)))[:8]
    assert header == b"KVPC\x02\x02k2"
    assert aio.run(store.put(old_data)) == old_ref  # dedups against the k1 object
    assert aio.run(store.get_many([old_ref, new_ref])).tobytes() == old_data + new_data
    with pytest.raises(UnknownKey):
        aio.run(chunk_store.get(new_ref))


def test_bad_constructor_arguments(object_store, keyring):
    """Bad options raise ValueError naming the option."""
    with pytest.raises(ValueError, match="max_concurrency"):
        ChunkStore(object_store, keyring, max_concurrency=0)
    with pytest.raises(ValueError, match="namespace"):
        ChunkStore(object_store, keyring, namespace="")


def test_chunk_id_is_keyed_per_namespace(keyring):
    """chunk_id is the namespace-keyed BLAKE3 of the plaintext."""
    store = ChunkStore(None, keyring, namespace="n1")  # type: ignore[arg-type]
    assert store.chunk_id(b"abc") == ChunkId.of(b"abc", key=keyring.digest_key("n1"))
    assert store.chunk_id(b"abc") != ChunkId.of(b"abc", key=keyring.digest_key("n2"))
