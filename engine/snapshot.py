"""Snapshot: a cut of one slot, as planes.

- Block: the planes of every full-attention layer for tokens [i*A, i*A + length): one K and
  one V array per full layer, each [kv_heads, length, head_dim]. length is A except for the
  final block of a non-aligned cut. Equal prefixes give equal blocks, so blocks dedup.
- Ring: the ring state of one sliding-window layer exactly as it lies in memory — its K/V
  buffers [kv_heads, size, head_dim] in their current rotation, `offset` (tokens seen),
  `idx` (the next write position), `window` (mlx-lm's max_size) and `keep`. Restore puts
  the buffers back unrotated, because attention sums in buffer order and a different
  rotation would change the bits.
- Snapshot: identity digest, depth, alignment, `capacity` (the length the full layers'
  buffers were allocated to; mlx-lm grows them in steps of 256), the blocks, the rings,
  and the logits plane ([vocab]) when the final logits were witnessed.

Arrays are slices of the live cache, evaluated: views, not copies. MLX arrays are values —
a later write into the slot's cache replaces the cache's buffer rather than the one a
snapshot still references — so a snapshot stays valid while the slot goes on decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.errors import EmptySlot, EngineError


@dataclass(frozen=True)
class Block:
    index: int
    length: int
    keys: tuple[mx.array, ...]  # one per full-attention layer, in layer order
    values: tuple[mx.array, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))


@dataclass(frozen=True)
class Ring:
    layer: int
    keys: mx.array  # [kv_heads, size, head_dim], in memory order (rotated)
    values: mx.array
    offset: int
    idx: int
    window: int
    keep: int

    @property
    def size(self) -> int:
        return int(self.keys.shape[1])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass(frozen=True)
class Snapshot:
    identity: bytes
    depth: int
    alignment: int
    capacity: int
    blocks: tuple[Block, ...]
    rings: tuple[Ring, ...]
    logits: mx.array | None  # [vocab]; present only when witnessed

    @property
    def aligned(self) -> bool:
        return self.depth % self.alignment == 0

    @property
    def logits_witnessed(self) -> bool:
        return self.logits is not None

    @property
    def nbytes(self) -> int:
        total = sum(b.nbytes for b in self.blocks) + sum(r.nbytes for r in self.rings)
        return total + (self.logits.nbytes if self.logits is not None else 0)

    def arrays(self) -> list[mx.array]:
        out = [a for b in self.blocks for a in (*b.keys, *b.values)]
        out += [a for r in self.rings for a in (r.keys, r.values)]
        return out + ([self.logits] if self.logits is not None else [])


def snapshot(slot) -> Snapshot:
    """The slot's current cut, block by block; raises EmptySlot on a fresh slot."""
    engine = slot.engine
    with slot.lock:
        state = slot.state
        depth = len(state.tokens)
        if depth == 0:
            raise EmptySlot(slot.index, "snapshot")
        layers = engine.layout.layers
        full = [c for c, spec in zip(state.cache, layers, strict=True) if not spec.sliding]
        capacities = {int(c.keys.shape[2]) for c in full}
        if len(capacities) > 1 or any(c.offset != depth for c in state.cache):
            # Every layer sees the same updates; anything else is a bug, not a cut.
            raise EngineError(f"slot {slot.index}: layers disagree on depth or capacity")
        step = engine.alignment
        spans = [(lo, min(depth, lo + step)) for lo in range(0, depth, step)]
        blocks = tuple(
            Block(
                index=i,
                length=hi - lo,
                keys=tuple(c.keys[0, :, lo:hi, :] for c in full),
                values=tuple(c.values[0, :, lo:hi, :] for c in full),
            )
            for i, (lo, hi) in enumerate(spans)
        )
        rings = tuple(
            Ring(
                layer=i,
                keys=c.keys[0],
                values=c.values[0],
                offset=int(c.offset),
                idx=int(c._idx),
                window=int(c.max_size),
                keep=int(c.keep),
            )
            for i, (c, spec) in enumerate(zip(state.cache, layers, strict=True))
            if spec.sliding
        )
        snap = Snapshot(
            identity=engine.identity.digest,
            depth=depth,
            alignment=engine.alignment,
            capacity=capacities.pop() if capacities else 0,
            blocks=blocks,
            rings=rings,
            logits=state.logits,
        )
        mx.eval(snap.arrays())
        return snap
