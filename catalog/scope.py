"""Scope: whose state a lookup or a publish is about, as one value.

- scope: (identity, namespace, alignment). The identity digest already covers the
  namespace and the alignment (both are components of it); the scope carries them
  beside it because the catalog needs them apart: the namespace keys chunk ids
  (cas ChunkStore), the alignment cuts the token chain. kvpack builds a scope once
  from the engine's identity; nothing passes the three separately.
- components: what the identity digest was made of (model, tokenizer, layout, ...),
  recorded with the identity's catalog row on its first publish. Not part of the
  scope's equality: the digest already is.
- model: the name the model was loaded as ("smollm2", a directory, a repo id), recorded
  with the identity beside its components (`kvpack vault forget --model`, the stats).
  Not a component: naming a model differently does not change its state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from catalog.chain import TokenChain, token_chain
from catalog.ids import IdentityDigest


@dataclass(frozen=True, slots=True)
class Scope:
    identity: IdentityDigest
    namespace: str
    alignment: int
    components: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    model: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.identity, IdentityDigest):
            raise ValueError(f"scope identity must be an IdentityDigest, got {self.identity!r}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError(f"scope namespace must be a non-empty string: {self.namespace!r}")
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int):
            raise ValueError(f"scope alignment must be an int: {self.alignment!r}")
        if self.alignment < 1:
            raise ValueError(f"scope alignment must be positive: {self.alignment}")

    def chain(self, tokens: Sequence[int]) -> TokenChain:
        """The token chain of `tokens` under this scope's alignment."""
        return token_chain(tokens, alignment=self.alignment)

    def __str__(self) -> str:
        return f"{self.identity.short}/{self.namespace}/A={self.alignment}"
