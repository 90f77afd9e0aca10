"""Export statements: what a vault tells a peer about one of its cuts, signed.

Words (see docs/architecture.md, request step 3):
- statement: a producer's signed claim "after these tokens, under this identity, the
  state is these parts": the cut's identity, depth, alignment, chain digest,
  logits witnessed, engine layout, and per part (a PartClaim) its role, size and
  BLAKE3 digest of the plaintext. Chunk ids are keyed per vault, so a peer could not
  check them; the plaintext digest is what it checks the bytes it receives against.
  (The body's JSON key for the parts is "planes", as in kvpack-export-v1.)
- generation: 64-bit, drawn from the producer's monotonic clock when the statement
  is issued (catalog.publish.next_generation). The importer keeps the newest it
  accepted per producer and identity and refuses an older or equal one, so a
  recorded answer replayed later, or a stale one, is refused (docs/architecture.md, invariant 10).
- body: sorted-key compact JSON; a body that does not re-encode to itself is
  refused. The signature slot (catalog/signing.py, EXPORT_DOMAIN) covers the body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from catalog.errors import ManifestInvalid
from catalog.ids import ChainDigest, IdentityDigest, ManifestId
from catalog.manifest import MAX_GENERATION, MAX_PRODUCER

FORMAT = "kvpack-export-v1"
_KEYS = frozenset(
    [
        "alignment",
        "chain",
        "depth",
        "format",
        "generation",
        "identity",
        "layout",
        "logits_witnessed",
        "manifest",
        "planes",
        "producer",
    ]
)


class StatementInvalid(ManifestInvalid):
    """A statement body that is not a well-formed, canonical export statement."""


@dataclass(frozen=True)
class PartClaim:
    role: str
    size: int
    digest: bytes  # BLAKE3 of the plaintext

    def matches(self, data: bytes | memoryview) -> bool:
        return len(data) == self.size and blake3.blake3(data).digest() == self.digest


@dataclass(frozen=True)
class Statement:
    identity: IdentityDigest
    depth: int
    alignment: int
    chain: ChainDigest
    logits_witnessed: bool
    layout: Mapping[str, Any]
    parts: tuple[PartClaim, ...]
    producer: str
    generation: int
    manifest: ManifestId  # the producer's manifest id (names its planes for the fetch)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def aligned(self) -> bool:
        return self.depth % self.alignment == 0


def claims_for(parts: Sequence[tuple[str, bytes | memoryview]]) -> tuple[PartClaim, ...]:
    return tuple(PartClaim(role, len(data), blake3.blake3(data).digest()) for role, data in parts)


def encode(s: Statement) -> bytes:
    doc = {
        "format": FORMAT,
        "identity": s.identity.hex,
        "depth": s.depth,
        "alignment": s.alignment,
        "chain": s.chain.hex,
        "logits_witnessed": s.logits_witnessed,
        "layout": s.layout,
        "planes": [{"role": p.role, "size": p.size, "digest": p.digest.hex()} for p in s.parts],
        "producer": s.producer,
        "generation": s.generation,
        "manifest": s.manifest.hex,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode(body: bytes) -> Statement:
    """Strictly decode a body; StatementInvalid names the first thing wrong."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise StatementInvalid(f"statement is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StatementInvalid(f"not a {FORMAT} statement")
    if set(doc) != _KEYS:
        raise StatementInvalid(f"fields {sorted(set(doc) ^ _KEYS)} unexpected or missing")
    try:
        parts = tuple(
            PartClaim(_str(p["role"]), _count(p["size"]), _digest(p["digest"]))
            for p in _list(doc["planes"])
        )
        s = Statement(
            identity=IdentityDigest(_digest(doc["identity"])),
            depth=_count(doc["depth"], minimum=1),
            alignment=_count(doc["alignment"], minimum=1),
            chain=ChainDigest(_digest(doc["chain"])),
            logits_witnessed=_bool(doc["logits_witnessed"]),
            layout=_dict(doc["layout"]),
            parts=parts,
            producer=_str(doc["producer"], limit=MAX_PRODUCER),
            generation=_count(doc["generation"], maximum=MAX_GENERATION),
            manifest=ManifestId.from_hex(_str(doc["manifest"], limit=64)),
        )
    except (ValueError, TypeError, KeyError) as e:
        raise StatementInvalid(f"malformed statement: {e}") from None
    if not s.parts:
        raise StatementInvalid("statement names no parts")
    if encode(s) != body:
        raise StatementInvalid("statement is not in canonical encoding")
    return s


def _count(v: Any, *, minimum: int = 0, maximum: int = 2**63 - 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= maximum:
        raise ValueError(f"expected an integer in {minimum}..{maximum}, got {v!r}")
    return v


def _str(v: Any, *, limit: int = 255) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise ValueError(f"expected a string of 1..{limit} characters, got {v!r}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected a bool, got {v!r}")
    return v


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list) or not all(isinstance(p, dict) for p in v):
        raise ValueError("planes must be a list of objects")
    return v


def _dict(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError("layout must be an object")
    return v


def _digest(v: Any) -> bytes:
    raw = bytes.fromhex(_str(v, limit=64))
    if len(raw) != 32:
        raise ValueError(f"expected a 32-byte hex digest, got {v!r}")
    return raw
