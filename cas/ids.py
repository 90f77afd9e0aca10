"""Content ids are values: small frozen types over raw digest bytes.

- Digest: the base of every id. One place knows each id's size and how it is written
  (`.hex` for keys and catalog rows, `.short` for logs, `.raw` for hashing); ids of
  different kinds never compare equal, even over the same bytes.
- ChunkId: 32 bytes of keyed BLAKE3 naming a chunk inside one namespace.

catalog/ids.py adds the identity digest, the chain digest and the manifest id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

import blake3

DIGEST_SIZE = 32


@dataclass(frozen=True, slots=True)
class Digest:
    raw: bytes
    SIZE: ClassVar[int] = DIGEST_SIZE
    SHORT: ClassVar[int] = 6  # bytes shown by .short

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != self.SIZE:
            got = len(self.raw) if isinstance(self.raw, bytes) else type(self.raw).__name__
            raise ValueError(f"{type(self).__name__} must be {self.SIZE} bytes, got {got}")

    @classmethod
    def from_hex(cls, text: str) -> Self:
        """Parse lowercase or uppercase hex; ValueError naming the id kind otherwise."""
        if not isinstance(text, str) or len(text) != 2 * cls.SIZE:
            raise ValueError(f"{cls.__name__} must be {2 * cls.SIZE} hex characters: {text!r:.80}")
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise ValueError(f"{cls.__name__} is not hex: {text!r:.80}") from None

    @property
    def hex(self) -> str:
        return self.raw.hex()

    @property
    def short(self) -> str:
        return self.raw[: self.SHORT].hex()

    def __str__(self) -> str:
        return self.hex

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.short})"


@dataclass(frozen=True, slots=True, repr=False)
class ChunkId(Digest):
    """The keyed BLAKE3 digest that names a chunk inside one namespace."""

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview, *, key: bytes) -> ChunkId:
        """Digest `data` under a namespace's digest key (Keyring.digest_key)."""
        return cls(blake3.blake3(data, key=key, max_threads=blake3.blake3.AUTO).digest())
