"""Export: a vault serving its own sealed cuts to trusted peers (read-only).

What a peer may ask (the HTTP routes are kvpack/server/peers.py's):
- find (identity, token-chain links, min depth): the deepest cut for that identity and
  chain deeper than min depth, as a signed statement (catalog/statement.py), or None.
  The peer sends chain links, never token ids. The answer also carries, outside what is
  signed, the manifest id (to fetch the planes by), the size and the depth: hints the
  importer uses to rank and fetch, then checks against the signed statement.
- planes (manifest id): the cut's parts, concatenated in the statement's order.

Only cuts this vault computed itself (provenance "local") whose stored envelope
carries a valid signature by one of this vault's keys are exported: an imported cut is
never re-exported under this vault's name. A key scoped to one namespace sees only
identities salted with that namespace; anything else is "not found". Every cut is
loaded through the vault, so its MAC and every chunk are verified before a byte leaves.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Any

from catalog.chain import TokenChain
from catalog.ids import IdentityDigest, ManifestId
from catalog.manifest import encode_body
from catalog.publish import LoadedCut, next_generation
from catalog.queries import Cut
from catalog.scope import Scope
from catalog.signing import EXPORT_DOMAIN, MANIFEST_DOMAIN, ProducerKeys, SignatureInvalid, verify
from catalog.statement import Statement, claims_for, encode
from kvpack.vault import Vault

log = logging.getLogger(__name__)
ALL_NAMESPACES = "*"


@dataclass(frozen=True)
class Answer:
    statement: bytes
    signature: bytes
    manifest: ManifestId
    size: int
    depth: int

    def to_json(self) -> dict[str, Any]:
        return {
            "statement": base64.b64encode(self.statement).decode(),
            "signature": base64.b64encode(self.signature).decode(),
            "manifest": self.manifest.hex,
            "size": self.size,
            "depth": self.depth,
        }


class Exporter:
    def __init__(self, vault: Vault) -> None:
        self.vault = vault

    @property
    def keys(self) -> ProducerKeys:
        return self.vault.producer_keys  # rotation replaces it

    def find(
        self, *, identity: IdentityDigest, chain: TokenChain, min_depth: int, scope: str
    ) -> Answer | None:
        """The signed statement of the deepest exportable cut, or None. `scope` is the
        namespace the caller's key may read ("*": every namespace)."""
        local = self._scope(identity, scope, chain.alignment)
        if local is None:
            return None
        cut = self.vault.find(local, chain, deeper_than=min_depth)
        loaded = None if cut is None else self._load(cut, local)
        if loaded is None:
            return None
        m = loaded.manifest
        statement = Statement(
            identity=m.identity,
            depth=m.depth,
            alignment=m.alignment,
            chain=m.chain,
            logits_witnessed=m.logits_witnessed,
            layout=m.layout,
            parts=claims_for(loaded.parts),
            producer=self.keys.producer,
            generation=next_generation(),
            manifest=m.id,
        )
        body = encode(statement)
        return Answer(body, self.keys.sign(EXPORT_DOMAIN, body), m.id, statement.size, m.depth)

    def planes(self, *, manifest_id: ManifestId, scope: str) -> bytes | None:
        cut = self.vault.get_cut(manifest_id)
        local = None if cut is None else self._scope(cut.identity, scope, None)
        loaded = None if cut is None or local is None else self._load(cut, local)
        return None if loaded is None else b"".join(data for _, data in loaded.parts)

    def _scope(self, identity: IdentityDigest, scope: str, alignment: int | None) -> Scope | None:
        """The scope of a known identity the caller may read (and of our alignment)."""
        components = self.vault.identity_components(identity) or {}
        namespace, ours = components.get("namespace"), components.get("alignment")
        if not isinstance(namespace, str) or scope not in (ALL_NAMESPACES, namespace):
            return None
        if not isinstance(ours, int) or (alignment is not None and alignment != ours):
            return None
        return Scope(identity, namespace, ours)

    def _load(self, cut: Cut, scope: Scope) -> LoadedCut | None:
        """The verified cut, only if this vault computed and signed it."""
        if cut.provenance != "local":
            return None
        loaded = self.vault.load(cut, scope)
        try:
            verify(self.keys.public_keys(), MANIFEST_DOMAIN, encode_body(loaded.manifest),
                   loaded.signature)  # fmt: skip
        except SignatureInvalid as e:
            log.warning("not exporting %s: %s", cut.manifest_id, e)
            return None
        return loaded
