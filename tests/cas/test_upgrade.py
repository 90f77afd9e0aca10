"""A vault written with seal format 1 after the upgrade, on every backend: it reads back
bit-identically, dedups without being rewritten, and refuses every tampering class.

The format 1 objects are written as the code before the upgrade wrote them (the
tests/cas/v1seal.py helper, pinned to that code's bytes in test_seal.py)."""

from __future__ import annotations

import os

import pytest

from cas.chunks import ChunkRef, ChunkStore
from cas.errors import ChunkCorrupt, UnknownKey
from cas.keys import Keyring
from cas.seal import VERSION_V1, header
from tests.cas.faults import FlipByte, Truncate
from tests.cas.v1seal import seal_v1


def v1_vault(chunk_store: ChunkStore, aio, blobs: list[bytes]) -> list[ChunkRef]:
    """Store `blobs` as format 1 chunks, the way a vault from before the upgrade holds them."""
    refs = []
    for data in blobs:
        chunk_id = chunk_store.chunk_id(data)
        sealed = seal_v1(chunk_store.keyring, chunk_id, data)
        assert aio.run(chunk_store.objects.put_if_absent(chunk_store.key(chunk_id), sealed))
        refs.append(ChunkRef(chunk_id, len(data)))
    return refs


def test_v1_vault_reads_back_bit_identically(chunk_store, aio):
    """get, get_many and get_into return exactly what the format 1 writer stored."""
    blobs = [os.urandom(5000 + i) for i in range(5)]
    refs = v1_vault(chunk_store, aio, blobs)
    assert aio.run(chunk_store.get_many(refs)).tobytes() == b"".join(blobs)
    assert aio.run(chunk_store.get(refs[2])) == blobs[2]
    outs = [memoryview(bytearray(r.size)) for r in refs]
    aio.run(chunk_store.get_into(refs, outs))
    assert [o.tobytes() for o in outs] == blobs


def test_v1_chunk_dedups_without_being_rewritten(chunk_store, aio):
    """put of a chunk a format 1 object already holds: same ref, the object untouched (its
    size is plausible for format 1), and new chunks beside it seal as format 2."""
    old, new = os.urandom(3000), os.urandom(3000)
    (ref,) = v1_vault(chunk_store, aio, [old])
    key = chunk_store.key(ref.id)
    before = aio.run(chunk_store.objects.get(key))
    assert aio.run(chunk_store.put(old)) == ref
    assert aio.run(chunk_store.objects.get(key)) == before
    fresh = aio.run(chunk_store.put(new))
    stored = aio.run(chunk_store.objects.get(chunk_store.key(fresh.id)))
    assert before[4] == VERSION_V1 and stored[4] == 2
    assert aio.run(chunk_store.get_many([ref, fresh])).tobytes() == old + new


@pytest.mark.parametrize("at", [0, 4, 6, 8, 20, 40, -1])
def test_v1_flipped_byte_is_refused(chunk_store, aio, at):
    """A bit flipped anywhere in a format 1 object (magic, version, key id, nonce,
    ciphertext, tag): a typed error, no bytes."""
    (ref,) = v1_vault(chunk_store, aio, [os.urandom(4000)])
    flipped = ChunkStore(FlipByte(chunk_store.objects, at), chunk_store.keyring, namespace="test")
    with pytest.raises((ChunkCorrupt, UnknownKey)):
        aio.run(flipped.get_many([ref]))


def test_v1_truncated_object_is_refused(chunk_store, aio):
    """A format 1 object that lost bytes: ChunkCorrupt."""
    (ref,) = v1_vault(chunk_store, aio, [os.urandom(4000)])
    for drop in (1, 16, 4000):
        cut = ChunkStore(Truncate(chunk_store.objects, drop), chunk_store.keyring, namespace="test")
        with pytest.raises(ChunkCorrupt):
            aio.run(cut.get(ref))


def test_v1_object_relabelled_to_another_id_is_refused(chunk_store, aio):
    """A format 1 object copied under another chunk's key is refused when read as that one."""
    a, b = os.urandom(2000), os.urandom(2000)
    ref_a, ref_b = v1_vault(chunk_store, aio, [a, b])
    moved = aio.run(chunk_store.objects.get(chunk_store.key(ref_a.id)))
    aio.run(chunk_store.objects.delete(chunk_store.key(ref_b.id)))
    aio.run(chunk_store.objects.put_if_absent(chunk_store.key(ref_b.id), moved))
    with pytest.raises(ChunkCorrupt) as e:
        aio.run(chunk_store.get(ref_b))
    assert e.value.chunk_id == ref_b.id


def test_v1_chunk_of_another_vault_is_refused(chunk_store, aio):
    """A format 1 object sealed by another vault's "k1" (same digest secret, so the same
    id): the tag fails."""
    data = os.urandom(2000)
    ring = chunk_store.keyring
    theirs = ChunkStore(
        chunk_store.objects,
        Keyring(ring.digest_secret, {"k1": os.urandom(32)}, "k1"),
        namespace="test",
    )
    (ref,) = v1_vault(theirs, aio, [data])
    with pytest.raises(ChunkCorrupt, match="tag"):
        aio.run(chunk_store.get(ref))


def test_v1_chunk_under_a_rotated_ring(chunk_store, aio):
    """After a key rotation the format 1 chunk (key id k1) still opens; its header edited to
    claim the new key id k2 (which the ring holds) fails the tag."""
    data = os.urandom(2000)
    (ref,) = v1_vault(chunk_store, aio, [data])
    rotated = ChunkStore(chunk_store.objects, chunk_store.keyring.rotate(), namespace="test")
    assert aio.run(rotated.get(ref)) == data
    key = rotated.key(ref.id)
    sealed = bytearray(aio.run(rotated.objects.get(key)))
    at = len(header("k1", version=VERSION_V1)) - 1
    assert sealed[at - 1 : at + 1] == b"k1"
    sealed[at : at + 1] = b"2"
    aio.run(rotated.objects.delete(key))
    aio.run(rotated.objects.put_if_absent(key, bytes(sealed)))
    with pytest.raises(ChunkCorrupt, match="tag"):
        aio.run(rotated.get(ref))
