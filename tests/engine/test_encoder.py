"""engine/format.py Encoder: the successive cuts of one cold prefill, each whole block
encoded once, byte for byte what a full encode of the same cut gives."""

from __future__ import annotations

from engine.format import Encoder, encode
from tests.engine.slotkit import PROMPT, TINY_A, prompt, tiny_pool


def test_every_boundary_equals_a_full_encode_and_reuses_the_earlier_blocks():
    """A cut at every aligned boundary of a cold prefill (tiny: full-attention and
    sliding-window layers), then the exact cut: each encodes to the very Planes encode()
    gives, and only the new block, the ring and the logits are encoded each time."""
    slot = tiny_pool(1).slot(0)
    slot.reset()
    encoder, boundaries = Encoder(), []

    def on_boundary(depth: int) -> None:
        snap = slot.export()
        before = encoder.encoded
        assert encoder.encode(snap) == encode(snap)
        boundaries.append((depth, encoder.encoded - before))

    slot.prefill(PROMPT, on_boundary=on_boundary)
    assert [d for d, _ in boundaries] == [TINY_A * k for k in range(1, 5)]
    assert [n for _, n in boundaries] == [3] * 4  # the new block, the ring, the logits
    exact = slot.export()
    assert exact.depth == len(PROMPT) and not exact.aligned
    assert encoder.encode(exact) == encode(exact)
    assert encoder.reused == 0 + 1 + 2 + 3 + 4  # every earlier whole block, given again


def test_another_prefill_is_never_served_a_kept_block():
    """A shallower cut (the slot was reset and prefilled with other tokens) starts afresh:
    its blocks are its own, equal to a full encode, though roles and shapes match."""
    slot = tiny_pool(1).slot(0)
    encoder = Encoder()
    slot.reset()
    slot.prefill(PROMPT[: 3 * TINY_A])
    encoder.encode(slot.export())
    slot.reset()
    slot.prefill(prompt(2 * TINY_A, seed=7))
    other = slot.export()
    assert encoder.encode(other) == encode(other)
    assert encoder.reused == 0
