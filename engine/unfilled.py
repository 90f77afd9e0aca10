"""Unfilled arrays: MLX buffers that a restore is about to overwrite, made without a zero fill.

A cut's shadow caches (engine/intake.py) are written in full by verified bytes before
anything reads them, except for the rows past the cut's depth, which must be zeros (as
mlx-lm's KVCache allocates them). `mx.zeros` writes every byte first: 54 ms for the
demo model's 7,936-token shadow here (366 MB), and in a 2,048-token restore from S3 it
drew as many of the process's CPU samples as the decryption (11%, `perf record`).
MLX 0.32 has no uninitialized array on the CPU (`mx.empty` is `mx.zeros`, and
`mx.from_dlpack` will not share CPU memory), but its safetensors loader allocates each
tensor and asks the file object to fill it. `unfilled` hands it a file that holds only a
header: each tensor is left as the allocator gave it, except its rows from `filled_rows`
on, which the file writes as zeros. Measured here for 60 arrays, against `mx.zeros` of
the same shapes: 3.1–3.5 ms against 53.5–54.0 ms at 7,936 tokens, 2.9–3.1 ms against
13.2–13.9 ms at 2,048, and 2.7–3.0 ms against 1.0–1.1 ms at 256. The cost is fixed
(the header, a call per tensor), so below MIN_BYTES the zero fill is cheaper and is kept.

Until the caller has written every row before `filled_rows`, those rows hold whatever
memory the process freed before (another cut's bytes): nothing may read them. An intake
is filled by a reader that writes every byte of every segment or raises (cas
ChunkStore.get_into), and a restore that fails drops the shadow unread.
"""

from __future__ import annotations

import bisect
import io
import json
import math
import struct
import threading
from collections.abc import Sequence
from typing import BinaryIO, cast

import mlx.core as mx

MIN_BYTES = 32 << 20  # below this, mx.zeros costs less (see the module words)
SAFETENSORS = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}


def unfilled(shapes: Sequence[tuple[int, ...]], dtype: str, *, filled_rows: int) -> list[mx.array]:
    """Arrays of `shapes` (rows along axis -2) and dtype name `dtype`, each row from
    `filled_rows` on zeros and each row before it for the caller to overwrite."""
    if any(len(s) < 2 or not 0 <= filled_rows <= s[-2] for s in shapes):
        raise ValueError(f"filled_rows {filled_rows} is not a row count of shapes {shapes}")
    if dtype not in SAFETENSORS:
        raise ValueError(f"no unfilled arrays of dtype {dtype!r}")
    if not shapes:
        return []
    file = cast(BinaryIO, _Header(shapes, dtype, filled_rows))  # read as a binary file
    loaded = mx.load(file, format="safetensors")
    assert isinstance(loaded, dict)
    return [loaded[str(i)] for i in range(len(shapes))]


class _Header(io.RawIOBase):
    """A safetensors file that carries only its header: a read of a tensor zeroes the
    rows it must and leaves the rest. MLX reads the tensors from several threads, each
    seeking first, so the position is per thread."""

    name = "unfilled.safetensors"

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype: str, filled_rows: int) -> None:
        super().__init__()
        code, itemsize = SAFETENSORS[dtype]
        self._starts, self._tails, tensors, offset = [], [], {}, 0
        for i, shape in enumerate(shapes):
            size = math.prod(shape) * itemsize
            matrix = shape[-2] * shape[-1] * itemsize  # one [rows, cols] slice
            self._starts.append(offset)
            self._tails.append((matrix, filled_rows * shape[-1] * itemsize))
            tensors[str(i)] = {"dtype": code, "shape": list(shape),
                               "data_offsets": [offset, offset + size]}  # fmt: skip
            offset += size
        self._ends = [*self._starts[1:], offset]
        meta = json.dumps(tensors).encode()
        meta += b" " * (-len(meta) % 8)
        self._head = struct.pack("<Q", len(meta)) + meta
        self._size = len(self._head) + offset
        self._at = threading.local()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return int(getattr(self._at, "pos", 0))

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: self._size}[whence]
        self._at.pos = base + offset
        return self._at.pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        pos = self.tell()
        n = max(0, min(out.nbytes, self._size - pos))
        head = len(self._head)
        if pos < head:
            k = min(n, head - pos)
            out[:k] = self._head[pos : pos + k]
        start, end = max(pos, head) - head, pos + n - head
        t = bisect.bisect_right(self._starts, start) - 1
        while 0 <= t < len(self._starts) and self._starts[t] < end:
            self._zero_tails(out, t, start, end, base=pos - head)
            t += 1
        self._at.pos = pos + n
        return n

    def _zero_tails(self, out: memoryview, t: int, start: int, end: int, *, base: int) -> None:
        """Zero the rows past `filled_rows` in each [rows, cols] slice of tensor `t`
        within the data bytes [start, end); out[0] is data byte `base`."""
        matrix, kept = self._tails[t]
        first, last = self._starts[t], self._ends[t]
        lo_in, hi_in = max(start, first) - first, min(end, last) - first
        for k in range(lo_in // matrix, (hi_in - 1) // matrix + 1):
            slice_at = first + k * matrix
            lo, hi = max(start, slice_at + kept), min(end, slice_at + matrix)
            if lo < hi:
                out[lo - base : hi - base] = bytes(hi - lo)
