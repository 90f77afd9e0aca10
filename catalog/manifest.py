"""Manifests: the sealed, immutable description of one cut.

Words (see docs/architecture.md):
- manifest (pack): identity, depth, token-chain digest, its ordered parts, the
  engine's layout (shapes, dtypes, ring metadata), whether final logits were
  witnessed, generation and producer.
- part: one chunk of the cut as the engine encoded it (a block's planes, the
  sliding-window rings, or the logits), named by its role ("block/3", "ring",
  "logits"); a manifest lists each part as a PartRef (role, chunk id, plaintext
  size). The body keeps format 1's JSON key "planes" for that list: manifests
  sealed by earlier versions stay valid.
- body: the canonical encoding of a manifest: sorted-key compact JSON with hex
  digests and a format version. Equal manifests have equal bodies; a body
  that does not re-encode to itself is refused.
- envelope: the bytes stored in the object store. It carries the body, the
  id of the vault key that MAC'd it (HMAC-SHA256 under
  Keyring.subkey("manifest-mac")), and the producer's signature slot (Ed25519
  over MANIFEST_DOMAIN + body, catalog/signing.py; the vault that sealed it):

      magic "KVPKMAN" + envelope version (8) | mac (32) | key id length (1) |
      key id | signature length (2, big-endian) | signature | body

  The MAC covers every byte but itself. open_manifest checks it before it
  decodes anything else.
- idempotency key: BLAKE3 of a domain tag, the identity and the chain digest
  of the full history. The manifest id is derived from it, so the same history
  published twice is one manifest.
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import blake3

from cas.chunks import ChunkRef
from cas.errors import UnknownKey
from cas.ids import ChunkId
from cas.keys import Keyring
from catalog.errors import GenerationExhausted, ManifestInvalid
from catalog.ids import ChainDigest, IdentityDigest, ManifestId

FORMAT_VERSION = 1
ENVELOPE_VERSION = 1
MAGIC = b"KVPKMAN"
MAC_PURPOSE = "manifest-mac"
MAC_SIZE = 32
MAX_GENERATION = 2**63 - 1
MAX_PRODUCER = 200
PROMPT_DOMAIN = b"kvpack-durable-prompt-v1\0"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
_BODY_KEYS = frozenset(
    [
        "aligned",
        "alignment",
        "chain",
        "created_at",
        "depth",
        "generation",
        "identity",
        "layout",
        "logits_witnessed",
        "planes",
        "producer",
        "version",
    ]
)


def idempotency_key(identity: IdentityDigest, chain: ChainDigest) -> bytes:
    """Names one history under one identity: domain tag + identity + full-history chain digest."""
    _need(IdentityDigest, "identity", identity)
    _need(ChainDigest, "chain digest", chain)
    return blake3.blake3(PROMPT_DOMAIN + identity.raw + chain.raw).digest()


def manifest_id(identity: IdentityDigest, chain: ChainDigest) -> ManifestId:
    """The manifest id: the first 16 bytes of the idempotency key."""
    return ManifestId(idempotency_key(identity, chain)[: ManifestId.SIZE])


@dataclass(frozen=True, slots=True)
class PartRef:
    """One part of a cut, in the engine's order: its role, chunk and plaintext size."""

    role: str
    chunk_id: ChunkId
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"part role must be a non-empty string, got {self.role!r}")
        if not isinstance(self.chunk_id, ChunkId):
            raise ValueError(f"part chunk_id must be a ChunkId, got {type(self.chunk_id)}")
        if not _is_int(self.size) or self.size < 0:
            raise ValueError(f"part size must be a non-negative integer, got {self.size!r}")


@dataclass(frozen=True)
class Manifest:
    identity: IdentityDigest
    depth: int
    alignment: int
    chain: ChainDigest
    logits_witnessed: bool
    parts: tuple[PartRef, ...]
    layout: Mapping[str, Any]
    generation: int
    producer: str
    created_at: datetime
    version: int = field(default=FORMAT_VERSION)

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise ValueError(f"manifest format version {self.version!r} is not {FORMAT_VERSION}")
        _need(IdentityDigest, "identity", self.identity)
        _need(ChainDigest, "chain digest", self.chain)
        for name in ("depth", "alignment"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"manifest {name} must be a positive integer, got {value!r}")
        if not isinstance(self.logits_witnessed, bool):
            raise ValueError("logits_witnessed must be a bool")
        if not _is_int(self.generation):
            raise ValueError(f"generation must be an integer, got {self.generation!r}")
        if not 0 <= self.generation <= MAX_GENERATION:
            raise GenerationExhausted(self.generation)
        if not isinstance(self.producer, str) or not 0 < len(self.producer) <= MAX_PRODUCER:
            raise ValueError(f"producer must be a string of 1..{MAX_PRODUCER} characters")
        if not isinstance(self.created_at, datetime) or self.created_at.tzinfo is None:
            raise ValueError("created_at must be a timezone-aware datetime")
        parts = tuple(self.parts)
        for p in parts:
            if not isinstance(p, PartRef):
                raise ValueError(f"parts must be PartRef values, got {type(p)}")
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "created_at", self.created_at.astimezone(UTC))
        # A detached, JSON-checked copy: the layout is sealed as given, never aliased.
        object.__setattr__(self, "layout", json.loads(_canonical_json(dict(self.layout))))

    @property
    def aligned(self) -> bool:
        return self.depth % self.alignment == 0

    @property
    def bytes(self) -> int:
        """Plaintext bytes of all parts (what a restore of this cut reads)."""
        return sum(p.size for p in self.parts)

    @property
    def chunk_refs(self) -> list[ChunkRef]:
        """What a reader fetches: every part's chunk and plaintext size, in part order."""
        return [ChunkRef(p.chunk_id, p.size) for p in self.parts]

    @property
    def idempotency_key(self) -> builtins.bytes:  # `bytes` here is the property above
        return idempotency_key(self.identity, self.chain)

    @property
    def id(self) -> ManifestId:
        return manifest_id(self.identity, self.chain)


@dataclass(frozen=True)
class SealedManifest:
    """An opened envelope: the verified manifest, the key that MAC'd it, the producer signature."""

    manifest: Manifest
    key_id: str
    signature: bytes
    body: bytes


def encode_body(m: Manifest) -> bytes:
    """The canonical body: deterministic bytes for a manifest."""
    doc = {
        "version": m.version,
        "identity": m.identity.hex,
        "depth": m.depth,
        "alignment": m.alignment,
        "chain": m.chain.hex,
        "aligned": m.aligned,
        "logits_witnessed": m.logits_witnessed,
        "planes": [{"role": p.role, "chunk": p.chunk_id.hex, "size": p.size} for p in m.parts],
        "layout": m.layout,
        "generation": m.generation,
        "producer": m.producer,
        "created_at": m.created_at.strftime(_TIME_FORMAT),
    }
    return _canonical_json(doc).encode()


def seal_manifest(m: Manifest, keyring: Keyring, *, signature: bytes = b"") -> bytes:
    """The envelope of `m`, MAC'd with the current vault key; `signature` is the producer's
    signature slot over the body (catalog/signing.py), empty when unsigned."""
    key_id, key = keyring.subkey(MAC_PURPOSE)
    kid = key_id.encode("ascii")
    if not 0 < len(kid) < 256:
        raise ValueError(f"key id {key_id!r} must be 1..255 ASCII bytes")
    if len(signature) > 0xFFFF:
        raise ValueError("signature longer than 65535 bytes")
    magic = MAGIC + bytes([ENVELOPE_VERSION])
    tail = bytes([len(kid)]) + kid + len(signature).to_bytes(2, "big") + signature + encode_body(m)
    return magic + _mac(key, magic, tail) + tail


def open_sealed(data: bytes | memoryview, keyring: Keyring) -> SealedManifest:
    """Verify the MAC, then decode. Any fault raises ManifestInvalid; nothing is returned."""
    data = bytes(data)
    head = len(MAGIC) + 1
    if len(data) < head + MAC_SIZE + 1 or not data.startswith(MAGIC):
        raise ManifestInvalid("not a manifest envelope")
    if data[len(MAGIC)] != ENVELOPE_VERSION:
        raise ManifestInvalid(f"unknown envelope version {data[len(MAGIC)]}")
    magic, mac, tail = data[:head], data[head : head + MAC_SIZE], data[head + MAC_SIZE :]
    kid_len = tail[0]
    try:
        key_id = tail[1 : 1 + kid_len].decode("ascii")
        _, key = keyring.subkey(MAC_PURPOSE, key_id)
    except UnicodeDecodeError:
        raise ManifestInvalid("key id is not ASCII") from None
    except UnknownKey as e:
        raise ManifestInvalid(f"MAC'd by unknown key id {e.key_id!r}") from None
    if len(tail) < 1 + kid_len or not hmac.compare_digest(mac, _mac(key, magic, tail)):
        raise ManifestInvalid("MAC does not verify")
    # Authentic from here on; what follows checks that the producer wrote something well-formed.
    rest = tail[1 + kid_len :]
    if len(rest) < 2:
        raise ManifestInvalid("truncated signature length")
    sig_len = int.from_bytes(rest[:2], "big")
    signature, body = rest[2 : 2 + sig_len], rest[2 + sig_len :]
    if len(signature) != sig_len:
        raise ManifestInvalid("truncated signature")
    return SealedManifest(decode_body(body), key_id, signature, body)


def open_manifest(data: bytes | memoryview, keyring: Keyring) -> Manifest:
    """The manifest inside an envelope, only if its MAC verifies (ManifestInvalid otherwise)."""
    return open_sealed(data, keyring).manifest


def _parse_time(text: str) -> datetime:
    """A body's created_at. fromisoformat takes more forms than encode_body writes; the
    canonical check after decoding refuses every other one. Not strptime: its first
    call in a process imports its module and compiles its patterns (4 ms measured here,
    inside the first durable restore after a start)."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def decode_body(body: bytes) -> Manifest:
    """Strictly decode a canonical body (unknown versions, fields or encodings are refused)."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestInvalid(f"body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestInvalid("body is not a JSON object")
    if doc.get("version") != FORMAT_VERSION:
        raise ManifestInvalid(f"unknown manifest format version {doc.get('version')!r}")
    if set(doc) != _BODY_KEYS:
        raise ManifestInvalid(f"fields {sorted(set(doc) ^ _BODY_KEYS)} unexpected or missing")
    try:
        planes = doc["planes"]
        if not isinstance(planes, list) or not all(
            isinstance(p, dict) and set(p) == {"role", "chunk", "size"} for p in planes
        ):
            raise ValueError("planes must be a list of {role, chunk, size}")
        if not isinstance(doc["layout"], dict):
            raise ValueError("layout must be an object")
        m = Manifest(
            identity=IdentityDigest.from_hex(_need_str(doc["identity"])),
            depth=doc["depth"],
            alignment=doc["alignment"],
            chain=ChainDigest.from_hex(_need_str(doc["chain"])),
            logits_witnessed=doc["logits_witnessed"],
            parts=tuple(
                PartRef(p["role"], ChunkId.from_hex(_need_str(p["chunk"])), p["size"])
                for p in planes
            ),
            layout=doc["layout"],
            generation=doc["generation"],
            producer=doc["producer"],
            created_at=_parse_time(_need_str(doc["created_at"])),
        )
    except (ValueError, TypeError, KeyError) as e:
        raise ManifestInvalid(f"malformed body: {e}") from None
    if doc["aligned"] is not m.aligned:
        raise ManifestInvalid(f"aligned={doc['aligned']!r} contradicts depth {m.depth}")
    if encode_body(m) != body:
        raise ManifestInvalid("body is not in canonical encoding")
    return m


def _mac(key: bytes, magic: bytes, tail: bytes) -> bytes:
    return hmac.new(key, magic + tail, hashlib.sha256).digest()


def _canonical_json(doc: Any) -> str:
    try:
        return json.dumps(
            doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest layout must be JSON-able: {e}") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need_str(v: object) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


def _need(kind: type, name: str, v: object) -> None:
    if not isinstance(v, kind):
        raise ValueError(f"{name} must be a {kind.__name__}, got {type(v).__name__}")


def make_manifest(
    *,
    identity: IdentityDigest,
    depth: int,
    alignment: int,
    chain: ChainDigest,
    logits_witnessed: bool,
    parts: Sequence[PartRef],
    layout: Mapping[str, Any],
    generation: int,
    producer: str,
    created_at: datetime | None = None,
) -> Manifest:
    """Keyword-only constructor; created_at defaults to now, truncated to microseconds (UTC)."""
    return Manifest(
        identity=identity,
        depth=depth,
        alignment=alignment,
        chain=chain,
        logits_witnessed=logits_witnessed,
        parts=tuple(parts),
        layout=layout,
        generation=generation,
        producer=producer,
        created_at=created_at or datetime.now(UTC),
    )
