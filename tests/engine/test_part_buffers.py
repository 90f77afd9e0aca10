"""Part buffers and verified Planes: parts that live in MLX memory decode without a copy,
a verified cut skips the frame digest (an unverified one never does), and a cut restored
from part buffers continues bit-identically."""

from __future__ import annotations

import blake3
import mlx.core as mx
import numpy as np
import pytest

from engine.codec import frame
from engine.errors import PlaneCorrupt
from engine.format import decode, encode
from engine.state import Planes, mlx_bytes, part_buffer
from tests.engine.slotkit import PROMPT, cold, continue_greedy, physical, tiny_pool


def in_part_buffers(planes: Planes, *, verified: bool = True) -> Planes:
    """The same planes with every part copied into a part buffer (what a reader fills)."""
    parts = []
    for role, data in planes.parts:
        buf = part_buffer(len(data))
        buf[:] = data
        parts.append((role, buf))
    return Planes(planes.layout, tuple(parts), verified=verified)


def test_part_buffer_is_writable_mlx_memory():
    """A part buffer is a fresh writable view of its own MLX array: bytes written show in the
    array, and two buffers never share memory."""
    a, b = part_buffer(64), part_buffer(64)
    a[:4] = b"abcd"
    assert bytes(np.asarray(a.obj)[:4]) == b"abcd" and bytes(b[:4]) == bytes(4)
    assert mlx_bytes(a) is a.obj and mlx_bytes(a[1:]) is None and mlx_bytes(b"x" * 64) is None
    assert part_buffer(0).nbytes == 0
    with pytest.raises(ValueError):
        part_buffer(-1)


def _aligned_frame(dtype) -> tuple[bytes, list[mx.array]]:
    """A frame of three equal-shaped arrays whose payload starts naturally aligned (the
    index pads the header)."""
    base = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)
    arrays = [(base + 100 * i).astype(dtype) for i in range(3)]
    for index in (0, 10, 100, 1000):  # headers one byte apart
        data = frame.encode_part("block", arrays, index=index, length=3)
        if (len(data) - arrays[0].nbytes) % 4 == 0:
            return data, arrays
    raise AssertionError("no index aligns the payload")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_aligned_part_in_a_part_buffer_decodes_to_views(dtype):
    """Arrays decoded from a part buffer are views of it: a byte written into the buffer
    afterwards shows in the array (a copy would not see it)."""
    data, src = _aligned_frame(dtype)
    buf = part_buffer(len(data))
    buf[:] = data
    _, out = frame.decode_part("block/0", buf, verified=True)
    assert [a.dtype for a in out] == [dtype] * 3
    assert all(mx.array_equal(a, b).item() for a, b in zip(out, src, strict=True))
    size = src[0].itemsize
    second = len(data) - src[0].nbytes + size  # the last array's element [0, 0, 1]
    buf[second : second + size] = bytes(size)
    assert out[2][0, 0, 1].item() == 0 and out[1][0, 0, 1].item() == 101


def test_part_buffer_decodes_like_bytes_whatever_the_shapes():
    """Runs of equal arrays, scalars, empty arrays and mixed dtypes decode from a part buffer
    to exactly what they decode to from plain bytes."""
    arrays = [
        mx.arange(6, dtype=mx.float32).reshape(2, 3),
        mx.arange(6, dtype=mx.float32).reshape(2, 3) * 2,
        mx.array(1.5),
        mx.array(2.5),
        mx.zeros((0, 4)),
        mx.zeros((0, 4)),
        mx.arange(5, dtype=mx.float32).astype(mx.bfloat16),
        mx.arange(3, dtype=mx.float16),
    ]
    data = frame.encode_part("block", arrays, index=0, length=2)
    buf = part_buffer(len(data))
    buf[:] = data
    _, want = frame.decode_part("block/0", data)
    _, got = frame.decode_part("block/0", buf, verified=True)
    assert [(a.dtype, a.shape) for a in got] == [(a.dtype, a.shape) for a in want]
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


def test_misaligned_array_is_copied_not_viewed():
    """An array that is not naturally aligned in the part buffer is copied once into MLX
    memory: correct values, and later writes into the buffer do not reach it."""
    arrays = [mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)]
    for index in (0, 10, 100, 1000):
        data = frame.encode_part("block", arrays, index=index, length=3)
        if (len(data) - arrays[0].nbytes) % 4:
            break
    else:
        raise AssertionError("no index misaligns the payload")
    buf = part_buffer(len(data))
    buf[:] = data
    _, (arr,) = frame.decode_part("block/0", buf, verified=True)
    buf[len(data) - arrays[0].nbytes :] = bytes(arrays[0].nbytes)
    assert np.array_equal(np.array(arr), np.array(arrays[0]))


def test_verified_skips_the_frame_digest_unverified_never_does(monkeypatch):
    """Planes marked verified decode without hashing any frame; the same bytes unverified
    hash every frame, and a flipped payload byte is PlaneCorrupt."""
    snap = cold(tiny_pool(1), PROMPT).export()
    planes = encode(snap)
    calls = []
    real = blake3.blake3

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(frame.blake3, "blake3", counting)
    decode(in_part_buffers(planes))
    assert calls == []
    decode(Planes(planes.layout, planes.parts))
    assert len(calls) == len(planes.parts)
    role, data = planes.parts[0]
    damaged = bytearray(data)
    damaged[-1] ^= 1
    bad = Planes(planes.layout, ((role, bytes(damaged)), *planes.parts[1:]))
    with pytest.raises(PlaneCorrupt):
        decode(bad)


def test_restore_from_part_buffers_is_bit_identical():
    """A cut carried in part buffers (verified, so decoded without copies or digests)
    restores to the same cache bytes and the same continuation as the cut in memory."""
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    a.generate(max_tokens=5, stop=())
    planes = encode(a.export())
    b = pool.slot(1)
    b.restore(in_part_buffers(planes), prompt=a.tokens)
    assert physical(b) == physical(a)
    assert continue_greedy(b) == continue_greedy(a)
