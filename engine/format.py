"""The engine's plane format, from outside: a Snapshot to Planes and back.

The vault stores what `encode` returns and hands back what it stored; `decode` is
strict (PlanesInvalid / PlaneCorrupt on anything `encode` would not have written).
Shapes are checked against a model later, by the restore's gate (Slot.restore). How a
cut is laid out is the codec's business (engine/codec/, private to the engine).

`encode` is the one copy out of MLX memory; `decode` the one copy in. An `Encoder`
encodes the successive cuts of one cold prefill (a cut at every aligned boundary) with
each whole block copied once: its Planes equal `encode`'s byte for byte, and the work per
cut is the new block(s), the ring and the logits, not the whole prefix.
"""

from __future__ import annotations

from engine import codec
from engine.state import Planes, Snapshot

Encoder = codec.Encoder


def encode(snapshot: Snapshot) -> Planes:
    """One frame per part, in the snapshot's order; the layout travels as it is."""
    return codec.encode(snapshot)


def decode(planes: Planes, *, reuse: codec.Reuse | None = None) -> Snapshot:
    """The Snapshot that `encode` produced; PlanesInvalid / PlaneCorrupt otherwise. Each
    part carries its frame's digest; `reuse(role, digest)` may hand back a part decoded
    before from an equal frame, which is then not decoded again."""
    return codec.decode(planes, reuse=reuse)
