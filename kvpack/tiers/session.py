"""The session tier: a tenant's live slots (docs/architecture.md: step 3, first rung).

- tenant: one namespace's pool of engine slots over the shared weights. Its identity is
  the model's identity salted with the namespace, so every lookup it makes is scoped to
  it and another tenant's state is unreachable (invariant 1). `scope` is that identity
  as the catalog and the tiers take it.
- session continuation: a slot whose history is a prefix of the request (equal only with
  witnessed logits) continues where it is. It is never a hit and has its own counter
  (invariant 4); the ladder checks it before asking any tier.
- LRU slot: the slot a request that does not continue a session takes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from catalog.ids import IdentityDigest
from catalog.scope import Scope
from engine.identity import Identity
from engine.slots import Slot, SlotPool


def scope_of(identity: Identity, *, model: str | None = None) -> Scope:
    """The catalog's view of an engine identity (namespace and alignment read from it),
    with the name its model was loaded as."""
    digest = IdentityDigest(identity.digest)
    return Scope(
        digest, identity.namespace, identity.alignment, components=identity.components,
        model=model,
    )  # fmt: skip


@dataclass
class Tenant:
    pool: SlotPool
    _ticks: dict[int, int] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.scope = scope_of(self.pool.identity, model=self.pool.loaded.name)

    @property
    def identity(self) -> Identity:
        return self.pool.identity

    @property
    def namespace(self) -> str:
        return self.scope.namespace

    def touch(self, slot: Slot) -> None:
        self._ticks[slot.index] = next(self._clock)

    def lru_slot(self) -> Slot:
        return min(self.pool.slots, key=lambda s: self._ticks.get(s.index, -1))

    def session_slot(self, tokens: Sequence[int]) -> Slot | None:
        """The deepest slot whose history is a prefix of `tokens` (equal: logits witnessed)."""
        best = None
        for slot in self.pool.slots:
            history = slot.tokens
            if not history or len(history) > len(tokens):
                continue
            if len(history) == len(tokens) and not slot.logits_witnessed:
                continue
            if tuple(tokens[: len(history)]) == history and (
                best is None or slot.depth > best.depth
            ):
                best = slot
        return best
