"""State: a cut of one slot, in memory (Snapshot) and as bytes (Planes); a slot's state.

- part: one piece of a cut, named by its role: "block/<i>" (every full-attention layer's
  K/V for tokens [i*A, i*A + length)), "ring" (every sliding-window layer's buffers as
  they lie in memory) or "logits" (the witnessed final logits, [vocab]). A role's kind is
  the text before "/"; each kind has one codec module (engine/codec/).
- layout: the JSON-able description of a cut that the vault keeps in the signed manifest:
  the head — "format", "identity" (hex), "depth", "alignment" — then what each kind
  records: "capacity" and "blocks" (one entry per block part), "ring" (each sliding
  layer's offset, write index, window, keep and size) and "logits" (its vocab), None
  when absent.
- Snapshot: a cut in memory — identity digest, depth, alignment, layout and the parts in
  encode order (blocks, ring, logits). Its arrays are evaluated views of the live cache,
  not copies: MLX arrays are values, so a later write into the slot replaces the cache's
  buffer and never the one a snapshot references. Built by `Slot.export` or decoded from
  Planes (engine/format.py), which both give a well-formed layout; treat it as read-only.
- Planes: a cut as bytes — the layout and one encoded part (a frame, engine/codec/frame.py)
  per role. What the vault stores: the layout in the manifest, one chunk per part.
- SlotState: one session's caches, token history and witnessed logits (a slot holds one
  and a restore swaps in another; engine/slots.py).
- pool shape: what a cut is checked against and installed into — the identity,
  alignment, KV layout and logits of the model a slot pool runs (SlotPool is one).

These are data; turning one into another is the codec's (engine/codec/, behind
engine/format.py and Slot.export / Slot.restore). Parts and Snapshots compare (and
hash) by identity — comparing arrays elementwise has no single truth value; Planes,
being bytes, compare by value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
