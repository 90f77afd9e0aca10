"""Intake: a cut's bytes landing straight in the slot state they become.

- intake: for a cut's layout (from a verified manifest) and a pool, the shadow SlotState
  the cut will be — its full layers' caches at the recorded capacity, its rings at their
  recorded sizes and positions, its logits row — gated like any cut before anything is
  allocated, and for every part its destinations: the segments of the shadow's own
  buffers its frame's bytes belong in, in frame order (engine/codec/: each kind's
  `receive` and `segments`).
- frame head: a frame's prefix and header (engine/codec/frame.py). The intake knows it
  before the bytes arrive — it is what the engine itself writes for the gated arrays — so
  the head lands in a small buffer and must then match exactly. The frame digest lands in
  another and is not checked: an intake takes only bytes verified against a content
  digest (cas re-hashes every chunk it returns). Once restored, the intake's Snapshot
  carries each part's landed digest (engine/state.py's part digest).
- source: a cut whose layout comes from a verified manifest and whose bytes are still in
  the store (the vault's durable reader is one): `layout`, `depth`, and `fill(intake)`,
  which reads every part straight into `intake.destinations(...)`, verified, or raises.
  `Slot.restore(source)` and engine.interop.to_mlx_lm make the intake on their own
  thread, let the source fill it, then restore it; a source that raises leaves the slot
  as it was. The intake allocates its buffers at the first `destinations` call, which a
  source makes on the calling thread once its fetch is under way: the allocation
  overlaps the fetch (kvpack/vault.py read_cut).

Flow: `intake = slot.intake(layout)` on the thread that runs MLX (it gates the layout);
`intake.destinations(parts)` on that thread too (it allocates); a reader fills them from
any thread (cas ChunkStore.get_into with segments); then `slot.restore(intake,
prompt=...)` checks every head and swaps the shadow in, once. Nothing is decoded,
joined or copied after the open: copies per byte from the store to the slot are 1 from
a local directory (the copy of the bytes, decrypted from the file's mapped pages into a
run buffer and hashed there, into the slot's cache; 0 for the runs of a part whose
destination is one buffer, a cut of one block that fills its capacity: decrypted
straight into it, cas/seal.py Opening), 2 from S3 (first the kernel's read of the socket
into cas's scratch buffer; 1 for those runs), 4 on S3 through a proxy (cas/chunks.py
counts them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx

from engine import codec
from engine.codec import frame
from engine.errors import PlanesInvalid, RestoreRefused
from engine.restore import gate
from engine.state import PoolShape, SlotState, Snapshot


class Source(Protocol):
    """A verified cut's layout and a reader for its bytes (see the module words)."""

    @property
    def layout(self) -> Mapping[str, Any]: ...

    @property
    def depth(self) -> int: ...

    def fill(self, intake: Intake) -> None: ...


class Intake:
    """The shadow of one cut and where each of its parts' bytes go; used by one restore."""

    def __init__(self, pool: PoolShape, layout: Mapping[str, Any]) -> None:
        self.pool = pool
        self._shadow: SlotState | None = pool.fresh_state()
        snap = codec.receive(pool, layout, self._shadow)
        # A cut without logits serves only as an aligned ancestor; the request's own mode
        # is checked again by restore.
        gate(pool, snap, depth=snap.depth, mode="exact" if snap.logits_witnessed else "ancestor")
        self.snapshot = snap
        self._heads: dict[str, tuple[bytes, memoryview]] = {}
        self._segments: dict[str, list[memoryview]] = {}

    def _allocate(self) -> None:
        """The shadow's buffers (the largest without a zero fill: codec.allocate) and
        each part's segments, once (on the thread running MLX): a part's spanning
        buffers where it has them, else the views its kind makes."""
        if self._segments or self._shadow is None:
            return
        self.snapshot, spans = codec.allocate(self.pool, self.snapshot, self._shadow)
        mx.eval([*self._shadow.arrays(), *(b for span in spans.values() for b in span)])
        parts = self.snapshot.parts
        rest = [p for p in parts if p.role not in spans]
        made = codec.segments(self.pool, rest, self._shadow)
        views = dict(zip([p.role for p in rest], made, strict=True))
        for part in parts:
            span = spans.get(part.role)
            segments = _flat(span) if span else views[part.role]
            expected = frame.head(part.kind, part.arrays, **part.fields)
            landed = memoryview(bytearray(len(expected) + frame.DIGEST_SIZE))
            self._heads[part.role] = (expected, landed)
            self._segments[part.role] = [landed, *segments]

    def evaluate_parts(self) -> None:
        """Evaluate the parts' arrays while their bytes land (on the thread running MLX,
        after `destinations`): they are slices of the shadow's buffers, which MLX makes
        as views, so no byte of theirs is read — and `take`, after the last byte, has
        nothing left to evaluate (one array per full layer's K and V per block)."""
        self._allocate()
        mx.eval([a for p in self.snapshot.parts for a in p.arrays])

    @property
    def taken(self) -> bool:
        """Whether a restore took the shadow (then `snapshot` carries the parts' digests)."""
        return self._shadow is None

    @property
    def roles(self) -> list[str]:
        return [p.role for p in self.snapshot.parts]

    def destinations(self, parts: Sequence[tuple[str, int]]) -> list[list[memoryview]]:
        """The segments each (role, size) part fills, in the order given; PlanesInvalid
        unless the parts are exactly the layout's and each has the size its frame needs.
        The first call allocates the shadow's buffers: make it on the thread running MLX."""
        self._allocate()
        if sorted(role for role, _ in parts) != sorted(self._segments):
            got = [role for role, _ in parts]
            raise PlanesInvalid(None, f"parts {got} do not match the layout's {self.roles}")
        out = []
        for role, size in parts:
            segments = self._segments[role]
            needed = sum(s.nbytes for s in segments)
            if size != needed:
                raise PlanesInvalid(role, f"part has {size} bytes, its frame needs {needed}")
            out.append(segments)
        return out

    def take(self, pool: PoolShape) -> tuple[Snapshot, SlotState]:
        """The filled shadow, once, after checking every part's head; PlanesInvalid when a
        part is not the frame the engine expects or the intake never made its destinations,
        RestoreRefused on reuse or another pool."""
        if pool is not self.pool:
            raise RestoreRefused("intake was made for another slot pool")
        shadow, self._shadow = self._shadow, None
        if shadow is None:
            raise RestoreRefused("intake already restored")
        if not self._segments:  # refused without allocating the shadow's buffers for it
            raise PlanesInvalid(None, "intake was never filled (no destinations were made)")
        heads, self._heads, self._segments = self._heads, {}, {}  # the slot's, from now on
        for role, (expected, landed) in heads.items():
            if landed[: len(expected)] != expected:
                raise PlanesInvalid(role, "part is not the frame this engine expects here")
        parts = tuple(
            dataclasses.replace(p, digest=bytes(heads[p.role][1][-frame.DIGEST_SIZE :]))
            for p in self.snapshot.parts
        )
        self.snapshot = dataclasses.replace(self.snapshot, parts=parts)
        # The parts are views of the filled buffers, evaluated on the thread that runs MLX
        # so that any thread may read them: here, unless evaluate_parts already did.
        mx.eval(self.snapshot.arrays())
        return self.snapshot, shadow


def _flat(buffers: Sequence[mx.array]) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in buffers]  # type: ignore[arg-type]  # mlx stubs lack __buffer__


def read(pool: PoolShape, source: Source) -> tuple[Snapshot, SlotState]:
    """A source's cut as a filled, checked shadow: the intake made here (on the thread
    that runs MLX), filled by the source, taken. Whatever the source raises propagates
    and the intake is dropped."""
    intake = Intake(pool, source.layout)
    source.fill(intake)
    return intake.take(pool)
