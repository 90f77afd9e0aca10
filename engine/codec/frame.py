"""Frame: one part's bytes (plane format 1), the unit the vault stores as one chunk.

- frame: MAGIC, u16 format, u32 header length, the header, a blake3 digest of header +
  payload, then the payload.
- header: canonical JSON (sorted keys, no spaces) of the part's kind, its fields (a
  block's index and length, the ring's layers) and `arrays`: each array's dtype and shape.
- payload: the raw arrays in order, little-endian, C order; bfloat16 travels as its
  uint16 bits.

Equal arrays give equal bytes, so equal blocks dedup in the store; a flipped byte is
caught here (PlaneCorrupt) even without the store's seal — unless the caller says the
bytes are verified already (a chunk re-hashed against its content digest), when the
digest is not computed a second time. Dtypes come from the explicit DTYPES registry;
anything else is refused (PlanesInvalid), never guessed at.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import blake3
import mlx.core as mx
import numpy as np

from engine.errors import PlaneCorrupt, PlanesInvalid
from engine.identity import PACK_FORMAT_VERSION
from engine.state import mlx_bytes

FORMAT = PACK_FORMAT_VERSION
MAGIC = b"KVPL"
_PREFIX = struct.Struct("<4sHI")  # magic, format, header length
DIGEST_SIZE = 32
_MAX_HEADER = 1 << 20

# dtype name -> (mlx dtype, numpy dtype of the raw bytes); bfloat16 travels as uint16.
DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "float32": (mx.float32, np.dtype("<f4")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
}


def _dtype_name(a: mx.array) -> str:
    name = str(a.dtype).removeprefix("mlx.core.")
    if name not in DTYPES:
        raise PlanesInvalid(None, f"dtype {name} has no plane encoding")
    return name


def _host(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def head(kind: str, arrays: Sequence[mx.array], **fields: Any) -> bytes:
    """A frame's first bytes, prefix and header, for these arrays and fields: what
    encode_part writes before the digest (and what an intake expects to receive)."""
    specs = [(_dtype_name(a), list(a.shape)) for a in arrays]  # JSON: [name, shape]
    header = json.dumps(
        {"kind": kind, **fields, "arrays": specs}, sort_keys=True, separators=(",", ":")
    ).encode()
    return _PREFIX.pack(MAGIC, FORMAT, len(header)) + header


def encode_part(kind: str, arrays: Sequence[mx.array], **fields: Any) -> bytes:
    """One frame: prefix, header, digest, payload. Deterministic for equal arrays."""
    first = head(kind, arrays, **fields)
    start = len(first) + DIGEST_SIZE
    buf = bytearray(start + sum(a.nbytes for a in arrays))
    buf[: len(first)] = first
    pos = start
    for a in arrays:
        name = _dtype_name(a)
        dest = np.frombuffer(buf, dtype=DTYPES[name][1], count=a.size, offset=pos)
        np.copyto(dest.reshape(a.shape), _host(a))  # the one copy out of MLX memory
        pos += a.nbytes
    digest = blake3.blake3(memoryview(buf)[_PREFIX.size : len(first)])
    digest.update(memoryview(buf)[start:])
    buf[len(first) : start] = digest.digest()
    return bytes(buf)


def digest_of(role: str, data: bytes | memoryview) -> bytes:
    """The digest a frame carries (of its header and payload), read, not computed;
    PlanesInvalid when `data` is too short to be a frame."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise PlanesInvalid(role, f"{len(view)} bytes is shorter than a part prefix")
    start = _PREFIX.size + _PREFIX.unpack_from(view, 0)[2]
    if start + DIGEST_SIZE > len(view):
        raise PlanesInvalid(role, f"header length {start} does not fit in {len(view)} bytes")
    return bytes(view[start : start + DIGEST_SIZE])


def decode_part(
    role: str, data: bytes | memoryview, *, verified: bool = False
) -> tuple[dict[str, Any], list[mx.array]]:
    """(header, arrays) of one frame, evaluated; PlaneCorrupt when its digest does not
    match. `verified`: the bytes were checked against a content digest already, so the
    frame's own digest is not computed again. Arrays are views of `data` when it is a part
    buffer (engine.state.part_buffer) and they are aligned in it, else one copy each."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size + DIGEST_SIZE:
        raise PlanesInvalid(role, f"{len(view)} bytes is shorter than a part prefix")
    magic, fmt, hlen = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise PlanesInvalid(role, f"bad magic {bytes(magic)!r}")
    if fmt != FORMAT:
        raise PlanesInvalid(role, f"unsupported part format {fmt} (this engine reads {FORMAT})")
    start = _PREFIX.size + hlen + DIGEST_SIZE
    if hlen > _MAX_HEADER or start > len(view):
        raise PlanesInvalid(role, f"header length {hlen} does not fit in {len(view)} bytes")
    raw_header = view[_PREFIX.size : _PREFIX.size + hlen]
    if not verified:
        digest = blake3.blake3(raw_header)
        digest.update(view[start:])
        if digest.digest() != bytes(view[start - DIGEST_SIZE : start]):
            raise PlaneCorrupt(role, "digest does not match the bytes")
    try:
        header = json.loads(bytes(raw_header))
        specs = [(str(name), tuple(int(n) for n in shape)) for name, shape in header["arrays"]]
    except (ValueError, TypeError, KeyError) as e:
        raise PlanesInvalid(role, f"malformed header: {e}") from e
    runs: list[list[Any]] = []  # runs of equal (dtype, shape): [name, shape, offset, size, count]
    pos = start
    for name, shape in specs:
        if name not in DTYPES:
            raise PlanesInvalid(role, f"unknown dtype {name!r}")
        size = math.prod(shape) * DTYPES[name][1].itemsize
        if min(shape, default=1) < 0 or pos + size > len(view):
            raise PlanesInvalid(role, f"array {name}{list(shape)} overruns the part")
        if runs and runs[-1][:2] == [name, shape]:
            runs[-1][4] += 1
        else:
            runs.append([name, shape, pos, size, 1])
        pos += size
    if pos != len(view):
        raise PlanesInvalid(role, f"{len(view) - pos} trailing bytes after the arrays")
    base = mlx_bytes(data)
    at = np.frombuffer(view, dtype=np.uint8).ctypes.data if base is not None else 0
    arrays: list[mx.array] = []
    for name, shape, offset, size, count in runs:
        mx_dtype, np_dtype = DTYPES[name]
        if base is not None and (at + offset) % np_dtype.itemsize == 0:
            arrays += _views(base[offset : offset + count * size].view(mx_dtype), shape, count)
            continue
        for i in range(count):
            n = size // np_dtype.itemsize
            host = np.frombuffer(view, dtype=np_dtype, count=n, offset=offset + i * size)
            arr = mx.array(host.reshape(shape))  # the one copy into MLX memory
            arrays.append(arr.view(mx_dtype) if mx_dtype == mx.bfloat16 else arr)
    mx.eval(arrays)
    return header, arrays


def _views(flat: mx.array, shape: tuple[int, ...], count: int) -> list[mx.array]:
    """`count` arrays of `shape` laid end to end in `flat`, as views of it."""
    if count == 1:
        return [flat.reshape(shape)]
    if not shape or shape[0] == 0:  # nothing to split along: slice each
        size = math.prod(shape)
        return [flat[i * size : (i + 1) * size].reshape(shape) for i in range(count)]
    # One split instead of a slice per array: a part holds dozens of equal arrays.
    stacked = flat.reshape((count * shape[0], *shape[1:]))
    return list(mx.split(stacked, count, axis=0))
