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
  `verified` says the bytes were checked against a content digest before they got here
  (the durable tier's chunks are tag-verified and re-hashed by cas): decode then skips
  each frame's own digest, which exists for bytes nobody has verified.
- part buffer: writable bytes in MLX memory (`part_buffer`), for a reader to fill with
  one part. A part given as a whole part buffer decodes without a copy: its arrays are
  views of the buffer (where each array is naturally aligned in it; one copy into MLX
  otherwise), so its bytes must not change once decoded.

`Snapshot.planes()` is the one copy out of MLX memory; `Planes.decode()` copies in at
most once. Parts and Snapshots compare (and hash) by identity — comparing arrays
elementwise has no single truth value; Planes, being bytes, compare by value.

Copies per byte from the object store to the slot, on the durable read path:
- into an intake (engine/intake.py: Slot.intake, cas ChunkStore.get_into with its
  segments, Slot.restore): local directory 2 — the kernel's read into cas's scratch
  buffer, the decryption straight into the slot's own cache buffers (the re-hash reads
  them, copying nothing); S3 3 (socket to aiohttp's buffer, then into the scratch
  buffer, then the decryption). Nothing is decoded or joined afterwards.
- through part buffers (ChunkStore.get_into into part_buffer()s, verified Planes,
  Slot.restore): as above into the part buffers, then 0 to decode (views), and 1 more for
  a block's bytes when install joins the blocks into the KV cache at its capacity (mlx-lm's
  KVCache is one buffer per layer); ring and logits bytes none (the cache holds views of
  the part buffer), and 1 more for an array not naturally aligned in its frame (the frame
  header's length decides; MLX views must be aligned to their dtype). Local: block bytes
  3, ring and logits bytes 2; S3 one more each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
    verified: bool = field(default=False, compare=False)  # checked against a content digest

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


def part_buffer(nbytes: int) -> memoryview:
    """`nbytes` writable bytes in MLX memory, for one part's bytes (see the module words).
    It runs an MLX op: call it on the thread that runs MLX, then let any thread write."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"a part buffer needs a size >= 0, got {nbytes!r}")
    buf = mx.zeros((nbytes,), dtype=mx.uint8)  # a fresh buffer of its own, never shared
    mx.eval(buf)
    return memoryview(buf)


def mlx_bytes(data: bytes | memoryview) -> mx.array | None:
    """The MLX array `data` spans when it is all of a part buffer, else None."""
    if not isinstance(data, memoryview) or not data.contiguous:
        return None
    base = data.obj
    if not isinstance(base, mx.array) or base.dtype != mx.uint8 or base.ndim != 1:
        return None
    return base if data.nbytes == base.nbytes else None


def _codec() -> Any:
    # The codec builds these types, so it is imported when used, not when they are defined.
    from engine import codec

    return codec
