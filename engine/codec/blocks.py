"""Blocks: the cache kind of full-attention layers (mlx-lm KVCache); part kind "block".

- block i: every full layer's K and V for tokens [i*A, i*A + length), each
  [kv_heads, length, head_dim]; length is A except for the final block of a non-aligned
  cut. Its part holds all full layers' K in layer order, then their V; fields index and
  length. Equal prefixes give equal blocks, so blocks dedup in the store.
- capacity: the length the full layers' buffers were allocated to (mlx-lm grows them in
  steps of KVCache.step). Install pads the joined blocks back to it, so the restored
  cache grows exactly as the original would have.
- layout keys: "capacity", and "blocks": [{role, index, length}] in block order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine import streams, unfilled
from engine.codec.checks import entry, expect, integers, listed
from engine.codec.frame import DTYPES
from engine.errors import EngineError, PlanesInvalid, ShapeMismatch
from engine.layout import LayerKV, dtype_name
from engine.state import Part, PoolShape, SlotState, Snapshot

KIND = "block"


def _full(pool: PoolShape) -> list[tuple[int, LayerKV]]:
    return [(i, spec) for i, spec in enumerate(pool.layout.layers) if spec.kind == "full"]


def export(pool: PoolShape, state: SlotState) -> tuple[dict[str, Any], list[Part]]:
    depth, step = len(state.tokens), pool.alignment
    caches = [state.cache[i] for i, _ in _full(pool)]
    capacities = {int(c.keys.shape[2]) for c in caches}
    if len(capacities) > 1:
        # Every full layer sees the same updates; anything else is a bug, not a cut.
        raise EngineError(f"full layers disagree on capacity: {sorted(capacities)}")
    parts = []
    for index, lo in enumerate(range(0, depth, step)):
        hi = min(depth, lo + step)
        keys = [c.keys[0, :, lo:hi, :] for c in caches]
        values = [c.values[0, :, lo:hi, :] for c in caches]
        parts.append(Part(f"block/{index}", (*keys, *values), {"index": index, "length": hi - lo}))
    layout = {
        "capacity": capacities.pop() if capacities else 0,
        "blocks": [{"role": p.role, **p.fields} for p in parts],
    }
    return layout, parts


def entries(layout: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    integers(None, layout, ("capacity",))
    found = [entry(e, "index", "length") for e in listed(None, layout.get("blocks"))]
    return [(e["role"], e) for e in found]


def decode(role: str, layout_entry: Mapping[str, Any], header: Mapping, arrays: list) -> Part:
    index, length = layout_entry["index"], layout_entry["length"]
    if role != f"block/{index}" or (header.get("index"), header.get("length")) != (index, length):
        raise PlanesInvalid(
            role,
            f"part header {header.get('index')}/{header.get('length')} != layout {index}/{length}",
        )
    if len(arrays) % 2:
        raise PlanesInvalid(role, f"odd number of arrays ({len(arrays)})")
    return Part(role, tuple(arrays), {"index": index, "length": length})


def gate(pool: PoolShape, snap: Snapshot, parts: Sequence[Part]) -> None:
    full = [spec for _, spec in _full(pool)]
    depth, alignment, dtype = snap.depth, snap.alignment, pool.layout.dtype
    expect("block count", -(-depth // alignment), len(parts))
    want = getattr(mx, dtype)
    for i, part in enumerate(parts):
        length = min(alignment, depth - i * alignment)
        expect(f"block {i} index", i, part.fields.get("index"))
        expect(f"block {i} length", length, part.fields.get("length"))
        expect(f"block {i} arrays (K and V per full layer)", 2 * len(full), len(part.arrays))
        # One comparison per part; the array that differs is named only on a refusal (a
        # deep cut has thousands of arrays, and a check per array cost milliseconds).
        shapes = [(spec.kv_heads, length, spec.head_dim) for spec in full] * 2
        arrays = part.arrays
        if [tuple(a.shape) for a in arrays] != shapes or any(a.dtype != want for a in arrays):
            _refuse_array(i, part, full, length, dtype)
            raise ShapeMismatch(f"block {i} arrays", shapes, [tuple(a.shape) for a in arrays])
    capacity = snap.layout["capacity"]
    if not full:
        expect("capacity", 0, capacity)
    # mlx-lm grows a full layer's buffer in steps; a depth it has not reached, or more
    # than one step of slack, is not a state a KVCache can be in.
    elif not depth <= capacity < depth + KVCache.step:
        raise ShapeMismatch("capacity", f"[{depth}, {depth + KVCache.step})", capacity)


def _refuse_array(i: int, part: Part, full: list[LayerKV], length: int, dtype: str) -> None:
    """The ShapeMismatch that names the first array of block `i` that does not fit."""
    for j, spec in enumerate(full):
        shape = (spec.kv_heads, length, spec.head_dim)
        for kv, arr in (("K", part.arrays[j]), ("V", part.arrays[len(full) + j])):
            expect(f"block {i} full layer #{j} {kv} shape", shape, tuple(arr.shape))
            expect(f"block {i} full layer #{j} {kv} dtype", dtype, dtype_name(arr.dtype))


def install(pool: PoolShape, snap: Snapshot, parts: Sequence[Part], shadow: SlotState) -> None:
    full = _full(pool)
    depth, capacity = snap.depth, snap.layout["capacity"]
    side = streams.side()
    for j, (layer, _) in enumerate(full):
        cache = shadow.cache[layer]
        if not isinstance(cache, KVCache):
            raise ShapeMismatch(f"layer {layer} cache", "KVCache", type(cache).__name__)
        cache.keys = _join([p.arrays[j] for p in parts], depth, capacity)
        values = [p.arrays[len(full) + j] for p in parts]
        cache.values = _join(values, depth, capacity, stream=side)  # beside the keys' join
        cache.offset = depth


def receive(pool: PoolShape, layout: Mapping[str, Any], shadow: SlotState) -> list[Part]:
    """The shadow's full layers as fresh (lazy) buffers at the recorded capacity, and one
    Part per block whose arrays are views of the rows it will fill."""
    dtype = DTYPES[pool.layout.dtype][0]
    for (layer, _), shape in zip(_full(pool), _shapes(pool, layout["capacity"]), strict=True):
        cache = shadow.cache[layer]
        if not isinstance(cache, KVCache):
            raise ShapeMismatch(f"layer {layer} cache", "KVCache", type(cache).__name__)
        cache.keys, cache.values = mx.zeros(shape, dtype=dtype), mx.zeros(shape, dtype=dtype)
        cache.offset = layout["depth"]
    return _rows(pool, layout, shadow)


def allocate(
    pool: PoolShape, snap: Snapshot, shadow: SlotState
) -> tuple[list[Part], dict[str, list[mx.array]]]:
    """For a gated cut, received: its full layers' buffers made again without their zero
    fill (engine/unfilled.py) — packed, where the cut fills their capacity; else, where
    they are large, each on its own with the rows past the depth still zeros — and its
    blocks' parts made again as views of them (none where the zero fill is kept). And
    the spans: for a cut of one block that fills the capacity, its role and the packed
    buffers, which hold its payload end to end in frame order (the intake's destination
    is then one buffer, not one row run per head and layer)."""
    capacity, dtype = snap.layout["capacity"], pool.layout.dtype
    shapes = _buffers(pool, capacity)
    if snap.depth == capacity:
        arrays, buffers = unfilled.packed(shapes, dtype)
    elif unfilled.worth_it(_nbytes(pool, shapes)):
        arrays, buffers = unfilled.unfilled(shapes, dtype, filled_rows=snap.depth), []
    else:
        return [], {}
    full = _full(pool)
    for j, (layer, _) in enumerate(full):
        shadow.cache[layer].keys, shadow.cache[layer].values = arrays[j], arrays[len(full) + j]
    parts = _rows(pool, snap.layout, shadow)
    return parts, ({parts[0].role: buffers} if len(parts) == 1 and buffers else {})


def calibrate(pool: PoolShape, nbytes: int) -> int | None:
    """Calibrate when allocate makes buffers unfilled (engine/unfilled.py), timed on this
    pool's full layers' K and V buffers at the capacity holding about `nbytes`; the
    crossover in bytes, or None for a model without full layers."""
    if not _full(pool):
        return None
    row = _nbytes(pool, _buffers(pool, 1))
    return unfilled.calibrate(_buffers(pool, max(1, nbytes // row)), pool.layout.dtype)


def _shapes(pool: PoolShape, capacity: int) -> list[tuple[int, ...]]:
    """Each full layer's K (and V) buffer shape at `capacity`, in layer order."""
    return [(1, spec.kv_heads, capacity, spec.head_dim) for _, spec in _full(pool)]


def _buffers(pool: PoolShape, capacity: int) -> list[tuple[int, ...]]:
    """Every full layer's K buffer shape at `capacity`, then every V's: a block's frame
    order, in which they are made."""
    return _shapes(pool, capacity) * 2


def _nbytes(pool: PoolShape, shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes) * DTYPES[pool.layout.dtype][1].itemsize


def _rows(pool: PoolShape, layout: Mapping[str, Any], shadow: SlotState) -> list[Part]:
    """One Part per block whose arrays are views of the rows of the shadow's full-layer
    buffers it fills: the K buffers' rows for the block, then the V buffers'. Each buffer
    is one [heads, capacity, dim] view, split once at the blocks' ends: a deep cut has
    thousands of rows, and one op per buffer, not one per row, made the demo model's
    7,936-token rows in 1.3-2.2 ms against 5.5-7.4 ms (AMD EPYC VM). Blocks that do not
    follow one another from row 0 get rows of other lengths, which the gate refuses."""
    buffers = []
    for layer, _ in _full(pool):
        keys, values = shadow.cache[layer].keys, shadow.cache[layer].values
        buffers += [keys.reshape(keys.shape[1:]), values.reshape(values.shape[1:])]
    blocks = layout["blocks"]
    ends = [e["index"] * pool.alignment + e["length"] for e in blocks]
    pieces = [mx.split(b, ends, axis=1) for b in buffers]  # K, V, K, V, ... by layer
    parts = []
    for i, e in enumerate(blocks):
        rows = [p[i] for p in pieces[0::2]] + [p[i] for p in pieces[1::2]]
        parts.append(Part(e["role"], tuple(rows), {"index": e["index"], "length": e["length"]}))
    return parts


def segments(pool: PoolShape, parts: Sequence[Part], shadow: SlotState) -> list[list[memoryview]]:
    """Where each received block's payload goes, in frame order: each full layer's K then
    V rows for the block, head by head (a [heads, capacity, dim] buffer holds a head's
    rows contiguously). Each buffer's bytes are viewed once, for all the blocks."""
    full = _full(pool)
    buffers = [shadow.cache[i].keys for i, _ in full] + [shadow.cache[i].values for i, _ in full]
    views = []  # (the buffer's bytes, heads, capacity, bytes per row)
    for buf in buffers:
        _, heads, capacity, dim = buf.shape
        views.append((memoryview(buf).cast("B"), heads, capacity, dim * buf.itemsize))
    out = []
    for part in parts:
        lo, n = part.fields["index"] * pool.alignment, part.fields["length"]
        out.append([flat[(h * capacity + lo) * row : (h * capacity + lo + n) * row]
                    for flat, heads, capacity, row in views for h in range(heads)])  # fmt: skip
    return out


def _join(
    blocks: list[mx.array], depth: int, capacity: int, *, stream: mx.Stream | None = None
) -> mx.array:
    """Concatenate [heads, n, dim] blocks along the sequence and pad with zeros to the
    recorded capacity, as mlx-lm's KVCache would have allocated it (on `stream`, else
    the thread's default)."""
    if capacity > depth:
        heads, _, dim = blocks[0].shape
        pad = mx.zeros((heads, capacity - depth, dim), dtype=blocks[0].dtype, stream=stream)
        blocks = [*blocks, pad]
    joined = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=1, stream=stream)
    return mx.expand_dims(joined, 0, stream=stream)
