"""Exact and aligned-ancestor restore on the demo model (SmolLM2-135M, A = 256): the same
bit-identity the tiny tests check, on a real 30-layer model. One cold run of a ~300-token
prompt is shared: it yields the aligned cut at 256 (exported as the prefill crosses it),
the exact cut at the end, and the uninterrupted continuation both must reproduce."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.format import encode
from engine.slots import SlotPool
from tests.engine.slotkit import Continuation, continue_greedy, physical

pytestmark = pytest.mark.slow

A = 256
TEXT = (
    "A vault for language-model prefix state keeps the key/value cache and the final "
    "logits of every prompt it has seen, sealed and addressed by content, so that a "
    "restarted server never pays twice for the same system prompt. "
)


@pytest.fixture(scope="module")
def demo():
    from engine.models import load_model

    loaded = load_model("smollm2", alignment=A)
    pool = SlotPool(loaded, num_slots=2)
    messages = [
        {"role": "system", "content": TEXT * 6},
        {"role": "user", "content": "In one sentence: what does the vault keep?"},
    ]
    tokens = loaded.tokenizer.apply_chat_template(messages)
    assert A < len(tokens) < 2 * A, len(tokens)
    cuts = {}
    a = pool.slot(0)
    a.prefill(tokens, on_boundary=lambda d: cuts.setdefault(d, a.export()))
    exact = a.export()
    cold_state = physical(a)
    reference = continue_greedy(a, 32)  # the uninterrupted session
    return SimpleNamespace(
        pool=pool, tokens=tokens, cut=cuts[A], exact=exact, cold=cold_state, ref=reference
    )


def test_demo_exact_restore_is_bit_identical(demo):
    """Slot.restore, exact, on the demo model: the cut at the end of the prompt, through
    its planes (encode, decode), gives the same cache bytes, next-token logits and 32 greedy
    tokens (with the logits after each) as the uninterrupted session."""
    b = demo.pool.slot(1)
    b.reset()
    b.restore(encode(demo.exact), prompt=demo.tokens)
    assert physical(b) == demo.cold
    assert continue_greedy(b, 32) == demo.ref


def test_demo_aligned_ancestor_is_bit_identical_to_cold(demo):
    """Slot.restore, ancestor, on the demo model: the aligned cut at 256, through its
    planes, restored for the whole prompt and the remaining tokens prefilled, leaves
    exactly the cold run's cache bytes and logits, and continues the same way (first
    tokens checked; equal state decides the rest)."""
    b = demo.pool.slot(1)
    b.reset()
    b.restore(encode(demo.cut), prompt=demo.tokens)
    b.prefill(demo.tokens[A:])
    assert physical(b) == demo.cold
    head = Continuation(demo.ref.logits[:5], demo.ref.tokens[:4], "length")
    assert continue_greedy(b, 4) == head
