"""The chunk seal on its own: format 2 (what seals) and format 1 (what still opens) —
determinism (dedup), one key per chunk, and every tampering class refused in both."""

from __future__ import annotations

import os

import pytest

from cas.errors import ChunkCorrupt, UnknownKey
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.lanes import Lanes
from cas.seal import (
    MAGIC,
    NONCE_SIZE,
    RUN,
    TAG_SIZE,
    VERSION,
    VERSION_V1,
    ChunkSeal,
    Opening,
    header,
    max_sealed_size,
    plausible_sizes,
    sealed_size,
)
from tests.cas.v1seal import seal_v1

NS = "test"
VERSIONS = [VERSION_V1, VERSION]

# Written by the format 1 code (commit 9a99029's ChunkSeal.seal) for GOLDEN_RING and
# GOLDEN_DATA in namespace "test": a vault's bytes from before the upgrade.
GOLDEN_RING = Keyring(bytes(range(32)), {"k1": bytes(range(32, 64))}, "k1")
GOLDEN_DATA = b"kvpack v1 chunk " * 4
GOLDEN_V1 = bytes.fromhex(
    "4b56504301026b31b8ac462e898c388171979909be39077927e856e5005880688c45a516074d8371"
    "784300fa6b51eb9bedb3e2b1c4b024dfe6dbc9748a496a5f7e8eaee0878422116e666621122a2733"
    "64f0bc2d1a43c6f690f2c4ea1a45810ef59523b5"
)


def _id(ring: Keyring, data: bytes) -> ChunkId:
    return ChunkId.of(data, key=ring.digest_key(NS))


def _sealed(ring: Keyring, data: bytes, version: int = VERSION) -> tuple[ChunkId, bytearray]:
    cid = _id(ring, data)
    if version == VERSION_V1:
        return cid, bytearray(seal_v1(ring, cid, data))
    return cid, ChunkSeal(ring).seal(cid, data)


def _open(ring: Keyring, cid: ChunkId, sealed: bytes | bytearray) -> bytes:
    return ChunkSeal(ring).open(cid, sealed, digest_key=ring.digest_key(NS))


def test_format_2_and_roundtrip():
    """Sealed = magic|2|key id|ciphertext|tag, no nonce stored; open returns the plaintext."""
    ring = Keyring.generate()
    data = b"block bytes " * 100
    cid, sealed = _sealed(ring, data)
    head = header("k1")
    assert head == MAGIC + bytes((2, 2)) + b"k1"
    assert sealed[: len(head)] == head
    assert len(sealed) == sealed_size(len(data), "k1") == len(head) + len(data) + TAG_SIZE
    assert data[:16] not in sealed
    assert _open(ring, cid, sealed) == data


def test_format_1_written_before_the_upgrade_still_opens():
    """Bytes the format 1 code wrote open to their plaintext; the test helper that writes
    format 1 produces exactly those bytes."""
    cid = _id(GOLDEN_RING, GOLDEN_DATA)
    assert _open(GOLDEN_RING, cid, GOLDEN_V1) == GOLDEN_DATA
    assert seal_v1(GOLDEN_RING, cid, GOLDEN_DATA) == GOLDEN_V1
    assert len(GOLDEN_V1) == sealed_size(len(GOLDEN_DATA), "k1", version=VERSION_V1)
    assert GOLDEN_V1[len(header("k1")) :][:NONCE_SIZE] == cid.raw[:NONCE_SIZE]


def test_sizes_cover_both_formats():
    """plausible_sizes lists each format's size per key id; max_sealed_size bounds them."""
    sizes = plausible_sizes(1000, ("k1", "k22"))
    assert sizes == {1000 + 4 + 2 + n + TAG_SIZE + extra for n in (2, 3) for extra in (0, 12)}
    assert max(sizes) <= max_sealed_size(1000)


def test_equal_plaintext_seals_to_equal_bytes():
    """Deterministic per (key, id): the same block sealed twice is byte-identical (dedup)."""
    ring = Keyring.generate()
    assert _sealed(ring, b"same" * 64) == _sealed(ring, b"same" * 64)


def test_each_chunk_has_its_own_key():
    """Format 2 derives a key per chunk id: the same plaintext sealed under two ids (two
    namespaces) gets unrelated ciphertext (one key for every chunk under the constant
    nonce would repeat the keystream: equal ciphertext here)."""
    ring = Keyring.generate()
    data = bytes(4096)
    a_id, b_id = _id(ring, data), ChunkId.of(data, key=ring.digest_key("other"))
    a, b = ChunkSeal(ring).seal(a_id, data), ChunkSeal(ring).seal(b_id, data)
    start = len(header("k1"))
    assert a[:start] == b[:start] and a[start:-TAG_SIZE] != b[start:-TAG_SIZE]


def test_another_key_seals_differently():
    """A rotated key gives other ciphertext for the same chunk and labels it with its id."""
    ring = Keyring.generate()
    rotated = ring.rotate()
    cid, a = _sealed(ring, b"x" * 100)
    _, b = _sealed(rotated, b"x" * 100)
    assert a[8:] != b[8:] and b[:8] == b"KVPC\x02\x02k2"
    for sealed in (a, b):  # the rotated ring opens both
        assert _open(rotated, cid, sealed) == b"x" * 100


@pytest.mark.parametrize("version", VERSIONS)
def test_every_flipped_bit_is_refused(version):
    """Flipping any one bit of a sealed chunk (magic, version, key id, nonce, ciphertext,
    tag) is ChunkCorrupt, or UnknownKey when the key id becomes one the ring lacks."""
    ring = Keyring.generate()
    cid, sealed = _sealed(ring, os.urandom(40), version)
    for i in range(len(sealed)):
        for bit in (0x01, 0x80):
            damaged = bytearray(sealed)
            damaged[i] ^= bit
            with pytest.raises((ChunkCorrupt, UnknownKey)):
                _open(ring, cid, damaged)


@pytest.mark.parametrize("version", VERSIONS)
def test_truncated_or_padded_is_refused(version):
    """Any shorter or longer object: ChunkCorrupt (never an IndexError), from open_into for
    the expected size as well as from open."""
    ring = Keyring.generate()
    data = os.urandom(64)
    cid, sealed = _sealed(ring, data, version)
    seal, key = ChunkSeal(ring), ring.digest_key(NS)
    for cut in range(len(sealed)):
        with pytest.raises(ChunkCorrupt):
            _open(ring, cid, sealed[:cut])
        with pytest.raises(ChunkCorrupt):
            seal.open_into(cid, sealed[:cut], memoryview(bytearray(len(data))), digest_key=key)
    with pytest.raises(ChunkCorrupt):
        _open(ring, cid, sealed + b"\0")


@pytest.mark.parametrize("version", VERSIONS)
def test_relabelled_to_another_id_is_refused(version):
    """A chunk opened under another chunk's id: format 2 derives another key (the tag
    fails), format 1 finds the nonce is not the id's."""
    ring = Keyring.generate()
    _, sealed = _sealed(ring, b"z" * 100, version)
    other = _id(ring, b"other")
    with pytest.raises(ChunkCorrupt, match="tag" if version == VERSION else "nonce"):
        _open(ring, other, sealed)


def test_relabelled_format_1_with_its_nonce_rewritten_fails_the_tag():
    """Format 1 relabelled thoroughly (the nonce rewritten to the other id's): the id is
    associated data, so the tag still fails."""
    ring = Keyring.generate()
    _, sealed = _sealed(ring, b"z" * 100, VERSION_V1)
    other = _id(ring, b"other")
    start = len(header("k1", version=VERSION_V1))
    sealed[start : start + NONCE_SIZE] = other.raw[:NONCE_SIZE]
    with pytest.raises(ChunkCorrupt, match="tag"):
        _open(ring, other, sealed)


@pytest.mark.parametrize("version", VERSIONS)
def test_sealed_under_another_vaults_key_is_refused(version):
    """Another vault that shares our digest secret (so the same chunk id) and names its key
    "k1" too: its chunk fails our tag."""
    ours = Keyring.generate()
    theirs = Keyring(ours.digest_secret, {"k1": os.urandom(32)}, "k1")
    cid, sealed = _sealed(theirs, b"q" * 100, version)
    assert cid == _id(ours, b"q" * 100)
    with pytest.raises(ChunkCorrupt, match="tag"):
        _open(ours, cid, sealed)


@pytest.mark.parametrize("version", VERSIONS)
def test_wrong_key_id_is_refused(version):
    """The header is bound: a chunk sealed by k2 whose header claims k1 (a key the ring
    holds) fails the tag; one naming a key the ring lacks is UnknownKey carrying it."""
    ring = Keyring.generate().rotate()  # holds k1 and k2, seals with k2
    cid, sealed = _sealed(ring, b"y" * 100, version)
    sealed[7:8] = b"1"  # "k2" -> "k1"
    with pytest.raises(ChunkCorrupt, match="tag"):
        _open(ring, cid, sealed)
    cid, sealed = _sealed(ring.rotate(), b"w" * 10, version)
    with pytest.raises(UnknownKey) as e:
        _open(ring, cid, sealed)
    assert e.value.key_id == "k3"


@pytest.mark.parametrize("version", VERSIONS)
def test_validly_sealed_other_plaintext_fails_the_rehash(version):
    """A key holder sealing other plaintext under an id: the tag verifies, the re-hash of
    the plaintext against the id does not."""
    ring = Keyring.generate()
    cid = _id(ring, b"the real block")
    if version == VERSION_V1:
        forged = seal_v1(ring, cid, b"another block!")
    else:
        forged = ChunkSeal(ring).seal(cid, b"another block!")
    with pytest.raises(ChunkCorrupt, match="hash"):
        _open(ring, cid, forged)


def test_verify_checks_our_own_output():
    """verify accepts a seal of the plaintext, refuses one of other bytes or a damaged one."""
    ring = Keyring.generate()
    data = os.urandom(500)
    cid, sealed = _sealed(ring, data)
    seal = ChunkSeal(ring)
    seal.verify(cid, sealed, data)
    seal.verify(cid, memoryview(sealed), memoryview(data))
    with pytest.raises(ChunkCorrupt, match="does not open to its plaintext"):
        seal.verify(cid, sealed, data[:-1] + bytes([data[-1] ^ 1]))
    sealed[-1] ^= 1
    with pytest.raises(ChunkCorrupt, match="does not verify"):
        seal.verify(cid, sealed, data)


def test_bad_header_arguments():
    """Key ids must be 1..64 bytes; only known format versions have a header."""
    with pytest.raises(ValueError):
        header("")
    with pytest.raises(ValueError):
        header("k" * 65)
    with pytest.raises(ValueError, match="version"):
        header("k1", version=3)


def _segments(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("version", VERSIONS)
def test_open_into_segments_fills_them_in_order(version):
    """open_into with segments (empty ones too): the plaintext lands piece by piece in
    order; the same damage as for one buffer is refused (tag, re-hash, size)."""
    ring = Keyring.generate()
    data = os.urandom(1000)
    cid, sealed = _sealed(ring, data, version)
    seal, key = ChunkSeal(ring), ring.digest_key(NS)
    segs = _segments([100, 0, 899, 1])
    seal.open_into(cid, sealed, segs, digest_key=key)
    assert b"".join(s.tobytes() for s in segs) == data
    with pytest.raises(ChunkCorrupt, match="expected 999"):
        seal.open_into(cid, sealed, _segments([500, 499]), digest_key=key)
    damaged = bytearray(sealed)
    damaged[-20] ^= 1
    with pytest.raises(ChunkCorrupt, match="tag"):
        seal.open_into(cid, damaged, _segments([500, 500]), digest_key=key)
    forged_id = _id(ring, b"the real block")
    if version == VERSION_V1:
        forged = seal_v1(ring, forged_id, data)
    else:
        forged = ChunkSeal(ring).seal(forged_id, data)
    with pytest.raises(ChunkCorrupt, match="hash"):
        seal.open_into(forged_id, forged, _segments([1000]), digest_key=key)


@pytest.mark.parametrize("step", [100_003, 3 << 20])
def test_opening_streamed_in_landings_matches_the_plaintext(step):
    """An Opening fed as a read lands the bytes (odd-sized landings across several runs,
    each opened into a run buffer): the segments hold the plaintext and the landed bytes
    are left as they were; a flipped byte in a run opened mid-read fails the tag."""
    ring = Keyring.generate()
    data = os.urandom(2 * RUN + 12_345)
    cid, sealed = _sealed(ring, data)
    seal, key = ChunkSeal(ring), ring.digest_key(NS)
    for damage in (None, RUN + 7):
        landing = bytearray(len(sealed))
        if damage is not None:
            sealed[damage] ^= 1
        segs = _segments([1, RUN - 1, 4096, len(data) - RUN - 4096])
        opening = None
        for n in [*range(step, len(sealed), step), len(sealed)]:
            landing[n - min(step, n) : n] = sealed[n - min(step, n) : n]
            opening = opening or seal.opening(cid, memoryview(landing), segs, digest_key=key)
            opening.advance(n)
        assert opening is not None
        if damage is None:
            opening.finish()
            assert b"".join(s.tobytes() for s in segs) == data
            assert landing == sealed
        else:
            with pytest.raises(ChunkCorrupt, match="tag"):
                opening.finish()


@pytest.mark.parametrize("lanes", [0, 2], ids=["hashed-inline", "hash-lane"])
def test_a_run_one_segment_holds_is_opened_in_place(monkeypatch, lanes):
    """A run that lies whole in one segment is decrypted and hashed where it belongs, with
    no run buffer and no copy out; a run across segments goes through a run buffer. The
    plaintext lands in order either way, and damage in a run opened in place still
    fails the tag."""
    ring = Keyring.generate()
    data = os.urandom(3 * RUN + 999)
    cid, sealed = _sealed(ring, data)
    seal, key, lent = ChunkSeal(ring), ring.digest_key(NS), Lanes(size=lanes)
    copied: list[int] = []
    scatter = Opening._scatter

    def counted(self, run):
        copied.append(run.nbytes)
        scatter(self, run)

    monkeypatch.setattr(Opening, "_scatter", counted)
    head_then_one = [1500, len(data) - 1500]  # a frame's head, then one buffer
    for sizes, copies in ((head_then_one, [RUN]), ([64 << 10] * 48 + [999], [RUN] * 3)):
        segs = _segments(sizes)
        seal.open_into(cid, sealed, segs, digest_key=key, lanes=lent)
        assert b"".join(s.tobytes() for s in segs) == data
        assert copied == copies
        copied.clear()
    damaged = bytearray(sealed)
    damaged[-RUN] ^= 1  # in the last full run, which its segment holds whole
    with pytest.raises(ChunkCorrupt, match="tag"):
        seal.open_into(cid, damaged, _segments(head_then_one), digest_key=key, lanes=lent)
