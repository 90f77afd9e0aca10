"""Rings: the cache kind of sliding-window layers (mlx-lm RotatingKVCache); part kind "ring".

- ring: one sliding layer's K/V buffers [kv_heads, size, head_dim] exactly as they lie in
  memory — in their current rotation — with `offset` (tokens seen), `idx` (the next write
  position), `window` (mlx-lm's max_size), `keep` (leading positions never evicted) and
  `size` (the buffer length).
- the ring part: every sliding layer's K then V, layer by layer ([K, V, K, V, ...]);
  field `layers` (their indices). One part for all rings: they change with every token.
- layout key "ring": {"role": "ring", "layers": [{layer, offset, idx, window, keep,
  size}]}, None for a model without sliding layers.

Install puts the buffers back unrotated: attention sums in buffer order, so another
rotation of the same positions would change the bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from engine.codec.checks import entry, expect, integers, listed
from engine.codec.frame import DTYPES
from engine.errors import PlanesInvalid, ShapeMismatch
from engine.layout import LayerKV, dtype_name
from engine.state import Part, PoolShape, SlotState, Snapshot

KIND = "ring"
RING_FIELDS = ("layer", "offset", "idx", "window", "keep", "size")


def _sliding(pool: PoolShape) -> list[tuple[int, LayerKV]]:
    return [(i, spec) for i, spec in enumerate(pool.layout.layers) if spec.kind == "sliding"]


def export(pool: PoolShape, state: SlotState) -> tuple[dict[str, Any], list[Part]]:
    layers = [i for i, _ in _sliding(pool)]
    if not layers:
        return {"ring": None}, []
    caches = [state.cache[i] for i in layers]
    arrays = tuple(a for c in caches for a in (c.keys[0], c.values[0]))
    rings = [
        {
            "layer": i,
            "offset": int(c.offset),
            "idx": int(c._idx),
            "window": int(c.max_size),
            "keep": int(c.keep),
            "size": int(c.keys.shape[2]),
        }
        for i, c in zip(layers, caches, strict=True)
    ]
    return {"ring": {"role": KIND, "layers": rings}}, [Part(KIND, arrays, {"layers": layers})]


def entries(layout: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    if layout.get("ring") is None:
        return []
    ring = entry(layout["ring"])
    for r in listed(ring["role"], ring.get("layers")):
        if not isinstance(r, Mapping):
            raise PlanesInvalid(ring["role"], f"ring layer entry {r!r} is not a mapping")
        integers(ring["role"], r, RING_FIELDS)
    return [(ring["role"], ring)]


def decode(role: str, layout_entry: Mapping[str, Any], header: Mapping, arrays: list) -> Part:
    layers = [r["layer"] for r in layout_entry["layers"]]
    if header.get("layers") != layers or len(arrays) != 2 * len(layers):
        raise PlanesInvalid(role, "ring part does not match the layout's ring layers")
    return Part(role, tuple(arrays), {"layers": layers})


def gate(pool: PoolShape, snap: Snapshot, parts: Sequence[Part]) -> None:
    sliding = _sliding(pool)
    recorded = snap.layout["ring"]
    rings = list(recorded["layers"]) if recorded is not None else []
    expect("ring layers", [i for i, _ in sliding], [r["layer"] for r in rings])
    expect("ring parts", 1 if sliding else 0, len(parts))
    if not sliding:
        return
    (part,) = parts
    expect("ring part layers", [i for i, _ in sliding], list(part.fields.get("layers", ())))
    expect("ring arrays (K and V per sliding layer)", 2 * len(sliding), len(part.arrays))
    for n, (ring, (_, spec)) in enumerate(zip(rings, sliding, strict=True)):
        keys, values = part.arrays[2 * n], part.arrays[2 * n + 1]
        _gate_ring(ring, spec, keys, values, snap.depth, snap.alignment, pool.layout.dtype)


def _gate_ring(
    ring: Mapping[str, int],
    spec: LayerKV,
    keys: mx.array,
    values: mx.array,
    depth: int,
    alignment: int,
    dtype: str,
) -> None:
    where = f"ring of layer {ring['layer']}"
    window, keep, size, idx = spec.window or 0, ring["keep"], ring["size"], ring["idx"]
    expect(f"{where} window", window, ring["window"])
    expect(f"{where} keep", spec.keep, keep)
    expect(f"{where} offset", depth, ring["offset"])
    for kv, arr in (("K", keys), ("V", values)):
        expect(f"{where} {kv} shape", (spec.kv_heads, size, spec.head_dim), tuple(arr.shape))
        expect(f"{where} {kv} dtype", dtype, dtype_name(arr.dtype))
    # The buffer holds at least the window (or every token, before it fills) and at most
    # window - 1 + one aligned step (mlx-lm's multi-token update keeps window - 1 and appends).
    lo, hi = min(depth, window), max(window - 1 + alignment, window)
    if not lo <= size <= hi:
        raise ShapeMismatch(f"{where} size", f"[{lo}, {hi}]", size)
    if depth <= size:
        # Not wrapped yet: the next write goes right after the last token.
        expect(f"{where} write index", depth, idx)
    elif size < window or not keep < idx <= size:
        raise ShapeMismatch(f"{where} write index", f"({keep}, {size}]", idx)


def install(pool: PoolShape, snap: Snapshot, parts: Sequence[Part], shadow: SlotState) -> None:
    if not parts:
        return
    (part,) = parts
    for n, ring in enumerate(snap.layout["ring"]["layers"]):
        cache = shadow.cache[ring["layer"]]
        if not isinstance(cache, RotatingKVCache):
            raise ShapeMismatch(
                f"layer {ring['layer']} cache", "RotatingKVCache", type(cache).__name__
            )
        # New handles over the ring buffers ([None] adds the batch axis): a later in-place
        # write into the slot replaces these, never the snapshot's arrays.
        cache.keys, cache.values = part.arrays[2 * n][None], part.arrays[2 * n + 1][None]
        cache.offset, cache._idx = ring["offset"], ring["idx"]
        cache.max_size, cache.keep = ring["window"], ring["keep"]


def receive(pool: PoolShape, layout: Mapping[str, Any], shadow: SlotState) -> list[Part]:
    """The shadow's sliding layers as fresh (lazy) buffers of the recorded sizes and
    positions, and the ring Part whose arrays are those buffers (no batch axis)."""
    recorded = layout["ring"]
    if recorded is None:
        return []
    dtype = DTYPES[pool.layout.dtype][0]
    sliding = _sliding(pool)
    expect("ring layers", [i for i, _ in sliding], [r["layer"] for r in recorded["layers"]])
    arrays = []
    for ring, (layer, spec) in zip(recorded["layers"], sliding, strict=True):
        cache = shadow.cache[layer]
        if not isinstance(cache, RotatingKVCache):
            raise ShapeMismatch(f"layer {layer} cache", "RotatingKVCache", type(cache).__name__)
        shape = (1, spec.kv_heads, ring["size"], spec.head_dim)
        cache.keys, cache.values = mx.zeros(shape, dtype=dtype), mx.zeros(shape, dtype=dtype)
        cache.offset, cache._idx = ring["offset"], ring["idx"]
        cache.max_size, cache.keep = ring["window"], ring["keep"]
        arrays += [cache.keys.reshape(shape[1:]), cache.values.reshape(shape[1:])]
    layers = [r["layer"] for r in recorded["layers"]]
    return [Part(recorded["role"], tuple(arrays), {"layers": layers})]


def segments(pool: PoolShape, parts: Sequence[Part], shadow: SlotState) -> list[list[memoryview]]:
    """Where each received ring's payload goes: each sliding layer's K then V buffer, whole."""
    out = []
    for part in parts:
        caches = [shadow.cache[layer] for layer in part.fields["layers"]]
        out.append([memoryview(b).cast("B") for c in caches for b in (c.keys, c.values)])
    return out
