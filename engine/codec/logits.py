"""Logits: the cache kind of the witnessed final logits; part kind "logits".

- logits: the row of the final position after the last forward over exactly the cut's
  history, [vocab] in the model's logits dtype. Present only when witnessed: a cut
  without them may serve as an aligned ancestor, never as an exact hit (invariant 3,
  checked by restore before any kind's gate).
- the logits part: one array, no fields. Layout key "logits": {"role": "logits",
  "vocab": n}, None when the logits were not witnessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from engine.codec.checks import entry, expect
from engine.errors import PlanesInvalid
from engine.layout import dtype_name
from engine.state import LOGITS, Part, PoolShape, SlotState, Snapshot

KIND = LOGITS


def export(pool: PoolShape, state: SlotState) -> tuple[dict[str, Any], list[Part]]:
    if state.logits is None:
        return {"logits": None}, []
    layout = {"role": KIND, "vocab": int(state.logits.shape[0])}
    return {"logits": layout}, [Part(KIND, (state.logits,), {})]


def entries(layout: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    if not isinstance(layout, Mapping) or KIND not in layout:
        raise PlanesInvalid(None, "layout has no logits entry")
    if layout[KIND] is None:
        return []
    recorded = entry(layout["logits"], "vocab")
    return [(recorded["role"], recorded)]


def decode(role: str, layout_entry: Mapping[str, Any], header: Mapping, arrays: list) -> Part:
    if len(arrays) != 1:
        raise PlanesInvalid(role, f"expected one logits array, got {len(arrays)}")
    return Part(role, (arrays[0],), {})


def gate(pool: PoolShape, snap: Snapshot, parts: Sequence[Part]) -> None:
    recorded = snap.layout["logits"]
    expect("logits parts", 0 if recorded is None else 1, len(parts))
    if not parts:
        return
    (part,) = parts
    expect("logits arrays", 1, len(part.arrays))
    (logits,) = part.arrays
    expect("logits vocab", pool.vocab_size, recorded["vocab"])
    expect("logits shape", (pool.vocab_size,), tuple(logits.shape))
    expect("logits dtype", dtype_name(pool.logits_dtype), dtype_name(logits.dtype))


def install(pool: PoolShape, snap: Snapshot, parts: Sequence[Part], shadow: SlotState) -> None:
    shadow.logits = parts[0].arrays[0] if parts else None


def receive(pool: PoolShape, layout: Mapping[str, Any], shadow: SlotState) -> list[Part]:
    """A fresh (lazy) logits row in the shadow, and its Part, when the layout has logits."""
    listed = entries(layout)
    if not listed:
        return []
    role, recorded = listed[0]
    shadow.logits = mx.zeros((recorded["vocab"],), dtype=pool.logits_dtype)
    return [Part(role, (shadow.logits,), {})]


def segments(pool: PoolShape, parts: Sequence[Part], shadow: SlotState) -> list[list[memoryview]]:
    """Where the received logits go: the shadow's row."""
    assert shadow.logits is not None
    return [[memoryview(shadow.logits).cast("B")] for _ in parts]  # type: ignore[arg-type]  # no __buffer__ in stubs
