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
on, which the file writes as zeros. Measured on an Intel Xeon VM for 60 arrays, against
`mx.zeros` of the same shapes: 3.1–3.5 ms against 53.5–54.0 ms at 7,936 tokens,
2.9–3.1 ms against 13.2–13.9 ms at 2,048, and 2.7–3.0 ms against 1.0–1.1 ms at 256. The
cost is mostly fixed: a call into Python per tensor, made from MLX's loader threads, each
waiting for the interpreter lock. How much that costs depends on the machine: on an AMD
EPYC VM the same 60 arrays took 9–16 ms at every size measured, against 7.9 ms for
`mx.zeros` at 2,048 tokens and 24.5 ms at 8,192 (the process otherwise idle).

- worth it: whether a shadow of so many bytes is cheaper made unfilled (`worth_it`):
  from MIN_BYTES on until measured, then from the crossover `calibrate` measured.
- calibrate: `mx.zeros` and `unfilled` timed on given shapes (the best of a few tries
  each), and the crossover set where the zero fill would cost what `unfilled` does: its
  cost is fixed, the zero fill's grows with the bytes. The warm start calibrates on the
  model's own full-layer shapes (kvpack/service/warm.py).
- packed: arrays with no row to zero (a cut that fills its buffers' capacity, as every
  aligned cut of a model whose alignment is mlx-lm's step does), made as views of a few
  unfilled buffers of at most GROUP_BYTES each, a run of equal shapes split out of one:
  one call into Python per buffer, not per array. The demo model's 60 buffers, Intel
  Xeon VM, median of 30: 0.38 ms at 256 rows (11.8 MB) against 0.88 ms for `mx.zeros`
  and 5.3 ms for `unfilled`; 0.88 ms at 2,048 rows against 10.6 and 5.2 ms; 3.2 ms at
  7,936 against 48.8 and 4.9 ms; below about 3 MB `mx.zeros` costs as much or less
  (0.26 against 0.42 ms at 64 rows). Views share their buffer: an in-place write into
  one (mlx-lm's cache growing within its capacity) would copy that array first. A cut
  that fills its capacity is never written in place: its next token makes the cache
  grow, which joins it into new buffers.

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
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO, NamedTuple, cast

import mlx.core as mx

MIN_BYTES = 32 << 20  # below this, mx.zeros costs less, until calibrated (module words)
# A packed buffer's most bytes: half glibc's mmap threshold as engine/memory.py fixes it,
# so each comes from the heap that keeps freed memory, not from fresh pages.
GROUP_BYTES = 16 << 20
SAFETENSORS = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}

_crossover = MIN_BYTES  # bytes from which unfilled is cheaper here; calibrate() sets it


def worth_it(nbytes: int) -> bool:
    """Whether `nbytes` of buffers to overwrite are cheaper made unfilled than zero-filled
    on this machine (the module words)."""
    return nbytes >= _crossover


def calibrate(shapes: Sequence[tuple[int, ...]], dtype: str, *, tries: int = 5) -> int:
    """Time `mx.zeros` and `unfilled` on `shapes` (in turns, the best of `tries` each),
    set the bytes from which `worth_it` says unfilled, and return them. Measure on shapes
    of at least tens of MiB, so that the zero fill's rate is that of memory, not of the
    cache."""
    if not shapes or tries < 1:
        raise ValueError(f"calibrate needs shapes and tries >= 1, got {len(shapes)}, {tries}")
    if dtype not in SAFETENSORS:
        raise ValueError(f"no unfilled arrays of dtype {dtype!r}")
    kind = getattr(mx, dtype)
    rows = min(s[-2] for s in shapes)
    zeros_s = unfilled_s = math.inf
    for _ in range(tries):
        zeros_s = min(zeros_s, _seconds(lambda: [mx.zeros(s, dtype=kind) for s in shapes]))
        unfilled_s = min(unfilled_s, _seconds(lambda: unfilled(shapes, dtype, filled_rows=rows)))
    global _crossover
    _crossover = crossover(sum(math.prod(s) for s in shapes) * SAFETENSORS[dtype][1],
                           zeros_s=zeros_s, unfilled_s=unfilled_s)  # fmt: skip
    return _crossover


def crossover(nbytes: int, *, zeros_s: float, unfilled_s: float) -> int:
    """The bytes whose zero fill costs what `unfilled` does, from one measurement of both
    on `nbytes` (the zero fill's cost grows with the bytes, unfilled's does not)."""
    if nbytes <= 0 or zeros_s <= 0 or unfilled_s < 0:
        raise ValueError(f"no crossover from {nbytes} bytes, {zeros_s} s, {unfilled_s} s")
    return math.ceil(nbytes * unfilled_s / zeros_s)


def _seconds(make: Callable[[], list[mx.array]]) -> float:
    start = time.perf_counter()
    mx.eval(make())
    return time.perf_counter() - start


def unfilled(
    shapes: Sequence[tuple[int, ...]], dtype: str, *, filled_rows: int | None
) -> list[mx.array]:
    """Arrays of `shapes` (rows along axis -2) and dtype name `dtype`, each row from
    `filled_rows` on zeros and each row before it for the caller to overwrite (None: every
    row is the caller's)."""
    if any(len(s) < 2 for s in shapes):
        raise ValueError(f"shapes {list(shapes)} need rows (filled_rows counts along axis -2)")
    rows = [s[-2] if filled_rows is None else filled_rows for s in shapes]
    if any(not 0 <= r <= s[-2] for s, r in zip(shapes, rows, strict=True)):
        raise ValueError(f"filled_rows {filled_rows} is not a row count of shapes {shapes}")
    if dtype not in SAFETENSORS:
        raise ValueError(f"no unfilled arrays of dtype {dtype!r}")
    if not shapes:
        return []
    file = cast(BinaryIO, _Header(shapes, dtype, rows))  # read as a binary file
    loaded = mx.load(file, format="safetensors")
    assert isinstance(loaded, dict)
    return [loaded[str(i)] for i in range(len(shapes))]


class Packed(NamedTuple):
    arrays: list[mx.array]  # the arrays asked for, in order
    buffers: list[mx.array]  # what they are views of: their bytes end to end, in order


def packed(shapes: Sequence[tuple[int, ...]], dtype: str) -> Packed:
    """Arrays of `shapes` and dtype name `dtype`, every byte for the caller to overwrite:
    a run of equal shapes is split, along axis 0, out of one unfilled buffer of at most
    GROUP_BYTES (an array larger than that has a buffer of its own)."""
    if dtype not in SAFETENSORS:
        raise ValueError(f"no unfilled arrays of dtype {dtype!r}")
    itemsize = SAFETENSORS[dtype][1]
    runs: list[tuple[tuple[int, ...], int]] = []  # (shape, arrays in its buffer)
    for shape in shapes:
        fits = runs and (runs[-1][1] + 1) * math.prod(shape) * itemsize <= GROUP_BYTES
        if fits and runs[-1][0] == shape:
            runs[-1] = (shape, runs[-1][1] + 1)
        else:
            runs.append((shape, 1))
    buffers = unfilled([(n * s[0], *s[1:]) for s, n in runs], dtype, filled_rows=None)
    arrays = [a for (_, n), buffer in zip(runs, buffers, strict=True)
              for a in (mx.split(buffer, n, axis=0) if n > 1 else [buffer])]  # fmt: skip
    return Packed(arrays, buffers)


class _Header(io.RawIOBase):
    """A safetensors file that carries only its header: a read of a tensor zeroes the
    rows it must and leaves the rest. MLX reads the tensors from several threads, each
    seeking first, so the position is per thread."""

    name = "unfilled.safetensors"

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype: str, rows: Sequence[int]) -> None:
        super().__init__()
        code, itemsize = SAFETENSORS[dtype]
        self._starts, self._tails, tensors, offset = [], [], {}, 0
        for i, (shape, filled_rows) in enumerate(zip(shapes, rows, strict=True)):
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
