"""Publication: the cuts a cold prefill crosses, kept for later requests (DESIGN flow 5).

- resident: every aligned boundary the prefill crosses is held in the resident tier.
- durable: the cuts at `durable_every`-token multiples (2,048 by default), and at the
  prompt's end its exact cut (logits witnessed) and its last aligned cut, are published
  to the vault: chunks first, then the manifest object, then the catalog rows.
- only cold state is published: a session whose history holds decoded tokens has K/V
  that differ in the last bits from a cold prefill of the same tokens, so its cuts are
  never offered as if a cold run had computed them.
Encoding and storing run in the background worker, never on the response path.
"""

from __future__ import annotations

from collections.abc import Sequence

from catalog.scope import Scope
from engine.format import encode
from engine.state import Snapshot
from kvpack.background import Background
from kvpack.tiers.resident import ResidentTier
from kvpack.vault import Vault

DURABLE_EVERY = 2048


class Publication:
    def __init__(
        self,
        *,
        resident: ResidentTier,
        vault: Vault,
        background: Background,
        durable_every: int = DURABLE_EVERY,
    ) -> None:
        self.resident = resident
        self.vault = vault
        self.background = background
        self.durable_every = durable_every

    def cut(
        self, scope: Scope, tokens: Sequence[int], snap: Snapshot, *, resident: bool, durable: bool
    ) -> bool:
        """Encode `snap` (the state after `tokens`) and hold/publish it where asked;
        False when the background queue was full (the cut is lost, never the response)."""
        tokens = tuple(tokens)

        def job() -> None:
            planes = encode(snap)
            if resident:
                self.resident.hold(scope, tokens, planes)
            if durable:
                self.vault.publish(
                    scope,
                    tokens,
                    layout=planes.layout,
                    parts=planes.parts,
                    logits_witnessed=planes.logits_witnessed,
                )

        return self.background.submit(f"cut@{len(tokens)}", job)
