"""Planes: a Snapshot as (layout, parts) — the form the vault stores.

- layout: a JSON-able dict describing the cut (format version, identity, depth, alignment,
  capacity, the block list, ring metadata per sliding layer, the logits plane). The catalog
  keeps it in the signed manifest.
- part: (role, bytes), stored as one chunk each. Roles: "block/<i>" (the full layers'
  K/V for block i), "ring" (every sliding layer's buffers), "logits".
- part bytes: MAGIC, u16 format, u32 header length, a canonical-JSON header (kind, index,
  length, and each array's dtype and shape), a blake3 digest of header + payload, then the
  raw arrays in order. Same planes, same bytes — equal blocks dedup in the store — and a
  flipped byte is caught here even without the store's seal.

Decoding never lets the data choose code: part kinds and dtypes come from the explicit
registries below, and an unknown format version, kind or dtype is refused (PlanesInvalid).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import blake3
import mlx.core as mx
import numpy as np

from engine.errors import PlaneCorrupt, PlanesInvalid
from engine.identity import PACK_FORMAT_VERSION
from engine.snapshot import Block, Ring, Snapshot

FORMAT = PACK_FORMAT_VERSION
MAGIC = b"KVPL"
_PREFIX = struct.Struct("<4sHI")  # magic, format, header length
_DIGEST = 32
_MAX_HEADER = 1 << 20

# dtype name -> (mlx dtype, numpy dtype of the raw bytes); bfloat16 travels as uint16.
DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "float32": (mx.float32, np.dtype("<f4")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
}

Parts = list[tuple[str, bytes]]


# -- arrays <-> bytes --------------------------------------------------------------------
def _dtype_name(a: mx.array) -> str:
    name = str(a.dtype).removeprefix("mlx.core.")
    if name not in DTYPES:
        raise PlanesInvalid(None, f"dtype {name} has no plane encoding")
    return name


def _host(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def encode_part(kind: str, arrays: Sequence[mx.array], **fields: int) -> bytes:
    """One part: prefix, header, digest, payload. Deterministic for equal arrays."""
    specs = [[_dtype_name(a), list(a.shape)] for a in arrays]
    header = json.dumps(
        {"kind": kind, **fields, "arrays": specs}, sort_keys=True, separators=(",", ":")
    ).encode()
    start = _PREFIX.size + len(header) + _DIGEST
    buf = bytearray(start + sum(a.nbytes for a in arrays))
    _PREFIX.pack_into(buf, 0, MAGIC, FORMAT, len(header))
    buf[_PREFIX.size : _PREFIX.size + len(header)] = header
    pos = start
    for a, (name, shape) in zip(arrays, specs, strict=True):
        dest = np.frombuffer(buf, dtype=DTYPES[name][1], count=a.size, offset=pos)
        np.copyto(dest.reshape(shape), _host(a))  # the one copy out of MLX memory
        pos += a.nbytes
    digest = blake3.blake3(memoryview(buf)[_PREFIX.size : _PREFIX.size + len(header)])
    digest.update(memoryview(buf)[start:])
    buf[start - _DIGEST : start] = digest.digest()
    return bytes(buf)


def decode_part(role: str, data: bytes | memoryview) -> tuple[dict[str, Any], list[mx.array]]:
    """(header, arrays) of one part; PlaneCorrupt when its digest does not match."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size + _DIGEST:
        raise PlanesInvalid(role, f"{len(view)} bytes is shorter than a part prefix")
    magic, fmt, hlen = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise PlanesInvalid(role, f"bad magic {bytes(magic)!r}")
    if fmt != FORMAT:
        raise PlanesInvalid(role, f"unsupported part format {fmt} (this engine reads {FORMAT})")
    start = _PREFIX.size + hlen + _DIGEST
    if hlen > _MAX_HEADER or start > len(view):
        raise PlanesInvalid(role, f"header length {hlen} does not fit in {len(view)} bytes")
    raw_header = view[_PREFIX.size : _PREFIX.size + hlen]
    digest = blake3.blake3(raw_header)
    digest.update(view[start:])
    if digest.digest() != bytes(view[start - _DIGEST : start]):
        raise PlaneCorrupt(role, "digest does not match the bytes")
    try:
        header = json.loads(bytes(raw_header))
        specs = [(str(name), tuple(int(n) for n in shape)) for name, shape in header["arrays"]]
    except (ValueError, TypeError, KeyError) as e:
        raise PlanesInvalid(role, f"malformed header: {e}") from e
    arrays, pos = [], start
    for name, shape in specs:
        if name not in DTYPES:
            raise PlanesInvalid(role, f"unknown dtype {name!r}")
        mx_dtype, np_dtype = DTYPES[name]
        count = int(np.prod(shape)) if shape else 1
        if min(shape, default=1) < 0 or pos + count * np_dtype.itemsize > len(view):
            raise PlanesInvalid(role, f"array {name}{list(shape)} overruns the part")
        host = np.frombuffer(view, dtype=np_dtype, count=count, offset=pos).reshape(shape)
        arr = mx.array(host)  # the one copy into MLX memory
        arrays.append(arr.view(mx_dtype) if mx_dtype == mx.bfloat16 else arr)
        pos += count * np_dtype.itemsize
    if pos != len(view):
        raise PlanesInvalid(role, f"{len(view) - pos} trailing bytes after the arrays")
    return header, arrays


# -- part kinds --------------------------------------------------------------------------
def _decode_block(role: str, entry: dict[str, Any], header: dict, arrays: list, ctx: dict) -> None:
    index, length = int(entry["index"]), int(entry["length"])
    if header.get("index") != index or header.get("length") != length:
        raise PlanesInvalid(
            role,
            f"part header {header.get('index')}/{header.get('length')} != layout {index}/{length}",
        )
    if len(arrays) % 2:
        raise PlanesInvalid(role, f"odd number of arrays ({len(arrays)})")
    half = len(arrays) // 2
    ctx["blocks"].append(Block(index, length, tuple(arrays[:half]), tuple(arrays[half:])))


def _decode_ring(role: str, entry: dict[str, Any], header: dict, arrays: list, ctx: dict) -> None:
    layers = entry["layers"]
    if header.get("layers") != [int(r["layer"]) for r in layers] or len(arrays) != 2 * len(layers):
        raise PlanesInvalid(role, "ring part does not match the layout's ring layers")
    for n, r in enumerate(layers):
        ctx["rings"].append(
            Ring(
                layer=int(r["layer"]),
                keys=arrays[2 * n],
                values=arrays[2 * n + 1],
                offset=int(r["offset"]),
                idx=int(r["idx"]),
                window=int(r["window"]),
                keep=int(r["keep"]),
            )
        )


def _decode_logits(role: str, entry: dict[str, Any], header: dict, arrays: list, ctx: dict) -> None:
    if len(arrays) != 1:
        raise PlanesInvalid(role, f"expected one logits array, got {len(arrays)}")
    ctx["logits"] = arrays[0]


Decoder = Callable[[str, dict[str, Any], dict, list, dict], None]
PART_KINDS: dict[str, Decoder] = {
    "block": _decode_block,
    "ring": _decode_ring,
    "logits": _decode_logits,
}


# -- snapshot <-> planes -----------------------------------------------------------------
def encode(snap: Snapshot) -> tuple[dict[str, Any], Parts]:
    """(layout, parts) for a snapshot; parts in order: blocks, ring, logits."""
    parts: Parts = []
    blocks = []
    for b in snap.blocks:
        role = f"block/{b.index}"
        parts.append(
            (role, encode_part("block", [*b.keys, *b.values], index=b.index, length=b.length))
        )
        blocks.append({"role": role, "index": b.index, "length": b.length})
    ring = None
    if snap.rings:
        arrays = [a for r in snap.rings for a in (r.keys, r.values)]
        parts.append(("ring", encode_part("ring", arrays, layers=[r.layer for r in snap.rings])))
        ring = {
            "role": "ring",
            "layers": [
                {
                    "layer": r.layer,
                    "offset": r.offset,
                    "idx": r.idx,
                    "window": r.window,
                    "keep": r.keep,
                    "size": r.size,
                }
                for r in snap.rings
            ],
        }
    logits = None
    if snap.logits is not None:
        parts.append(("logits", encode_part("logits", [snap.logits])))
        logits = {"role": "logits", "vocab": int(snap.logits.shape[0])}
    layout = {
        "format": FORMAT,
        "identity": snap.identity.hex(),
        "depth": snap.depth,
        "alignment": snap.alignment,
        "capacity": snap.capacity,
        "blocks": blocks,
        "ring": ring,
        "logits": logits,
    }
    return layout, parts


def decode(layout: dict[str, Any], parts: Sequence[tuple[str, bytes | memoryview]]) -> Snapshot:
    """The Snapshot that `encode` produced; PlanesInvalid / PlaneCorrupt on anything else.
    Shapes are checked against the model later, by restore's gate."""
    if not isinstance(layout, dict) or layout.get("format") != FORMAT:
        got = layout.get("format") if isinstance(layout, dict) else type(layout).__name__
        raise PlanesInvalid(None, f"unsupported plane format {got!r} (this engine reads {FORMAT})")
    try:
        entries: dict[str, dict[str, Any]] = {e["role"]: e for e in layout["blocks"]}
        for key in ("ring", "logits"):
            if layout[key] is not None:
                entries[layout[key]["role"]] = layout[key]
        identity = bytes.fromhex(layout["identity"])
        depth, alignment = int(layout["depth"]), int(layout["alignment"])
        capacity = int(layout["capacity"])
    except (KeyError, TypeError, ValueError) as e:
        raise PlanesInvalid(None, f"malformed layout: {e!r}") from e
    given = [role for role, _ in parts]
    if sorted(given) != sorted(entries) or len(set(given)) != len(given):
        raise PlanesInvalid(None, f"parts {given} do not match the layout's {sorted(entries)}")
    ctx: dict[str, Any] = {"blocks": [], "rings": [], "logits": None}
    for role, data in parts:
        kind = role.split("/", 1)[0]
        decoder = PART_KINDS.get(kind)
        if decoder is None:
            raise PlanesInvalid(role, f"unknown part kind {kind!r}")
        header, arrays = decode_part(role, data)
        if header.get("kind") != kind:
            raise PlanesInvalid(role, f"part is a {header.get('kind')!r}, role says {kind!r}")
        try:
            decoder(role, entries[role], header, arrays, ctx)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanesInvalid(role, f"malformed entry: {e!r}") from e
    return Snapshot(
        identity=identity,
        depth=depth,
        alignment=alignment,
        capacity=capacity,
        blocks=tuple(sorted(ctx["blocks"], key=lambda b: b.index)),
        rings=tuple(ctx["rings"]),
        logits=ctx["logits"],
    )
