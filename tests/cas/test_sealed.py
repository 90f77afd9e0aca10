"""Sealed objects (quarantine) ride on the chunk seal: format 2 now, format 1 still
opens, and an object moved, damaged, cut short or sealed by another vault is refused."""

from __future__ import annotations

import os

import pytest

from cas.errors import ObjectCorrupt
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.sealed import DIGEST_NAMESPACE, SealedObjects, _bound
from tests.cas.v1seal import seal_v1

KEY = "quarantine/imp-1/planes"


def test_roundtrip_seals_as_format_2(object_store, keyring, aio):
    """put then get returns the bytes; the stored object is id | format 2 chunk."""
    objects = SealedObjects(object_store, keyring)
    data = os.urandom(3000)
    assert aio.run(objects.put(KEY, data))
    assert not aio.run(objects.put(KEY, data))  # put-if-absent
    assert aio.run(objects.get(KEY)) == data
    stored = aio.run(object_store.get(KEY))
    assert stored[32:36] == b"KVPC" and stored[36] == 2 and data[:32] not in stored


def test_format_1_object_still_opens(object_store, keyring, aio):
    """An object sealed before the upgrade (format 1 chunk inside) opens to its bytes."""
    data = os.urandom(2000)
    plaintext = _bound(KEY) + data
    chunk_id = ChunkId.of(plaintext, key=keyring.digest_key(DIGEST_NAMESPACE))
    aio.run(object_store.put_if_absent(KEY, chunk_id.raw + seal_v1(keyring, chunk_id, plaintext)))
    assert aio.run(SealedObjects(object_store, keyring).get(KEY)) == data


def test_tampering_is_refused(object_store, keyring, aio):
    """Moved to another key, a flipped byte (id, header, ciphertext, tag), truncated, or
    sealed by another vault: ObjectCorrupt carrying the key."""
    objects = SealedObjects(object_store, keyring)
    aio.run(objects.put(KEY, os.urandom(500)))
    good = aio.run(object_store.get(KEY))
    stranger = Keyring(keyring.digest_secret, {"k1": os.urandom(32)}, "k1")
    other = SealedObjects(object_store, stranger)
    aio.run(other.put("quarantine/theirs", b"x" * 100))
    damaged = {"quarantine/moved": good, "quarantine/short": good[:-1], "quarantine/tiny": good[:9]}
    for at in (0, 31, 32, 36, 40, 100, len(good) - 1):
        flipped = bytearray(good)
        flipped[at] ^= 1
        damaged[f"quarantine/flip-{at}"] = bytes(flipped)
    for key, data in damaged.items():
        aio.run(object_store.put_if_absent(key, data))
    for key in [*damaged, "quarantine/theirs"]:
        with pytest.raises(ObjectCorrupt) as e:
            aio.run(objects.get(key))
        assert e.value.key == key
