"""Golden encoding: the plane byte format (format 1) pinned by digests computed from the
code that wrote the first vaults, so a vault written then keeps restoring.

- synthetic slot: tiny's own mlx-lm caches filled through `update_and_fetch` with exact,
  machine-independent values (no model compute, so no BLAS rounding), in the steps a real
  prefill and decode take: aligned blocks, a partial block, a wrapped and rotated ring.
- golden: the layout (identity aside: it carries this machine's compute fingerprint) and
  the sha256 of every part's bytes; plus single frames of the 16-bit dtypes. The golden
  planes must also decode and restore to the very cache they were cut from.
- real prompt: tiny run on a fixed prompt; its layout and part headers (shapes, lengths,
  ring metadata) are pinned too — float payloads are not, they depend on the BLAS.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx

from engine.codec import frame
from engine.format import encode
from engine.state import SlotState
from tests.engine.slotkit import cold, physical, prompt, tiny_pool

STEPS = (64, 64, 22, 1, 1, 1, 1, 1, 1, 1)  # two aligned blocks, a partial one, 7 decodes


def _values(seed: int, heads: int, n: int, dim: int) -> mx.array:
    # Small integers over 8: exact in every float format, distinct per layer, K/V, step.
    base = mx.arange(heads * n * dim, dtype=mx.float32).reshape(1, heads, n, dim)
    return (base * 3 + seed) % 97 / 8


def synthetic_slot():
    pool = tiny_pool(2)
    slot = pool.slot(0)
    cache = pool.loaded.make_cache()
    depth = 0
    for step, n in enumerate(STEPS):
        for layer, (c, spec) in enumerate(zip(cache, pool.layout.layers, strict=True)):
            seed = 1000 * step + 10 * layer
            k = _values(seed, spec.kv_heads, n, spec.head_dim)
            v = _values(seed + 5, spec.kv_heads, n, spec.head_dim)
            c.update_and_fetch(k, v)
        depth += n
    logits = mx.arange(pool.vocab_size, dtype=mx.float32) / 4 - 10
    mx.eval([a for c in cache for a in (c.keys, c.values)], logits)
    slot.commit(SlotState(cache=cache, tokens=prompt(depth), logits=logits))
    return pool, slot


def encoded(slot):
    planes = encode(slot.export())
    return dict(planes.layout), list(planes.parts)


def _ring(offset: int, idx: int, size: int) -> dict:
    return {"layer": 0, "offset": offset, "idx": idx, "window": 32, "keep": 0, "size": size}


def _layout(depth, capacity, blocks, ring_idx, ring_size):
    return {
        "format": 1,
        "depth": depth,
        "alignment": 64,
        "capacity": capacity,
        "blocks": [{"role": f"block/{i}", "index": i, "length": n} for i, n in enumerate(blocks)],
        "ring": {
            "role": "ring",
            "layers": [{**_ring(depth, ring_idx, ring_size), "layer": layer} for layer in (0, 2)],
        },
        "logits": {"role": "logits", "vocab": 261},
    }


GOLDEN_LAYOUT = _layout(157, 256, [64, 64, 29], 7, 32)  # ring rotated: idx 7 of 32
GOLDEN_PARTS = {
    "block/0": "da5bb09ebea0176e90c61b3ac473cf3383b052c15c7fb90bb7d553759a373bb0",
    "block/1": "b0009a1cd7a690e7703ac6b3f80a4e4e9f088a01a53775491efc612ae68fee2a",
    "block/2": "609d54efa63e09a58763a7a1bc43a1da2b7f3e5f8329cf788164a6e2e6e83de0",
    "ring": "a2f1b6b3810461e530c6a1ba39ca483fda8fb492b9f29362201083ce6bd2da2b",
    "logits": "6e78367d54b554e90f2d551e0c17b2d6b00213a9f7a15391277227a41771586b",
}
GOLDEN_FRAMES = {
    "float16": "097f3aca346ba9b2541536641d0d9bc82feeeb041b438dbb0d7a69d6ea3bdf10",
    "bfloat16": "b440b1496ea6b2b77847ecc75e23d1595f04928d8bea7b85d101b9346e50d7f9",
}


def test_synthetic_cut_encodes_to_the_golden_bytes():
    """Snapshot.planes: the layout dict and every part's bytes of a fixed synthetic cut are
    exactly what format 1 has always produced (digests recorded before the codec was
    restructured); the layout names this pool's identity."""
    pool, slot = synthetic_slot()
    layout, parts = encoded(slot)
    assert layout.pop("identity") == pool.identity.hex
    assert json.dumps(layout) == json.dumps(GOLDEN_LAYOUT)  # key order too
    assert [role for role, _ in parts] == list(GOLDEN_PARTS)
    digests = {role: hashlib.sha256(bytes(data)).hexdigest() for role, data in parts}
    assert digests == GOLDEN_PARTS


def test_golden_planes_restore_the_cache_they_were_cut_from():
    """Planes.decode + Slot.restore of the golden planes: the other slot ends up with the
    synthetic cache byte for byte (rotation, capacity, offsets), its history and logits."""
    pool, slot = synthetic_slot()
    other = pool.slot(1)
    other.restore(encode(slot.export()), prompt=slot.tokens)
    assert physical(other) == physical(slot)
    assert other.tokens == slot.tokens
    assert bytes(memoryview(other.logits)) == bytes(memoryview(slot.logits))


def test_16_bit_frames_encode_to_the_golden_bytes():
    """frame.encode_part for float16 and bfloat16 (bfloat16 travels as its uint16 bits): one
    frame each, pinned byte for byte."""
    got = {}
    for name, dtype in (("float16", mx.float16), ("bfloat16", mx.bfloat16)):
        a = _values(7, 2, 5, 4)[0].astype(dtype)
        b = _values(9, 2, 3, 4)[0].astype(dtype)
        got[name] = hashlib.sha256(frame.encode_part("block", [a, b], index=2, length=5))
        got[name] = got[name].hexdigest()
    assert got == GOLDEN_FRAMES


def _headers(parts):
    out = {}
    for role, data in parts:
        hlen = int.from_bytes(bytes(data[6:10]), "little")
        out[role] = json.loads(bytes(data[10 : 10 + hlen]))
    return out


def test_real_prompt_layout_and_headers_are_pinned():
    """Snapshot.planes on a real tiny run (300 prompt tokens, then 7 more prefilled): the
    layout and each part's header — block lengths, ring offsets and write indices, array
    shapes — are what format 1 writes for that history."""
    pool = tiny_pool(1)
    slot = cold(pool, prompt(300))
    slot.prefill(prompt(7, seed=2))
    layout, parts = encoded(slot)
    assert layout.pop("identity") == pool.identity.hex
    lengths = [64, 64, 64, 64, 51]
    # The 7-token step appends to the ring's window - 1 = 31 kept positions: 38, unwrapped.
    assert json.dumps(layout) == json.dumps(_layout(307, 512, lengths, 38, 38))
    assert _headers(parts) == {
        **{
            f"block/{i}": {
                "kind": "block",
                "index": i,
                "length": n,
                "arrays": [["float32", [2, n, 16]]] * 4,
            }
            for i, n in enumerate(lengths)
        },
        "ring": {"kind": "ring", "layers": [0, 2], "arrays": [["float32", [2, 38, 16]]] * 4},
        "logits": {"kind": "logits", "arrays": [["float32", [261]]]},
    }
