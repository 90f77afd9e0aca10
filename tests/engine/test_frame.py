"""engine/codec/frame.py: one part's bytes — the dtype registry, determinism, refusal of
unknown dtypes."""

from __future__ import annotations

import blake3
import mlx.core as mx
import pytest

from engine.codec import frame
from engine.errors import PlanesInvalid


def arrays(dtype):
    key = mx.random.key(3)
    a = mx.random.normal((2, 5, 4), key=key).astype(dtype)
    b = mx.random.normal((2, 7, 4), key=mx.random.split(key)[0]).astype(dtype)[:, 2:6, :]
    return [a, b]  # b is a strided view, as blocks are


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_part_roundtrip_per_dtype(dtype):
    """encode_part/decode_part: every registered dtype (bfloat16 travels as uint16) comes
    back bit-identical with its shape, from a strided view too, and encodes identically
    twice."""
    src = arrays(dtype)
    data = frame.encode_part("block", src, index=3, length=4)
    assert data == frame.encode_part("block", [mx.array(x) for x in src], index=3, length=4)
    header, out = frame.decode_part("block/3", memoryview(data))
    assert header["index"] == 3 and header["length"] == 4
    for x, y in zip(src, out, strict=True):
        assert y.dtype == dtype and y.shape == x.shape
        assert bytes(memoryview(y.view(mx.uint16) if dtype == mx.bfloat16 else y)) == bytes(
            memoryview(x.view(mx.uint16) if dtype == mx.bfloat16 else x)
        )


def test_unregistered_dtype_is_refused_both_ways():
    """DTYPES registry: an array of an unregistered dtype cannot be encoded, and a part
    whose (validly digested) header names one is refused rather than guessed at."""
    with pytest.raises(PlanesInvalid, match="int32"):
        frame.encode_part("block", [mx.zeros((2, 2), dtype=mx.int32)], index=0, length=2)
    data = bytearray(frame.encode_part("block", [mx.zeros((2, 2))], index=0, length=2))
    hlen = int.from_bytes(data[6:10], "little")
    header = bytes(data[10 : 10 + hlen]).replace(b"float32", b"float64")
    data[10 : 10 + hlen] = header
    start = 10 + hlen + 32
    digest = blake3.blake3(header)
    digest.update(bytes(data[start:]))
    data[start - 32 : start] = digest.digest()
    with pytest.raises(PlanesInvalid, match="unknown dtype 'float64'"):
        frame.decode_part("block/0", bytes(data))
