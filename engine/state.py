"""State: a cut of one slot, in memory (Snapshot) and as bytes (Planes).

- part: one piece of a cut, named by its role: "block/<i>" (every full-attention layer's
  K/V for tokens [i*A, i*A + length)), "ring" (every sliding-window layer's buffers as
  they lie in memory) or "logits" (the witnessed final logits, [vocab]). A role's kind is
  the text before "/"; each kind has one codec module (engine/codec/).
- layout: the JSON-able description of a cut that the vault keeps in the signed manifest:
  "format", "identity" (hex), "depth", "alignment", then what each kind records —
  "capacity" and "blocks" (one entry per block part), "ring" (each sliding layer's
  offset, write index, window, keep and size) and "logits" (its vocab), None when absent.
- Snapshot: a cut in memory — identity digest, depth, alignment, layout and the parts in
  encode order (blocks, ring, logits). Its arrays are evaluated views of the live cache,
  not copies: MLX arrays are values, so a later write into the slot replaces the cache's
  buffer and never the one a snapshot references. Built by `Slot.export` or
  `Planes.decode`, which both give a well-formed layout; treat the layout as read-only.
- Planes: a cut as bytes — the layout and one encoded part (a frame, engine/codec/frame.py)
  per role. What the vault stores: the layout in the manifest, one chunk per part.

`Snapshot.planes()` is the one copy out of MLX memory; `Planes.decode()` the one copy in.
Parts and Snapshots compare (and hash) by identity — comparing arrays elementwise has no
single truth value; Planes, being bytes, compare by value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.errors import PlanesInvalid


@dataclass(frozen=True, eq=False)
class Part:
    """One piece of a cut in memory: role "block/<i>", "ring" or "logits"."""

    role: str
    arrays: tuple[mx.array, ...]  # evaluated
    fields: Mapping[str, Any]  # the part header's fields (index/length, layers...)

    @property
    def kind(self) -> str:
        return self.role.split("/", 1)[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A cut of one slot: evaluated arrays (views of the live cache, no copies)."""

    identity: bytes  # identity digest
    depth: int
    alignment: int
    layout: Mapping[str, Any]  # the JSON layout, as Planes carries it
    parts: tuple[Part, ...]  # in encode order: blocks, ring, logits

    def __post_init__(self) -> None:
        # The scalars are also in the layout; two sources may never disagree.
        said = (self.layout.get("identity"), self.layout.get("depth"), self.layout.get("alignment"))
        if said != (self.identity.hex(), self.depth, self.alignment):
            raise PlanesInvalid(
                None,
                f"layout says identity/depth/alignment {said}, snapshot "
                f"{(self.identity.hex(), self.depth, self.alignment)}",
            )

    @property
    def aligned(self) -> bool:
        return self.depth % self.alignment == 0

    @property
    def logits(self) -> mx.array | None:
        return _codec().logits.of(self)

    @property
    def logits_witnessed(self) -> bool:
        return self.logits is not None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def arrays(self) -> list[mx.array]:
        return [a for p in self.parts for a in p.arrays]

    def planes(self) -> Planes:
        """Encode: the one copy out of MLX memory."""
        return _codec().encode(self)


@dataclass(frozen=True)
class Planes:
    """A cut as bytes: what the vault stores (layout in the manifest, one chunk per part)."""

    layout: Mapping[str, Any]
    parts: tuple[tuple[str, bytes | memoryview], ...]  # (role, part bytes)

    @property
    def identity(self) -> bytes:
        return _codec().head(self.layout)[0]

    @property
    def depth(self) -> int:
        return _codec().head(self.layout)[1]

    @property
    def logits_witnessed(self) -> bool:
        return _codec().logits.witnessed(self.layout)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(data).nbytes for _, data in self.parts)

    def decode(self) -> Snapshot:
        """Strict: PlanesInvalid / PlaneCorrupt on anything that is not what encode wrote.
        Shapes are checked against a model later, by restore's gate."""
        return _codec().decode(self)


def _codec() -> Any:
    # The codec builds these types, so it is imported when used, not when they are defined.
    from engine import codec

    return codec
