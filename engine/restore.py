"""Restore: install a Snapshot into a slot — shadow, gate, evaluate, swap (invariant 5).

- mode "exact": the cut is the whole request (depth == len(tokens)) and decoding continues
  from its logits, so the logits must have been witnessed (invariant 3; LogitsMissing).
- mode "ancestor": an aligned cut (depth % A == 0) of a longer request; the caller then
  prefills the rest in aligned steps. Logits are installed when present, not required.
- shape gate: before anything is built, the snapshot is checked against the engine — the
  identity first, then alignment, depth, layers, heads, head dim, dtype, the full layers'
  capacity, each ring's window, keep, offset, write index and size, and the logits' shape.
- shadow: fresh cache objects (from the model's own factory) that nothing decodes from,
  filled layer by layer; the full layers get their blocks joined at the recorded capacity
  and the rings get their buffers back in the same rotation; then every array is evaluated.
- swap: the slot takes the prepared SlotState in one reference assignment. Anything that
  fails before it leaves the slot exactly as it was and raises a RestoreRefused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine.errors import (
    IdentityMismatch,
    InstallFailed,
    InvalidRequest,
    LogitsMissing,
    RestoreRefused,
    ShapeMismatch,
)
from engine.layout import LayerKV, dtype_name
from engine.slots import Slot, SlotState
from engine.snapshot import Ring, Snapshot

Mode = Literal["exact", "ancestor"]


def restore(slot: Slot, snapshot: Snapshot, *, tokens: Sequence[int], mode: Mode) -> None:
    """Make `slot` hold `snapshot` with history `tokens` (its first `depth` tokens, which
    the caller has matched to the cut's token chain). Raises a RestoreRefused, with the
    slot unchanged, when the snapshot does not fit or cannot be built."""
    engine = slot.engine
    if mode not in ("exact", "ancestor"):
        raise InvalidRequest("mode", f"must be 'exact' or 'ancestor', got {mode!r}")
    history = engine.check_tokens(tokens)
    gate(engine, snapshot, depth=len(history), mode=mode)
    try:
        state = build_shadow(engine, snapshot, history)
    except RestoreRefused:
        raise
    except Exception as e:  # noqa: BLE001 - any failure before the swap is a refusal
        raise InstallFailed("shadow", e) from e
    with slot.lock:
        slot.commit(state)


# -- the gate ----------------------------------------------------------------------------
def gate(engine: Any, snap: Snapshot, *, depth: int, mode: Mode) -> None:
    """Refuse a snapshot that does not fit the engine, the depth or the mode."""
    if snap.identity != engine.identity.digest:
        raise IdentityMismatch(engine.identity.digest, snap.identity)
    _expect("alignment", engine.alignment, snap.alignment)
    _expect("depth (tokens given)", depth, snap.depth)
    if snap.depth <= 0:
        raise ShapeMismatch("depth", "> 0", snap.depth)
    if mode == "exact" and snap.logits is None:
        raise LogitsMissing(snap.depth)
    if mode == "ancestor" and not snap.aligned:
        raise RestoreRefused(
            f"ancestor cut at depth {snap.depth} is not aligned to {snap.alignment}"
        )
    layers = engine.layout.layers
    dtype = engine.layout.dtype
    full = [spec for spec in layers if not spec.sliding]
    _gate_blocks(snap, full, dtype)
    if full:
        # mlx-lm grows a full layer's buffer in steps; a depth it has not reached, or more
        # than one step of slack, is not a state a KVCache can be in.
        if not snap.depth <= snap.capacity < snap.depth + KVCache.step:
            raise ShapeMismatch(
                "capacity", f"[{snap.depth}, {snap.depth + KVCache.step})", snap.capacity
            )
    else:
        _expect("capacity", 0, snap.capacity)
    sliding = [i for i, spec in enumerate(layers) if spec.sliding]
    _expect("ring layers", sliding, [r.layer for r in snap.rings])
    for ring in snap.rings:
        _gate_ring(ring, layers[ring.layer], snap.depth, engine.alignment, dtype)
    if snap.logits is not None:
        _expect("logits shape", (engine.vocab_size,), tuple(snap.logits.shape))
        _expect("logits dtype", dtype_name(engine.logits_dtype), dtype_name(snap.logits.dtype))


def _gate_blocks(snap: Snapshot, full: list[LayerKV], dtype: str) -> None:
    count = -(-snap.depth // snap.alignment)
    _expect("block count", count, len(snap.blocks))
    for i, block in enumerate(snap.blocks):
        length = min(snap.alignment, snap.depth - i * snap.alignment)
        _expect(f"block {i} index", i, block.index)
        _expect(f"block {i} length", length, block.length)
        _expect(f"block {i} layers", (len(full), len(full)), (len(block.keys), len(block.values)))
        for j, spec in enumerate(full):
            shape = (spec.kv_heads, length, spec.head_dim)
            for kind, arr in (("K", block.keys[j]), ("V", block.values[j])):
                _expect(f"block {i} full layer #{j} {kind} shape", shape, tuple(arr.shape))
                _expect(f"block {i} full layer #{j} {kind} dtype", dtype, dtype_name(arr.dtype))


def _gate_ring(ring: Ring, spec: LayerKV, depth: int, alignment: int, dtype: str) -> None:
    where = f"ring of layer {ring.layer}"
    window = spec.window or 0
    _expect(f"{where} window", window, ring.window)
    _expect(f"{where} keep", spec.keep, ring.keep)
    _expect(f"{where} offset", depth, ring.offset)
    size = ring.size
    for kind, arr in (("K", ring.keys), ("V", ring.values)):
        _expect(f"{where} {kind} shape", (spec.kv_heads, size, spec.head_dim), tuple(arr.shape))
        _expect(f"{where} {kind} dtype", dtype, dtype_name(arr.dtype))
    # The buffer holds at least the window (or every token, before it fills) and at most
    # window - 1 + one aligned step (mlx-lm's multi-token update keeps window - 1 and appends).
    lo, hi = min(depth, window), max(window - 1 + alignment, window)
    if not lo <= size <= hi:
        raise ShapeMismatch(f"{where} size", f"[{lo}, {hi}]", size)
    if depth <= size:
        # Not wrapped yet: the next write goes right after the last token.
        _expect(f"{where} write index", depth, ring.idx)
    elif size < window or not ring.keep < ring.idx <= size:
        raise ShapeMismatch(f"{where} write index", f"({ring.keep}, {size}]", ring.idx)


def _expect(what: str, expected: object, got: object) -> None:
    if expected != got:
        raise ShapeMismatch(what, expected, got)


# -- the shadow --------------------------------------------------------------------------
def build_shadow(engine: Any, snap: Snapshot, history: list[int]) -> SlotState:
    """Fresh caches filled from the snapshot and evaluated; nothing else references them."""
    cache = engine.loaded.make_cache()
    rings = {r.layer: r for r in snap.rings}
    full_index = 0
    for i, (c, spec) in enumerate(zip(cache, engine.layout.layers, strict=True)):
        if spec.sliding:
            install_layer(c, i, ring=rings[i])
        else:
            keys = [b.keys[full_index] for b in snap.blocks]
            values = [b.values[full_index] for b in snap.blocks]
            install_layer(c, i, blocks=(keys, values), depth=snap.depth, capacity=snap.capacity)
            full_index += 1
    logits = snap.logits
    mx.eval(
        *(a for c in cache for a in (c.keys, c.values)), *([logits] if logits is not None else [])
    )
    return SlotState(cache=cache, tokens=list(history), logits=logits)


def install_layer(
    cache: Any,
    layer: int,
    *,
    ring: Ring | None = None,
    blocks: tuple[list[mx.array], list[mx.array]] | None = None,
    depth: int = 0,
    capacity: int = 0,
) -> None:
    """Fill one shadow cache object (a module-level function so tests can fail it mid-way)."""
    if ring is not None:
        if not isinstance(cache, RotatingKVCache):
            raise ShapeMismatch(f"layer {layer} cache", "RotatingKVCache", type(cache).__name__)
        # New handles over the ring buffers ([None] adds the batch axis): a later in-place
        # write into the slot replaces these, never the snapshot's arrays.
        cache.keys, cache.values = ring.keys[None], ring.values[None]
        cache.offset, cache._idx = ring.offset, ring.idx
        cache.max_size, cache.keep = ring.window, ring.keep
        return
    if not isinstance(cache, KVCache) or blocks is None:
        raise ShapeMismatch(f"layer {layer} cache", "KVCache", type(cache).__name__)
    cache.keys = _join(blocks[0], depth, capacity)
    cache.values = _join(blocks[1], depth, capacity)
    cache.offset = depth


def _join(parts: list[mx.array], depth: int, capacity: int) -> mx.array:
    """Concatenate [heads, n, dim] blocks along the sequence and pad with zeros to the
    recorded capacity, as mlx-lm's KVCache would have allocated it."""
    if capacity > depth:
        heads, _, dim = parts[0].shape
        parts = [*parts, mx.zeros((heads, capacity - depth, dim), dtype=parts[0].dtype)]
    joined = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    return joined[None]
