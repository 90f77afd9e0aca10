"""The token chain: rolling digests that name prefixes of a token history.

Words (see docs/architecture.md):
- token chain: a rolling BLAKE3 digest over the token ids (uint32 little-endian,
  under a versioned domain tag), taken at every aligned boundary k*A (k >= 1)
  and at the exact end. `chain[k]` names the prefix tokens[:k*A].
- link: one (depth, digest) pair of a chain. A link's digest depends only on
  the tokens before its depth (and the alignment), never on what follows, so
  the links of a prompt are the names of all its aligned ancestors.

Each link hashes the previous aligned link, its own depth and the tokens since
that link; the exact-end link hangs off the last aligned link, so a non-aligned
cut's name is the same whichever longer prompt reaches it.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from catalog.ids import ChainDigest

DOMAIN = b"kvpack-token-chain-v1\0"
SEED = ChainDigest(blake3.blake3(DOMAIN).digest())  # the name of the empty prefix
MAX_TOKEN = 2**32 - 1


def _link(prev: ChainDigest, depth: int, segment: bytes) -> ChainDigest:
    digest = blake3.blake3(DOMAIN + prev.raw + depth.to_bytes(8, "little") + segment)
    return ChainDigest(digest.digest())


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in 0..{MAX_TOKEN}: {e}") from None
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        packed = array("L", tokens)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


@dataclass(frozen=True, slots=True)
class TokenChain:
    """The links of one token history: every aligned boundary, then the exact end."""

    alignment: int
    depth: int
    links: tuple[tuple[int, ChainDigest], ...]

    @property
    def digest(self) -> ChainDigest:
        """The name of the whole history (the exact-end link; SEED when empty)."""
        return self.links[-1][1] if self.links else SEED

    @property
    def aligned(self) -> bool:
        return self.depth % self.alignment == 0

    def at(self, depth: int) -> ChainDigest:
        """The digest naming tokens[:depth]; only link depths are named."""
        for d, digest in self.links:
            if d == depth:
                return digest
        raise KeyError(f"depth {depth} is not a link of this chain (A={self.alignment})")

    def __getitem__(self, k: int) -> ChainDigest:
        """chain[k] names tokens[:k*A] (k >= 1)."""
        if k < 1 or k * self.alignment > self.depth:
            raise IndexError(f"chain[{k}] is outside 1..{self.depth // self.alignment}")
        return self.links[k - 1][1]

    def __len__(self) -> int:
        return len(self.links)


def token_chain(tokens: Sequence[int], *, alignment: int) -> TokenChain:
    """Links at every k*A <= len(tokens) and at len(tokens) (one link when both coincide)."""
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive integer, got {alignment!r}")
    raw = _token_bytes(tokens)
    depth = len(raw) // 4
    links: list[tuple[int, ChainDigest]] = []
    prev, prev_depth = SEED, 0
    for end in range(alignment, depth + 1, alignment):
        prev = _link(prev, end, raw[prev_depth * 4 : end * 4])
        prev_depth = end
        links.append((end, prev))
    if depth > prev_depth:
        links.append((depth, _link(prev, depth, raw[prev_depth * 4 :])))
    return TokenChain(alignment=alignment, depth=depth, links=tuple(links))
