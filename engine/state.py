"""State: a cut of one slot, in memory (Snapshot) and as bytes (Planes); a slot's state.

- part: one piece of a cut, named by its role: "block/<i>" (every full-attention layer's
  K/V for tokens [i*A, i*A + length)), "ring" (every sliding-window layer's buffers as
  they lie in memory) or "logits" (the witnessed final logits, [vocab]). A role's kind is
  the text before "/"; each kind has one codec module (engine/codec/).
- part digest: the digest a part's frame carries (engine/codec/frame.py: BLAKE3 of its
  header and payload), on a Part that came from a frame — decoded, or landed in an
  intake — and None on one exported from a live slot. Equal digests are equal parts, so
  a holder can intern parts by it without hashing them again.
- layout: the JSON-able description of a cut that the vault keeps in the signed manifest:
  the head — "format", "identity" (hex), "depth", "alignment" — then what each kind
  records: "capacity" and "blocks" (one entry per block part), "ring" (each sliding
  layer's offset, write index, window, keep and size) and "logits" (its vocab), None
  when absent.
- Snapshot: a cut in memory — identity digest, depth, alignment, layout and the parts in
  encode order (blocks, ring, logits). Its arrays are evaluated views of the live cache,
  not copies: MLX arrays are values, so a later write into the slot replaces the cache's
  buffer and never the one a snapshot references — but it keeps that buffer alive, the
  capacity a full layer's cache has beyond the cut included. Built by `Slot.export`, by
  an intake or decoded from Planes (engine/format.py), which all give a well-formed
  layout; treat it as read-only.
- source: a cut whose layout is verified and whose bytes are still to be read
  (engine/intake.py's Source): Slot.restore makes an intake for it and lets it fill it.
- Planes: a cut as bytes — the layout and one encoded part (a frame, engine/codec/frame.py)
  per role. What the vault stores: the layout in the manifest, one chunk per part.

  `verified` says the bytes were checked against a content digest before they got here
  (the durable tier's chunks are tag-verified and re-hashed by cas): decode then skips
  each frame's own digest, which exists for bytes nobody has verified.
- SlotState: one session's caches, token history and witnessed logits (a slot holds one
  and a restore swaps in another; engine/slots.py).
- pool shape: what a cut is checked against and installed into — the identity,
  alignment, KV layout and logits of the model a slot pool runs (SlotPool is one).
- part buffer: writable bytes in MLX memory (`part_buffer`), for a reader to fill with
  one part. A part given as a whole part buffer decodes without a copy: its arrays are
  views of the buffer (where each array is naturally aligned in it; one copy into MLX
  otherwise), so its bytes must not change once decoded.

These are data; turning one into another is the codec's (engine/codec/, behind
engine/format.py and Slot.export / Slot.restore). Encoding is the one copy out of MLX
memory; decoding copies in at most once. Parts and Snapshots compare (and hash) by
identity — comparing arrays elementwise has no single truth value; Planes, being bytes,
compare by value.

Copies per byte from the object store to the slot, on the durable read path:
- into an intake (engine/intake.py: Slot.intake, cas ChunkStore.get_into with its
  segments, Slot.restore): 1 from a local directory — the copy of each run, decrypted
  (from the file's mapped pages in the page cache) and re-hashed in a run buffer, into
  the slot's own cache buffers (cas/seal.py Opening); 0 for a run that one segment holds
  whole (a cut of one block that fills its capacity lands in one packed buffer,
  engine/codec/blocks.py allocate): decrypted into it and re-hashed there; 2 from S3
  (first the kernel's read of the socket into cas's scratch buffer; 1 for such a run);
  on S3 through a proxy 4 (two more inside the HTTP client, counted in cas/chunks.py).
  Nothing is decoded or joined afterwards.
- through part buffers (ChunkStore.get_into into part_buffer()s, verified Planes,
  Slot.restore): as above into the part buffers, then 0 to decode (views), and 1 more for
  a block's bytes when install joins the blocks into the KV cache at its capacity (mlx-lm's
  KVCache is one buffer per layer); ring and logits bytes none (the cache holds views of
  the part buffer), and 1 more for an array not naturally aligned in its frame (the frame
  header's length decides; MLX views must be aligned to their dtype). Local: block bytes
  2, ring and logits bytes 1; S3 one more each, through a proxy three more.
The durable tier restores through an intake (kvpack/tiers/durable.py's CutReader).

Copies per byte in the resident tier (kvpack/tiers/resident.py), which holds Snapshots:
holding Planes decodes each part it does not hold yet once (1, into MLX; 0 for a part
held already, named by its part digest); holding the Snapshot a durable hit installed
copies each such part once (1, off the response path: its arrays are views of the slot's
buffers, which it must not keep alive). A resident hit copies block bytes once (install
joins them into the KV cache) and ring and logits bytes not at all; nothing is decoded
or hashed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from engine.errors import PlanesInvalid
from engine.identity import PACK_FORMAT_VERSION

if TYPE_CHECKING:
    from engine.identity import Identity
    from engine.layout import KVLayout

FORMAT = PACK_FORMAT_VERSION  # a new encoding is a new identity
LOGITS = "logits"  # the part kind (and layout key) of the witnessed logits


@dataclass(frozen=True, eq=False)
class Part:
    """One piece of a cut in memory: role "block/<i>", "ring" or "logits"."""

    role: str
    arrays: tuple[mx.array, ...]  # evaluated
    fields: Mapping[str, Any]  # the part header's fields (index/length, layers...)
    digest: bytes | None = None  # its frame's digest, when it came from a frame

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
        """The cut's final logits; None when they were not witnessed."""
        return next((p.arrays[0] for p in self.parts if p.kind == LOGITS), None)

    @property
    def logits_witnessed(self) -> bool:
        return self.logits is not None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def arrays(self) -> list[mx.array]:
        return [a for p in self.parts for a in p.arrays]


@dataclass(frozen=True)
class Planes:
    """A cut as bytes: what the vault stores (layout in the manifest, one chunk per part)."""

    layout: Mapping[str, Any]
    parts: tuple[tuple[str, bytes | memoryview], ...]  # (role, part bytes)
    verified: bool = field(default=False, compare=False)  # checked against a content digest

    @property
    def identity(self) -> bytes:
        return head(self.layout)[0]

    @property
    def depth(self) -> int:
        return head(self.layout)[1]

    @property
    def logits_witnessed(self) -> bool:
        """Whether the layout records witnessed logits; PlanesInvalid when it cannot say."""
        if not isinstance(self.layout, Mapping) or LOGITS not in self.layout:
            raise PlanesInvalid(None, "layout has no logits entry")
        return self.layout[LOGITS] is not None

    @property
    def nbytes(self) -> int:
        return sum(memoryview(data).nbytes for _, data in self.parts)


def head(layout: Mapping[str, Any]) -> tuple[bytes, int, int]:
    """(identity digest, depth, alignment) of a layout; PlanesInvalid when it is malformed
    or of another format."""
    if not isinstance(layout, Mapping) or layout.get("format") != FORMAT:
        got = layout.get("format") if isinstance(layout, Mapping) else type(layout).__name__
        raise PlanesInvalid(None, f"unsupported plane format {got!r} (this engine reads {FORMAT})")
    for key in ("depth", "alignment"):
        value = layout.get(key)
        if not isinstance(value, int) or isinstance(value, bool):  # bool is no int here
            raise PlanesInvalid(None, f"{key} must be an int, got {value!r}")
    try:
        identity = bytes.fromhex(layout["identity"])
    except (KeyError, TypeError, ValueError) as e:
        raise PlanesInvalid(None, f"malformed identity: {e!r}") from e
    return identity, layout["depth"], layout["alignment"]


def part_buffer(nbytes: int) -> memoryview:
    """`nbytes` writable bytes in MLX memory, for one part's bytes (see the module words).
    It runs an MLX op: call it on the thread that runs MLX, then let any thread write."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"a part buffer needs a size >= 0, got {nbytes!r}")
    buf = mx.zeros((nbytes,), dtype=mx.uint8)  # a fresh buffer of its own, never shared
    mx.eval(buf)
    return memoryview(buf)  # type: ignore[arg-type]  # mlx stubs lack __buffer__


def mlx_bytes(data: bytes | memoryview) -> mx.array | None:
    """The MLX array `data` spans when it is all of a part buffer, else None."""
    if not isinstance(data, memoryview) or not data.contiguous:
        return None
    base = data.obj
    if not isinstance(base, mx.array) or base.dtype != mx.uint8 or base.ndim != 1:
        return None
    return base if data.nbytes == base.nbytes else None


@dataclass
class SlotState:
    """cache, history and witnessed logits of one session; `logits` None = not witnessed.

    `cold` says the state is exactly what a cold aligned prefill of `tokens` computes: only
    such states may be published as cuts. Decoding ends it (a decoded token's K/V differ in
    the last bits from the same token prefilled), and so does prefilling on from a
    non-aligned depth (a cold run would have taken that block in one step)."""

    cache: list[Any]
    tokens: list[int]
    logits: mx.array | None
    cold: bool = True

    def arrays(self) -> list[mx.array]:
        kv = [a for c in self.cache if c.keys is not None for a in (c.keys, c.values)]
        return kv + ([self.logits] if self.logits is not None else [])


class PoolShape(Protocol):
    """What a cut is checked against and installed into (engine/slots.py's SlotPool)."""

    identity: Identity
    layout: KVLayout
    vocab_size: int
    logits_dtype: mx.Dtype

    @property
    def alignment(self) -> int: ...

    def fresh_state(self) -> SlotState: ...

    def check_tokens(self, tokens: Sequence[int]) -> list[int]: ...
