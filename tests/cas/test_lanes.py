"""cas/lanes.py: a chunk's re-hash on a lane behind its decryption — the same bytes and
the same refusals as inline, lanes lent at most `size` at once, and a lane given back
undrained retired, never handed to the next chunk."""

from __future__ import annotations

import os

import pytest

from cas.errors import ChunkCorrupt
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.lanes import Lane, Lanes
from cas.seal import LANE_MIN, ChunkSeal

SIZE = 3 * LANE_MIN + 12_345
NAMESPACE = "test"


class Counting(Lanes):
    """Lanes that count their loans and how each came back."""

    def __init__(self, size: int) -> None:
        super().__init__(size=size)
        self.given: list[bool] = []

    def give(self, lane: Lane, *, drained: bool) -> None:
        self.given.append(drained)
        super().give(lane, drained=drained)


def _segments(size: int) -> tuple[bytearray, list[memoryview]]:
    out = bytearray(size)
    view, cuts = memoryview(out), [0, 1472, 70_000, LANE_MIN + 3, 2 * LANE_MIN + 65_536, size]
    return out, [view[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


@pytest.fixture
def keyring() -> Keyring:
    return Keyring.generate()


def _sealed(keyring: Keyring, plaintext: bytes) -> tuple[ChunkId, bytearray]:
    chunk_id = ChunkId.of(plaintext, key=keyring.digest_key(NAMESPACE))
    return chunk_id, ChunkSeal(keyring).seal(chunk_id, plaintext)


def test_a_chunk_hashed_on_a_lane_opens_to_its_plaintext_and_the_lane_is_kept(keyring):
    plaintext = os.urandom(SIZE)
    chunk_id, sealed = _sealed(keyring, plaintext)
    lanes = Counting(1)
    out, segs = _segments(SIZE)
    ChunkSeal(keyring).open_into(
        chunk_id, sealed, segs, digest_key=keyring.digest_key(NAMESPACE), lanes=lanes
    )
    assert out == plaintext
    assert lanes.given == [True]  # lent, drained, kept for the next chunk
    assert lanes.take() is not None


def test_a_small_chunk_hashes_inline(keyring):
    plaintext = os.urandom(LANE_MIN - 1)
    chunk_id, sealed = _sealed(keyring, plaintext)
    lanes = Counting(1)
    out = bytearray(len(plaintext))
    view = memoryview(out)
    seal = ChunkSeal(keyring)
    seal.open_into(
        chunk_id, sealed, [view[:10], view[10:]], digest_key=keyring.digest_key(NAMESPACE),
        lanes=lanes,
    )  # fmt: skip
    assert out == plaintext
    assert lanes.given == []


def test_read_only_sealed_bytes_open_too(keyring):
    """The sealed bytes are only read: a caller's read-only bytes open as they are."""
    plaintext = os.urandom(SIZE)
    chunk_id, sealed = _sealed(keyring, plaintext)
    frozen = bytes(sealed)
    out, segs = _segments(SIZE)
    ChunkSeal(keyring).open_into(
        chunk_id, frozen, segs, digest_key=keyring.digest_key(NAMESPACE), lanes=Lanes(size=1)
    )
    assert out == plaintext
    assert frozen == sealed


def test_a_failed_tag_on_a_lane_is_refused_and_the_lane_retired(keyring):
    plaintext = os.urandom(SIZE)
    chunk_id, sealed = _sealed(keyring, plaintext)
    sealed[2 * LANE_MIN] ^= 0x01
    lanes = Counting(1)
    _, segs = _segments(SIZE)
    with pytest.raises(ChunkCorrupt, match="tag"):
        ChunkSeal(keyring).open_into(
            chunk_id, sealed, segs, digest_key=keyring.digest_key(NAMESPACE), lanes=lanes
        )
    assert lanes.given == [False]


def test_other_plaintext_sealed_under_the_id_fails_the_hash_on_a_lane(keyring):
    """A key holder's seal of other bytes under a chunk's id: the tag verifies, the
    lane's hash does not match the id."""
    chunk_id, _ = _sealed(keyring, os.urandom(SIZE))
    forged = ChunkSeal(keyring).seal(chunk_id, os.urandom(SIZE))
    lanes = Counting(1)
    _, segs = _segments(SIZE)
    with pytest.raises(ChunkCorrupt, match="does not hash"):
        ChunkSeal(keyring).open_into(
            chunk_id, forged, segs, digest_key=keyring.digest_key(NAMESPACE), lanes=lanes
        )
    assert lanes.given == [True]  # drained before the check: the lane is fine


def test_lanes_lend_at_most_size_and_reuse_what_comes_back():
    lanes = Lanes(size=1)
    lane = lanes.take()
    assert lane is not None
    assert lanes.take() is None
    lanes.give(lane, drained=True)
    assert lanes.take() is lane


def test_a_lane_given_back_undrained_ends_and_is_not_lent_again():
    lanes = Lanes(size=1)
    lane = lanes.take()
    assert lane is not None
    lanes.give(lane, drained=False)
    lane.thread.join(timeout=5)
    assert not lane.thread.is_alive()
    again = lanes.take()
    assert again is not None and again is not lane


def test_drained_raises_what_hashing_raised_and_the_lane_goes_on():
    class Broken:
        def update(self, data: memoryview, /) -> object:
            raise ValueError("no")

    class Counter:
        def __init__(self) -> None:
            self.seen = 0

        def update(self, data: memoryview, /) -> object:
            self.seen += data.nbytes
            return None

    lane = Lane("test-lane")
    released: list[str] = []
    skipped = Counter()
    lane.hash(Broken(), memoryview(b"abc"), release=lambda: released.append("broken"))
    lane.hash(skipped, memoryview(b"ab"), release=lambda: released.append("skipped"))
    with pytest.raises(ValueError, match="no"):
        lane.drained()
    assert skipped.seen == 0  # not hashed after an error, but its buffer released
    assert released == ["broken", "skipped"]
    counter = Counter()
    lane.hash(counter, memoryview(b"abcd"))
    lane.drained()
    assert counter.seen == 4
    lane.retire()


def test_warm_starts_every_lane():
    lanes = Lanes(size=2)
    lanes.warm()
    first, second = lanes.take(), lanes.take()
    assert first is not None and second is not None
    assert first.thread.is_alive() and second.thread.is_alive()
    assert lanes.take() is None
