"""Codec: how a slot's state becomes a cut (Snapshot), bytes (Planes) and a shadow again.
Private to the engine: callers use Slot.export, Slot.restore and engine/format.py.

- cache kind: one kind of state a slot holds, with one module here and one entry in
  KINDS (in encode order): blocks (full-attention layers, part kind "block"), rings
  (sliding-window layers, "ring"), logits (the witnessed final logits, "logits").
- head: the layout keys every cut has — "format" (FORMAT, the pack format version),
  "identity" (hex digest), "depth", "alignment"; each kind adds its own keys after them.

The contract of a kind module (adding a cache kind, say an SSM state or a quantized KV
cache, is one such module plus one entry in KINDS):
- KIND: its part kind, the text before "/" in its parts' roles.
- export(pool, state) -> (layout keys, parts): its share of a live slot's cut, as views
  of the cache (this module evaluates them).
- entries(layout) -> [(role, entry)]: the layout entries of its parts; PlanesInvalid
  unless every field it will read is there and well typed.
- decode(role, entry, header, arrays) -> Part: one decoded frame, checked against its
  layout entry; PlanesInvalid when they disagree.
- gate(pool, snapshot, parts) -> None: ShapeMismatch unless its parts and layout keys fit
  the pool's model at the snapshot's depth and alignment. It checks everything install
  reads, so install cannot fail on a gated cut.
- install(pool, snapshot, parts, shadow) -> None: fill the shadow SlotState (the caches
  of its layers, or its logits) from gated parts.
- receive(pool, layout, shadow) -> [Part]: the other way to fill a shadow (an intake,
  engine/intake.py): put fresh, still lazy buffers for the layout's parts in the shadow
  and return Parts whose arrays are views of them, so that the gate runs before anything
  is allocated.
- segments(pool, part, shadow) -> [memoryview]: where a received part's payload goes in
  the (now evaluated) shadow, in frame order.

What is generic lives here: the head, the match of parts to the layout, the frames
(engine/codec/frame.py) and export's check that every layer is at the slot's depth. The
generic restore checks (identity, alignment, depth, mode) live in engine/restore.py.
Decoding never lets the data choose code: kinds come from KINDS, dtypes from frame.DTYPES.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx

from engine.codec import blocks, frame, logits, rings
from engine.errors import EngineError, PlanesInvalid, ShapeMismatch
from engine.state import FORMAT, Part, Planes, PoolShape, SlotState, Snapshot, head


class CacheKind(Protocol):
    KIND: str

    def export(self, pool: PoolShape, state: SlotState) -> tuple[dict[str, Any], list[Part]]: ...

    def entries(self, layout: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]: ...

    def decode(
        self, role: str, layout_entry: Mapping[str, Any], header: Mapping, arrays: list
    ) -> Part: ...

    def gate(self, pool: PoolShape, snap: Snapshot, parts: Sequence[Part]) -> None: ...

    def install(
        self, pool: PoolShape, snap: Snapshot, parts: Sequence[Part], shadow: SlotState
    ) -> None: ...

    def receive(
        self, pool: PoolShape, layout: Mapping[str, Any], shadow: SlotState
    ) -> list[Part]: ...

    def segments(
        self, pool: PoolShape, parts: Sequence[Part], shadow: SlotState
    ) -> list[list[memoryview]]: ...


KINDS: dict[str, CacheKind] = {kind.KIND: kind for kind in (blocks, rings, logits)}


def export(pool: PoolShape, state: SlotState) -> Snapshot:
    """The cut of a slot's state (not empty): evaluated views, no copies."""
    depth = len(state.tokens)
    offsets = {int(c.offset) for c in state.cache}
    if offsets != {depth}:
        # Every layer sees the same updates; anything else is a bug, not a cut.
        raise EngineError(f"layers at depths {sorted(offsets)} for a history of {depth}")
    identity = pool.identity
    layout: dict[str, Any] = {
        "format": FORMAT,
        "identity": identity.hex,
        "depth": depth,
        "alignment": pool.alignment,
    }
    parts: list[Part] = []
    for kind in KINDS.values():
        keys, kind_parts = kind.export(pool, state)
        layout.update(keys)
        parts += kind_parts
    mx.eval([a for p in parts for a in p.arrays])
    return Snapshot(identity.digest, depth, pool.alignment, layout, tuple(parts))


def encode(snap: Snapshot) -> Planes:
    """One frame per part, in the snapshot's order; the layout travels as it is."""
    return Planes(snap.layout, tuple((p.role, _frame(p)) for p in snap.parts))


def _frame(part: Part) -> bytes:
    return frame.encode_part(part.kind, part.arrays, **part.fields)


class Encoder:
    """`encode` for the successive cuts of one cold prefill, each block encoded once.

    A whole block (length A) of a cold prefill never changes once its tokens are
    prefilled, so its frame is kept and given again for every later cut that lists it;
    everything else (the final short block, the ring, the logits) is encoded anew. A kept
    frame is reused only when its prefix and header (kind, fields, every array's dtype
    and shape) are what this cut's part would get. A cut of another identity or
    alignment, or a shallower one (the slot was reset), starts afresh. Not thread-safe:
    one thread encodes with it at a time."""

    def __init__(self) -> None:
        self._scope: tuple[bytes, int] | None = None  # (identity, alignment) of the kept
        self._depth = 0
        self._kept: dict[str, bytes] = {}  # role -> frame of a whole block
        self.encoded = self.reused = 0  # parts encoded / given again from _kept

    def encode(self, snap: Snapshot) -> Planes:
        """Equal, byte for byte, to `encode(snap)`."""
        if self._scope != (snap.identity, snap.alignment) or snap.depth < self._depth:
            self._kept.clear()
            self._scope = (snap.identity, snap.alignment)
        self._depth = snap.depth
        parts = []
        for part in snap.parts:
            data = self._kept.get(part.role)
            if data is not None and data.startswith(
                frame.head(part.kind, part.arrays, **part.fields)
            ):
                self.reused += 1
            else:
                data = _frame(part)
                self.encoded += 1
                if part.kind == blocks.KIND and part.fields.get("length") == snap.alignment:
                    self._kept[part.role] = data
            parts.append((part.role, data))
        return Planes(snap.layout, tuple(parts))


Reuse = Callable[[str, bytes], Part | None]  # (role, frame digest) -> a Part held already


def decode(planes: Planes, *, reuse: Reuse | None = None) -> Snapshot:
    """The Snapshot that `encode` produced; PlanesInvalid / PlaneCorrupt on anything else.
    Parts come back in the layout's order, whatever order they were given in, each with
    its frame's digest. `reuse(role, digest)`: a part decoded before from a frame with
    that digest, taken instead of decoding this one (equal digests, equal frames)."""
    identity, depth, alignment = head(planes.layout)
    owners: dict[str, tuple[CacheKind, Mapping[str, Any]]] = {}
    for kind in KINDS.values():
        for role, entry in kind.entries(planes.layout):
            if role in owners:
                raise PlanesInvalid(role, "listed twice in the layout")
            owners[role] = (kind, entry)
    given = [role for role, _ in planes.parts]
    if sorted(given) != sorted(owners) or len(set(given)) != len(given):
        raise PlanesInvalid(None, f"parts {given} do not match the layout's {sorted(owners)}")
    decoded: dict[str, Part] = {}
    for role, data in planes.parts:
        kind, entry = owners[role]
        name = role.split("/", 1)[0]
        if name not in KINDS:
            raise PlanesInvalid(role, f"unknown part kind {name!r}")
        if name != kind.KIND:
            raise PlanesInvalid(role, f"a {name!r} part where the layout lists {kind.KIND!r}")
        digest = frame.digest_of(role, data)
        known = reuse(role, digest) if reuse is not None else None
        if known is not None and known.role == role:
            decoded[role] = known
            continue
        header, arrays = frame.decode_part(role, data, verified=planes.verified)
        if header.get("kind") != name:
            raise PlanesInvalid(role, f"part is a {header.get('kind')!r}, role says {name!r}")
        decoded[role] = dataclasses.replace(kind.decode(role, entry, header, arrays), digest=digest)
    parts = tuple(decoded[role] for role in owners)
    return Snapshot(identity, depth, alignment, planes.layout, parts)


def _of_kind(snap: Snapshot, kind: str) -> tuple[Part, ...]:
    return tuple(p for p in snap.parts if p.kind == kind)


def gate(pool: PoolShape, snap: Snapshot) -> None:
    """Each kind's gate over its parts; a part of no registered kind is refused."""
    for part in snap.parts:
        if part.kind not in KINDS:
            raise ShapeMismatch(f"{part.role} kind", f"one of {sorted(KINDS)}", part.kind)
    for name, kind in KINDS.items():
        kind.gate(pool, snap, _of_kind(snap, name))


def install(pool: PoolShape, snap: Snapshot, shadow: SlotState) -> None:
    """Each kind fills its share of the shadow from a gated snapshot."""
    for name, kind in KINDS.items():
        kind.install(pool, snap, _of_kind(snap, name), shadow)


def receive(pool: PoolShape, layout: Mapping[str, Any], shadow: SlotState) -> Snapshot:
    """Fresh lazy buffers in `shadow` for a cut with `layout`, as a Snapshot of views of
    them (not gated yet); PlanesInvalid when the layout is malformed."""
    identity, depth, alignment = head(layout)
    for kind in KINDS.values():
        kind.entries(layout)  # every field receive reads is there and well typed
    parts: list[Part] = []
    for kind in KINDS.values():
        try:
            parts += kind.receive(pool, layout, shadow)
        except ValueError as e:  # an impossible size in the layout
            raise PlanesInvalid(None, f"{kind.KIND}: {e}") from e
    return Snapshot(identity, depth, alignment, layout, tuple(parts))


def allocate(
    pool: PoolShape, snap: Snapshot, shadow: SlotState
) -> tuple[Snapshot, dict[str, list[mx.array]]]:
    """A received, gated cut with its largest buffers made again (blocks.allocate:
    without a zero fill where that pays) and its parts over them; evaluating the shadow
    makes the rest. And the spans: each part whose payload lies whole in a few buffers,
    end to end in frame order, with those buffers (its destination, in place of
    `segments`)."""
    made, spans = blocks.allocate(pool, snap, shadow)
    found = {p.role: p for p in made}
    return dataclasses.replace(snap, parts=tuple(found.get(p.role, p) for p in snap.parts)), spans


def segments(pool: PoolShape, parts: Sequence[Part], shadow: SlotState) -> list[list[memoryview]]:
    """Where each received part's payload goes, in frame order; parts in the order given.
    Each kind is asked once for all of its parts (a deep cut has thousands of buffers'
    views to make, and blocks makes each buffer's once)."""
    found: dict[str, list[memoryview]] = {}
    for name, kind in KINDS.items():
        mine = [p for p in parts if p.kind == name]
        if mine:
            found.update(
                zip([p.role for p in mine], kind.segments(pool, mine, shadow), strict=True)
            )
    return [found[p.role] for p in parts]


def calibrate(pool: PoolShape, nbytes: int) -> int | None:
    """Measure from how many bytes allocate makes a cut's largest buffers without a zero
    fill on this machine (blocks.calibrate); the crossover, or None where nothing is."""
    return blocks.calibrate(pool, nbytes)
