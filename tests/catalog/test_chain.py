"""The token chain: links at aligned boundaries and the exact end, stable prefixes."""

from __future__ import annotations

import struct

import blake3
import pytest

from catalog.chain import DOMAIN, SEED, token_chain


def test_links_at_every_aligned_boundary_and_the_exact_end():
    """Branch: non-aligned length -> one link per k*A plus the exact end."""
    chain = token_chain(list(range(600)), alignment=256)
    assert [d for d, _ in chain.links] == [256, 512, 600]
    assert chain.depth == 600 and not chain.aligned
    assert chain.digest == chain.links[-1][1]


def test_aligned_length_has_no_duplicate_end_link():
    """Branch: length == k*A -> the exact end is the last aligned link, listed once."""
    chain = token_chain(list(range(512)), alignment=256)
    assert [d for d, _ in chain.links] == [256, 512]
    assert chain.aligned


def test_chain_k_names_the_prefix_of_k_alignments():
    """chain[k] names tokens[:k*A]: it equals the digest of that prefix alone."""
    tokens = list(range(1000))
    chain = token_chain(tokens, alignment=256)
    for k in (1, 2, 3):
        assert chain[k] == token_chain(tokens[: k * 256], alignment=256).digest
        assert chain.at(k * 256) == chain[k]
    with pytest.raises(IndexError):
        chain[0]
    with pytest.raises(IndexError):
        chain[4]
    with pytest.raises(KeyError):
        chain.at(300)


def test_a_changed_token_changes_later_links_only():
    """A link depends on the tokens before it and never on what follows."""
    a = list(range(800))
    b = list(a)
    b[300] = 99999
    ca, cb = token_chain(a, alignment=256), token_chain(b, alignment=256)
    assert ca.links[0] == cb.links[0]
    assert ca.links[1][1] != cb.links[1][1]
    assert ca.links[2][1] != cb.links[2][1]


def test_exact_end_link_hangs_off_the_last_aligned_link():
    """A non-aligned prefix has the same name whichever longer prompt reaches it."""
    tokens = list(range(700))
    short = token_chain(tokens[:300], alignment=256)
    again = token_chain(list(tokens[:300]), alignment=256)
    assert short.digest == again.digest
    assert short.links[0] == token_chain(tokens, alignment=256).links[0]


def test_golden_vector_uint32_little_endian_under_versioned_domain():
    """The encoding is pinned: uint32 LE tokens, 8-byte LE depth, the v1 domain tag."""
    chain = token_chain([1, 2, 3], alignment=2)
    first = blake3.blake3(DOMAIN + SEED.raw + (2).to_bytes(8, "little") + struct.pack("<2I", 1, 2))
    end = blake3.blake3(DOMAIN + first.digest() + (3).to_bytes(8, "little") + struct.pack("<I", 3))
    assert blake3.blake3(b"kvpack-token-chain-v1\0").digest() == SEED.raw
    assert [(d, link.raw) for d, link in chain.links] == [(2, first.digest()), (3, end.digest())]


def test_alignment_is_part_of_every_name():
    """The same tokens under another alignment share no link digest."""
    tokens = list(range(512))
    a = {d for _, d in token_chain(tokens, alignment=256).links}
    b = {d for _, d in token_chain(tokens, alignment=512).links}
    assert not a & b


def test_empty_history_has_no_links():
    """Branch: depth 0 -> no links; its digest is the seed."""
    chain = token_chain([], alignment=256)
    assert chain.links == () and chain.digest == SEED and len(chain) == 0


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"], [1.5]])
def test_token_ids_outside_uint32_are_refused(bad):
    """Bad input -> ValueError naming the allowed range."""
    with pytest.raises(ValueError, match="token ids"):
        token_chain(bad, alignment=256)


def test_largest_token_id_is_accepted():
    """2**32-1 is a valid uint32 token id."""
    assert token_chain([2**32 - 1], alignment=1).depth == 1


@pytest.mark.parametrize("alignment", [0, -256, True, 2.0])
def test_alignment_must_be_a_positive_integer(alignment):
    """Bad alignment -> ValueError."""
    with pytest.raises(ValueError, match="alignment"):
        token_chain([1, 2], alignment=alignment)
