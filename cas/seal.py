"""The chunk seal: authenticated encryption at rest.

Cipher: AES-256-GCM-SIV (nonce-misuse resistant). The nonce is the first 12
bytes of the chunk id, itself a keyed BLAKE3 of the plaintext: equal plaintext
in a namespace seals to equal bytes (so it dedups), different plaintext never
shares a nonce (short of a 96-bit collision, which under GCM-SIV would reveal
only that two chunks are equal, not the key).

Sealed chunk, format version 1:

    magic "KVPC" | version u8 | key id length u8 | key id | nonce (12) | ciphertext+tag (16)

The header and the chunk id are bound as associated data, so a chunk cannot
be relabelled to another id or key id. The key id names the sealing key
(Keyring.subkey("chunk-seal", key_id)): the current key seals, every key in
the ring still opens. Opening verifies the tag and then re-hashes the
plaintext against the chunk id; a chunk failing either is never returned.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV

from cas.errors import ChunkCorrupt
from cas.ids import ChunkId
from cas.keys import Keyring

PURPOSE = "chunk-seal"
MAGIC = b"KVPC"
VERSION = 1
NONCE_SIZE = 12
TAG_SIZE = 16
MAX_KEY_ID = 64
MAX_OVERHEAD = len(MAGIC) + 2 + MAX_KEY_ID + NONCE_SIZE + TAG_SIZE


def header(key_id: str) -> bytes:
    kid = key_id.encode()
    if not 1 <= len(kid) <= MAX_KEY_ID:
        raise ValueError(f"key id must be 1..{MAX_KEY_ID} bytes, got {key_id!r}")
    return MAGIC + bytes((VERSION, len(kid))) + kid


def sealed_size(size: int, key_id: str) -> int:
    """Bytes of a sealed chunk whose plaintext has `size` bytes."""
    return len(header(key_id)) + NONCE_SIZE + size + TAG_SIZE


def max_sealed_size(size: int) -> int:
    """An upper bound for any key id: what to allocate before reading a chunk."""
    return size + MAX_OVERHEAD


class ChunkSeal:
    """Seals and opens chunks with a keyring's "chunk-seal" subkeys."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self._aeads: dict[str, AESGCMSIV] = {}

    def _aead(self, key_id: str | None) -> tuple[str, AESGCMSIV]:
        key_id, key = self.keyring.subkey(PURPOSE, key_id)  # UnknownKey
        if key_id not in self._aeads:
            self._aeads[key_id] = AESGCMSIV(key)
        return key_id, self._aeads[key_id]

    def seal(self, chunk_id: ChunkId, plaintext: bytes | bytearray | memoryview) -> bytearray:
        """Seal under the current key."""
        key_id, aead = self._aead(None)
        head = header(key_id)
        nonce = chunk_id.raw[:NONCE_SIZE]
        start = len(head) + NONCE_SIZE
        out = bytearray(start + len(plaintext) + TAG_SIZE)
        out[: len(head)] = head
        out[len(head) : start] = nonce
        aead.encrypt_into(nonce, plaintext, head + chunk_id.raw, memoryview(out)[start:])
        return out

    def verify(
        self,
        chunk_id: ChunkId,
        sealed: bytes | bytearray | memoryview,
        plaintext: bytes | bytearray | memoryview,
    ) -> None:
        """Check that `sealed` opens to exactly `plaintext` (our own output, before it is
        trusted and uploaded): tag and bytes, without digesting the plaintext again."""
        sealed = memoryview(sealed)
        start, head, key_id = self._parse(chunk_id, sealed)
        out = bytearray(len(sealed) - start - TAG_SIZE)
        _, aead = self._aead(key_id)
        nonce = bytes(sealed[start - NONCE_SIZE : start])
        try:
            aead.decrypt_into(nonce, sealed[start:], head + chunk_id.raw, memoryview(out))
        except InvalidTag:
            raise ChunkCorrupt(chunk_id, "our own seal does not verify") from None
        if out != plaintext:
            raise ChunkCorrupt(chunk_id, "our own seal does not open to its plaintext")

    def plaintext_size(self, chunk_id: ChunkId, sealed: bytes | memoryview) -> int:
        """Size the sealed chunk claims for its plaintext (after checking the header)."""
        start, _head, _key_id = self._parse(chunk_id, sealed)
        return len(sealed) - start - TAG_SIZE

    def open_into(
        self,
        chunk_id: ChunkId,
        sealed: bytes | bytearray | memoryview,
        out: memoryview,
        *,
        digest_key: bytes,
    ) -> None:
        """Verify and decrypt into `out` (exactly the plaintext size). ChunkCorrupt,
        UnknownKey. On error `out` holds garbage and must not be used."""
        sealed = memoryview(sealed)
        start, head, key_id = self._parse(chunk_id, sealed)
        size = len(sealed) - start - TAG_SIZE
        if size != len(out):
            raise ChunkCorrupt(chunk_id, f"holds {size} plaintext bytes, expected {len(out)}")
        _, aead = self._aead(key_id)
        nonce = bytes(sealed[start - NONCE_SIZE : start])
        try:
            aead.decrypt_into(nonce, sealed[start:], head + chunk_id.raw, out)
        except InvalidTag:
            raise ChunkCorrupt(chunk_id, "seal tag does not verify") from None
        if ChunkId.of(out, key=digest_key) != chunk_id:
            raise ChunkCorrupt(chunk_id, "plaintext does not hash to the chunk id")

    def open(self, chunk_id: ChunkId, sealed: bytes | memoryview, *, digest_key: bytes) -> bytes:
        out = bytearray(self.plaintext_size(chunk_id, sealed))
        self.open_into(chunk_id, sealed, memoryview(out), digest_key=digest_key)
        return bytes(out)

    def _parse(self, chunk_id: ChunkId, sealed: bytes | memoryview) -> tuple[int, bytes, str]:
        """(offset of ciphertext, header bytes, key id); ChunkCorrupt on a malformed header."""
        m = len(MAGIC)
        if len(sealed) < m + 2 or bytes(sealed[:m]) != MAGIC:
            raise ChunkCorrupt(chunk_id, "not a sealed chunk (bad magic)")
        version, kid_len = sealed[m], sealed[m + 1]
        if version != VERSION:
            raise ChunkCorrupt(chunk_id, f"unsupported seal format version {version}")
        end = m + 2 + kid_len
        start = end + NONCE_SIZE
        if kid_len == 0 or len(sealed) < start + TAG_SIZE:
            raise ChunkCorrupt(chunk_id, f"truncated: {len(sealed)} bytes")
        try:
            key_id = bytes(sealed[m + 2 : end]).decode()
        except UnicodeDecodeError:
            raise ChunkCorrupt(chunk_id, "key id is not text") from None
        if bytes(sealed[end:start]) != chunk_id.raw[:NONCE_SIZE]:
            raise ChunkCorrupt(chunk_id, "nonce does not belong to the chunk id")
        return start, bytes(sealed[:end]), key_id
