"""Content ids are values: small frozen types over raw digest bytes.

- Digest: the base of every id. One place knows each id's size and how it is written
  (`.hex` for keys and catalog rows, `.short` for logs, `.raw` for hashing); ids of
  different kinds never compare equal, even over the same bytes.
- ChunkId: 32 bytes of keyed BLAKE3 naming a chunk inside one namespace.
- SegmentHasher: the keyed BLAKE3 of bytes that arrive in segments apart in memory (a
  chunk opened straight into the buffers its pieces belong in, cas/seal.py), fed to
  BLAKE3 in aligned runs. BLAKE3 hashes many of its 1 KiB chunks at once only inside
  subtrees aligned to their size in the stream, so an update that starts at an
  unaligned offset hashes small subtrees until it is aligned again: a demo-model block
  (a 1,472-byte frame head, then 180 segments of 64 KiB) took 3.3 ms to hash segment by
  segment, against 1.7 ms for the same 12 MB in one buffer. Gathering the segments into
  a 256 KiB bounce buffer and hashing that took 1.9 ms (128 KiB to 1 MiB were alike;
  64 KiB took 2.1 ms). In a restore (`benchmarks/restore_phases.py --depth 256 --rounds
  25`, five A/B pairs) the fill went from 6.2–7.1 ms to 4.8–6.1 ms; at 2,048 tokens the
  change is in the noise.

catalog/ids.py adds the identity digest, the chain digest and the manifest id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

import blake3

DIGEST_SIZE = 32
BOUNCE = 256 * 1024  # a SegmentHasher's run: a power of two, measured (below)


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


class SegmentHasher:
    """Keyed BLAKE3 over segments given in stream order, equal to ChunkId.of over the
    bytes laid end to end. Bytes reach the hasher in runs that start at multiples of
    BOUNCE in the stream: a segment's unaligned ends go through a bounce buffer. `size`
    is the stream's length (a short stream's bounce buffer is no larger)."""

    def __init__(self, *, key: bytes, size: int) -> None:
        self._hasher = blake3.blake3(key=key)
        self._bounce = bytearray(min(BOUNCE, size))
        self._held = 0  # bytes in the bounce buffer: the stream offset modulo BOUNCE

    def update(self, segment: memoryview) -> None:
        n, i = segment.nbytes, 0
        if self._held:
            i = min(n, BOUNCE - self._held)
            self._bounce[self._held : self._held + i] = segment[:i]
            self._held += i
            if self._held < BOUNCE:
                return
            self._hasher.update(self._bounce)
            self._held = 0
        whole = (n - i) // BOUNCE * BOUNCE
        if whole:
            self._hasher.update(segment[i : i + whole])
        rest = n - i - whole
        if rest:
            self._bounce[:rest] = segment[i + whole :]
            self._held = rest

    def digest(self) -> bytes:
        if self._held:
            self._hasher.update(memoryview(self._bounce)[: self._held])
            self._held = 0
        return self._hasher.digest()
