"""The chunk seal on its own: determinism (dedup), binding of header and id, key ids."""

from __future__ import annotations

import pytest

from cas.errors import ChunkCorrupt, UnknownKey
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.seal import MAGIC, NONCE_SIZE, TAG_SIZE, VERSION, ChunkSeal, header, sealed_size

NS = "test"


def _sealed(ring: Keyring, data: bytes) -> tuple[ChunkId, bytearray]:
    cid = ChunkId.of(data, key=ring.digest_key(NS))
    return cid, ChunkSeal(ring).seal(cid, data)


def test_format_and_roundtrip():
    """Sealed = magic|version|key id|nonce(=id[:12])|ciphertext+tag; open returns the plaintext."""
    ring = Keyring.generate()
    data = b"block bytes " * 100
    cid, sealed = _sealed(ring, data)
    head = header("k1")
    assert sealed[: len(head)] == MAGIC + bytes((VERSION, 2)) + b"k1"
    assert sealed[len(head) : len(head) + NONCE_SIZE] == cid.raw[:NONCE_SIZE]
    assert len(sealed) == sealed_size(len(data), "k1") == len(head) + NONCE_SIZE + len(data) + 16
    assert data not in sealed
    opened = ChunkSeal(ring).open(cid, sealed, digest_key=ring.digest_key(NS))
    assert opened == data


def test_equal_plaintext_seals_to_equal_bytes():
    """Deterministic per (key, id): the same block sealed twice is byte-identical (dedup),
    and a different block gets a different nonce."""
    ring = Keyring.generate()
    same_id, same = _sealed(ring, b"same" * 64)
    assert (same_id, same) == _sealed(ring, b"same" * 64)
    _, other = _sealed(ring, b"diff" * 64)
    start = len(header("k1"))
    assert other[start : start + NONCE_SIZE] != same[start : start + NONCE_SIZE]


def test_another_key_seals_differently():
    """A rotated key gives other ciphertext for the same chunk and labels it with its id."""
    ring = Keyring.generate()
    rotated = ring.rotate()
    cid, a = _sealed(ring, b"x" * 100)
    _, b = _sealed(rotated, b"x" * 100)
    assert a[8:] != b[8:] and b[:8] == b"KVPC\x01\x02k2"
    # The rotated ring opens both.
    for sealed in (a, b):
        assert ChunkSeal(rotated).open(cid, sealed, digest_key=rotated.digest_key(NS)) == b"x" * 100


def test_relabelled_key_id_fails_the_tag():
    """The header is associated data: claiming another (existing) key id fails the tag."""
    ring = Keyring.generate().rotate()  # holds k1 and k2, seals with k2
    cid, sealed = _sealed(ring, b"y" * 100)
    sealed[7:8] = b"1"  # "k2" -> "k1"
    with pytest.raises(ChunkCorrupt, match="tag"):
        ChunkSeal(ring).open(cid, sealed, digest_key=ring.digest_key(NS))


def test_chunk_id_is_bound():
    """Opening under another id fails: its nonce and associated data do not match."""
    ring = Keyring.generate()
    _, sealed = _sealed(ring, b"z" * 100)
    other = ChunkId.of(b"other", key=ring.digest_key(NS))
    with pytest.raises(ChunkCorrupt, match="nonce"):
        ChunkSeal(ring).open(other, sealed, digest_key=ring.digest_key(NS))


def test_unknown_key_id():
    """A key id the ring does not hold -> UnknownKey carrying it."""
    ring = Keyring.generate()
    cid, sealed = _sealed(ring.rotate(), b"w" * 10)
    with pytest.raises(UnknownKey) as e:
        ChunkSeal(ring).open(cid, sealed, digest_key=ring.digest_key(NS))
    assert e.value.key_id == "k2"


@pytest.mark.parametrize("cut", [0, 3, 5, 8, 8 + NONCE_SIZE + TAG_SIZE - 1])
def test_short_input_is_corrupt(cut):
    """Anything shorter than a header, nonce and tag is ChunkCorrupt, never an IndexError."""
    ring = Keyring.generate()
    cid, sealed = _sealed(ring, b"")
    with pytest.raises(ChunkCorrupt):
        ChunkSeal(ring).open(cid, sealed[:cut], digest_key=ring.digest_key(NS))


def test_bad_key_id_length():
    """Key ids must be 1..64 bytes."""
    with pytest.raises(ValueError):
        header("")
    with pytest.raises(ValueError):
        header("k" * 65)
