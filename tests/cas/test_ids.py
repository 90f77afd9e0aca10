"""Chunk ids over bytes in segments: SegmentHasher equals ChunkId.of over the same bytes
laid end to end, however the stream is cut."""

from __future__ import annotations

import os
import random

import pytest

from cas.ids import BOUNCE, ChunkId, SegmentHasher

KEY = bytes(range(32))


def _cuts(size: int, sizes: list[int]) -> list[int]:
    """`sizes` repeated until they cover `size` bytes; the last one trimmed."""
    out, total = [], 0
    while total < size:
        for n in sizes:
            n = min(n, size - total)
            out.append(n)
            total += n
            if total == size:
                break
    return out


@pytest.mark.parametrize(
    ("size", "sizes"),
    [
        (12 * 1024 * 1024 + 1472, [1472] + [64 * 1024] * 192),  # a frame head, then planes
        (3 * BOUNCE, [BOUNCE]),  # aligned: no byte goes through the bounce buffer
        (3 * BOUNCE + 5, [BOUNCE - 1, 1, 0, BOUNCE + 3, 2]),  # ends on either side of a run
        (5 * BOUNCE + 17, [7, 4 * BOUNCE]),  # segments longer than a run
        (1000, [10, 0, 990]),  # smaller than a run: held until the digest
        (0, []),
    ],
)
def test_segment_hasher_equals_one_digest(size, sizes):
    data = os.urandom(size)
    hasher, pos = SegmentHasher(key=KEY, size=size), 0
    for n in _cuts(size, sizes):
        hasher.update(memoryview(data)[pos : pos + n])
        pos += n
    assert hasher.digest() == ChunkId.of(data, key=KEY).raw


def test_segment_hasher_random_cuts():
    """Random cuts of one stream all give its id (a bounce buffer that dropped, repeated
    or reordered any byte would not)."""
    rng = random.Random(7)
    data = os.urandom(3 * BOUNCE + 4321)
    expected = ChunkId.of(data, key=KEY).raw
    for _ in range(20):
        hasher, pos = SegmentHasher(key=KEY, size=len(data)), 0
        while pos < len(data):
            n = min(len(data) - pos, rng.choice([0, 1, 63, 4096, BOUNCE // 3, BOUNCE + 9]))
            hasher.update(memoryview(data)[pos : pos + n])
            pos += n
        assert hasher.digest() == expected
