"""Content ids are values: a chunk id is 32 bytes of keyed BLAKE3."""

from __future__ import annotations

from dataclasses import dataclass

import blake3

DIGEST_SIZE = 32


@dataclass(frozen=True, slots=True)
class ChunkId:
    """The keyed BLAKE3 digest that names a chunk inside one namespace."""

    raw: bytes

    def __post_init__(self) -> None:
        if len(self.raw) != DIGEST_SIZE:
            raise ValueError(f"chunk id must be {DIGEST_SIZE} bytes, got {len(self.raw)}")

    @classmethod
    def of(cls, data: bytes | memoryview, *, key: bytes) -> ChunkId:
        """Digest `data` under a namespace's digest key (Keyring.digest_key)."""
        return cls(blake3.blake3(data, key=key, max_threads=blake3.blake3.AUTO).digest())

    @classmethod
    def from_hex(cls, text: str) -> ChunkId:
        try:
            raw = bytes.fromhex(text)
        except ValueError as e:
            raise ValueError(f"chunk id is not hex: {text!r}") from e
        return cls(raw)

    @property
    def hex(self) -> str:
        return self.raw.hex()

    @property
    def short(self) -> str:
        return self.raw[:6].hex()

    def __str__(self) -> str:
        return self.hex
