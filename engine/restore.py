"""Restore: install a Snapshot into a slot — gate, shadow, evaluate, swap (invariant 5).

- mode "exact": the cut is the whole request (depth == len(tokens)) and decoding continues
  from its logits, so the logits must have been witnessed (invariant 3; LogitsMissing).
- mode "ancestor": an aligned cut (depth % A == 0) of a longer request; the caller then
  prefills the rest in aligned steps. Logits are installed when present, not required.
- gate: before anything is built, the snapshot is checked against the pool — here the
  generic part (identity first, then alignment, depth and mode), then each cache kind's
  gate (engine/codec/: blocks' shapes and capacity, each ring's window, keep, offset,
  write index and size, the logits' shape).
- shadow: fresh cache objects (from the model's own factory) that nothing decodes from,
  filled by each kind's install — the full layers get their blocks joined at the recorded
  capacity (keys and values at once, on two streams: engine/streams.py), the rings their
  buffers in the same rotation — then every array is evaluated.
- swap: the slot takes the prepared SlotState in one reference assignment. Anything that
  fails before it leaves the slot exactly as it was and raises a RestoreRefused.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal, Protocol

import mlx.core as mx

from engine import codec
from engine.errors import (
    IdentityMismatch,
    InstallFailed,
    InvalidRequest,
    LogitsMissing,
    RestoreRefused,
    ShapeMismatch,
)
from engine.state import PoolShape, SlotState, Snapshot

Mode = Literal["exact", "ancestor"]


class Target(Protocol):
    """A slot to restore into (engine/slots.py's Slot)."""

    @property
    def pool(self) -> PoolShape: ...

    @property
    def lock(self) -> threading.RLock: ...

    def commit(self, state: SlotState) -> None: ...


def restore(
    slot: Target,
    snapshot: Snapshot,
    *,
    tokens: Sequence[int],
    mode: Mode,
    shadow: SlotState | None = None,
) -> None:
    """Make `slot` hold `snapshot` with history `tokens` (its first `depth` tokens, which
    the caller has matched to the cut's token chain). `shadow`: the state already built
    in place from the snapshot's bytes (engine/intake.py), else it is built here. Raises a
    RestoreRefused, with the slot unchanged, when the snapshot does not fit or cannot be
    built."""
    pool = slot.pool
    if mode not in ("exact", "ancestor"):
        raise InvalidRequest("mode", f"must be 'exact' or 'ancestor', got {mode!r}")
    history = pool.check_tokens(tokens)
    gate(pool, snapshot, depth=len(history), mode=mode)
    if shadow is None:
        state = build_shadow(pool, snapshot, history)
    else:
        state = shadow
        state.tokens = list(history)
    with slot.lock:
        slot.commit(state)


def gate(pool: PoolShape, snap: Snapshot, *, depth: int, mode: Mode) -> None:
    """Refuse a snapshot that does not fit the pool, the depth or the mode."""
    if snap.identity != pool.identity.digest:
        raise IdentityMismatch(pool.identity.digest, snap.identity)
    if pool.alignment != snap.alignment:
        raise ShapeMismatch("alignment", pool.alignment, snap.alignment)
    if depth != snap.depth:
        raise ShapeMismatch("depth (tokens given)", depth, snap.depth)
    if snap.depth <= 0:
        raise ShapeMismatch("depth", "> 0", snap.depth)
    if mode == "exact" and not snap.logits_witnessed:
        raise LogitsMissing(snap.depth)
    if mode == "ancestor" and not snap.aligned:
        raise RestoreRefused(
            f"ancestor cut at depth {snap.depth} is not aligned to {snap.alignment}"
        )
    codec.gate(pool, snap)


def build_shadow(pool: PoolShape, snap: Snapshot, history: list[int]) -> SlotState:
    """Fresh caches filled from a gated snapshot and evaluated; nothing else references
    them. Any failure is a RestoreRefused (InstallFailed unless it already is one)."""
    try:
        shadow = pool.fresh_state()
        shadow.tokens = list(history)
        codec.install(pool, snap, shadow)
        mx.eval(shadow.arrays())
    except RestoreRefused:
        raise
    except Exception as e:  # noqa: BLE001 - any failure before the swap is a refusal
        raise InstallFailed("shadow", e) from e
    return shadow
