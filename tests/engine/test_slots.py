"""Slots: aligned prefill, decode, sampling, stop tokens, streaming, cancellation."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from engine.errors import EmptySlot, InvalidRequest, LogitsMissing
from engine.sampling import Sampling
from engine.slots import SlotPool, aligned_steps
from tests.engine.slotkit import TINY_A, cold, logits_bytes, prompt, tiny, tiny_pool


class RecordingModel:
    """Wraps the real model; records the length of every forward (and can fail one)."""

    def __init__(self, model, fail_at: int | None = None) -> None:
        self.model = model
        self.calls: list[int] = []
        self.fail_at = fail_at

    def __call__(self, inputs, cache):
        self.calls.append(int(inputs.shape[1]))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            # Half the layers have taken the step when this fires: the worst moment.
            half = len(cache) // 2
            for c in cache[:half]:
                k = mx.zeros((1, 2, int(inputs.shape[1]), 16))
                c.update_and_fetch(k, k)
            raise RuntimeError("injected forward failure")
        return self.model(inputs, cache=cache)


def test_pool_alignment_comes_from_the_identity():
    """SlotPool.alignment: read from the model's identity (there is no other to pass), so a
    pool's prefill steps follow the A its cuts are named under."""
    pool = SlotPool(tiny(alignment=32), num_slots=1)
    assert pool.alignment == pool.identity.alignment == 32
    rec = RecordingModel(pool.model)
    pool.model = rec
    pool.slot(0).prefill(prompt(70))
    assert rec.calls == [32, 32, 6]


def test_aligned_steps_end_on_absolute_multiples():
    """aligned_steps: from an unaligned depth the first step stops at the next multiple of A,
    then whole A steps, then the remainder; from an aligned depth it is whole steps."""
    assert list(aligned_steps(0, 150, 64)) == [(0, 64), (64, 128), (128, 150)]
    assert list(aligned_steps(100, 300, 64)) == [(100, 128), (128, 192), (192, 256), (256, 300)]
    assert list(aligned_steps(128, 192, 64)) == [(128, 192)]
    assert list(aligned_steps(5, 5, 64)) == []


def test_prefill_forwards_in_aligned_steps_and_reports_boundaries():
    """Slot.prefill: the model sees exactly the aligned steps, across two prefills, and
    on_boundary fires at each multiple of A crossed (not at the unaligned end)."""
    pool = tiny_pool(1)
    rec = RecordingModel(pool.model)
    pool.model = rec
    seen: list[int] = []
    slot = pool.slot(0)
    assert slot.prefill(prompt(150), on_boundary=seen.append) == 150
    assert slot.prefill(prompt(100, seed=2), on_boundary=seen.append) == 250
    assert rec.calls == [64, 64, 22, 42, 58]
    assert seen == [64, 128, 192]
    assert slot.depth == 250 and len(slot.tokens) == 250 and slot.logits_witnessed


def test_prefill_cancel_stops_between_steps():
    """Slot.prefill cancel: checked between steps; the slot stays consistent at the last
    step it finished."""
    pool = tiny_pool(1)
    slot = pool.slot(0)
    stop_after_first = threading.Event()
    depth = slot.prefill(
        prompt(200), on_boundary=lambda d: stop_after_first.set(), cancel=stop_after_first
    )
    assert depth == TINY_A == slot.depth
    assert all(c.offset == TINY_A for c in slot.state.cache)


def test_forward_failure_resets_the_slot():
    """Slot._forward failure: some layers already took the step, so the slot is reset —
    never left with caches deeper than its history."""
    pool = tiny_pool(1)
    slot = pool.slot(0)
    slot.prefill(prompt(100))
    pool.model = RecordingModel(pool.model, fail_at=1)
    with pytest.raises(RuntimeError, match="injected"):
        slot.prefill(prompt(10, seed=3))
    assert slot.depth == 0 and slot.logits is None
    assert all(c.keys is None for c in slot.state.cache)


def test_greedy_decode_feeds_tokens_and_keeps_logits_witnessed():
    """Slot.generate greedy: each token is argmax of the witnessed logits, is streamed, then
    fed, so the history grows by exactly the generated tokens and matches a cold prefill."""
    pool = tiny_pool(2)
    tokens = prompt(120)
    a = cold(pool, tokens, 0)
    streamed: list[int] = []
    first = int(mx.argmax(a.logits).item())
    gen = a.generate(max_tokens=10, stop=(), on_token=streamed.append)
    assert gen.finish_reason == "length" and gen.tokens == streamed and len(gen.tokens) == 10
    assert gen.tokens[0] == first
    assert a.tokens == tuple(tokens + gen.tokens) and a.depth == 130
    b = cold(pool, tokens + gen.tokens, 1)
    # Decode and prefill compute differently, but they must agree on the argmax.
    assert int(mx.argmax(a.logits).item()) == int(mx.argmax(b.logits).item())


def test_stop_token_ends_generation_and_is_not_fed():
    """Slot.generate stop: a caller-given stop token (and the tokenizer's eos) ends the
    generation with finish_reason 'stop'; the stop token is reported, not fed."""
    pool = tiny_pool(1)
    slot = cold(pool, prompt(100), 0)
    free = slot.generate(max_tokens=5)
    slot.reset()
    slot.prefill(prompt(100))
    gen = slot.generate(max_tokens=5, stop=[free.tokens[2]])
    assert gen.finish_reason == "stop" and gen.stop_token == free.tokens[2]
    assert gen.tokens == free.tokens[:2] and slot.depth == 102
    assert pool.stop_tokens == tiny().tokenizer.eos_token_ids


def test_eos_is_a_stop_token():
    """Slot.generate eos: the pool's stop set comes from the tokenizer's eos ids."""
    pool = tiny_pool(1)
    slot = cold(pool, prompt(100), 0)
    first = int(mx.argmax(slot.logits).item())
    pool.stop_tokens = frozenset({first})
    gen = slot.generate(max_tokens=5)
    assert gen.tokens == [] and gen.stop_token == first and gen.finish_reason == "stop"


def test_cancel_event_and_callable():
    """Slot.generate cancel: an Event set from the streaming callback, or a callable, stops
    before the next token with finish_reason 'cancelled'."""
    pool = tiny_pool(1)
    slot = cold(pool, prompt(100), 0)
    ev = threading.Event()
    gen = slot.generate(max_tokens=20, stop=(), on_token=lambda t: ev.set(), cancel=ev)
    assert gen.finish_reason == "cancelled" and len(gen.tokens) == 1 and slot.depth == 101
    count = iter(range(100))
    gen = slot.generate(max_tokens=20, stop=(), cancel=lambda: next(count) >= 3)
    assert gen.finish_reason == "cancelled" and len(gen.tokens) == 3


def test_seeded_sampling_is_reproducible():
    """Sampling with a seed: the same seed draws the same tokens from the same state; a
    different seed (at a high temperature) draws differently; top_p tiny equals greedy."""
    pool = tiny_pool(2)
    tokens = prompt(100)
    hot = Sampling(temperature=5.0, seed=7)
    a = cold(pool, tokens, 0).generate(max_tokens=16, sampling=hot, stop=())
    b = cold(pool, tokens, 1).generate(max_tokens=16, sampling=hot, stop=())
    c = cold(pool, tokens, 1).generate(
        max_tokens=16, sampling=Sampling(temperature=5.0, seed=8), stop=()
    )
    assert a.tokens == b.tokens and a.tokens != c.tokens
    greedy = cold(pool, tokens, 0).generate(max_tokens=16, stop=())
    narrow = cold(pool, tokens, 1).generate(
        max_tokens=16, sampling=Sampling(temperature=1.0, top_p=1e-6, seed=3), stop=()
    )
    assert narrow.tokens == greedy.tokens


def test_bad_requests_raise_typed_errors():
    """InvalidRequest / EmptySlot / LogitsMissing: bad tokens, bad sampling, bad max_tokens,
    decoding an empty slot, no slots, and a slot the pool does not have are named errors."""
    pool = tiny_pool(1)
    slot = pool.slot(0)
    with pytest.raises(InvalidRequest) as e:
        slot.prefill([1, 2, pool.vocab_size])
    assert e.value.field == "tokens"
    with pytest.raises(EmptySlot):
        slot.generate(max_tokens=3)
    with pytest.raises(InvalidRequest):
        Sampling(top_p=0.0)
    with pytest.raises(InvalidRequest):
        Sampling(temperature=-1.0)
    with pytest.raises(InvalidRequest) as e:
        Sampling(temperature=1.0, seed=-1)
    assert e.value.field == "seed"
    slot.prefill([1, 2, 3])
    with pytest.raises(InvalidRequest):
        slot.generate(max_tokens=-1)
    slot.state.logits = None  # as after a logit-less ancestor restore
    with pytest.raises(LogitsMissing):
        slot.generate(max_tokens=1)
    with pytest.raises(InvalidRequest) as e:
        SlotPool(tiny(), num_slots=0)
    assert e.value.field == "num_slots"
    with pytest.raises(InvalidRequest):
        pool.slot(5)


def test_cold_flag_marks_states_a_cold_run_would_compute():
    """Branches of SlotState.cold: aligned prefill keeps it; prefilling on from a
    non-aligned depth ends it (a cold run takes that block in one step); decoding ends it;
    and the ended flag really marks other bits (the continued state differs from cold)."""
    pool = tiny_pool(2)
    tokens = prompt(3 * TINY_A, seed=5)
    a = pool.slot(0)
    a.prefill(tokens[: TINY_A + 10])
    assert a.cold  # a cold run of these tokens does exactly these steps
    a.prefill(tokens[TINY_A + 10 :])
    assert not a.cold
    b = cold(pool, tokens, slot=1)
    assert b.cold
    assert logits_bytes(a) != logits_bytes(b)  # why the flag matters
    b.generate(max_tokens=1)
    assert not b.cold
    b.reset()
    assert b.cold


def test_step_wise_prefill_and_decoding_interleave_two_slots_bit_identically():
    """prefill_steps yields once per aligned step (the depths prefill would reach) and
    Decoding one token per step; two slots of different pools stepped in turn on one
    thread end with exactly the logits and tokens each computes alone."""
    tokens_a, tokens_b = prompt(150, seed=21), prompt(70, seed=22)
    alone = []
    for tokens in (tokens_a, tokens_b):
        slot = tiny_pool(1).slot(0)
        slot.prefill(tokens)
        gen = slot.generate(max_tokens=6, sampling=Sampling(temperature=0.8, seed=3))
        alone.append((gen.tokens, logits_bytes(slot)))
    a, b = tiny_pool(1).slot(0), tiny_pool(1).slot(0)
    steps_a, steps_b = a.prefill_steps(tokens_a), b.prefill_steps(tokens_b)
    assert [next(steps_a), next(steps_b), next(steps_a), next(steps_b)] == [64, 64, 128, 70]
    assert list(steps_a) == [150] and list(steps_b) == []
    sampling = Sampling(temperature=0.8, seed=3)
    decodings = [s.decoding(max_tokens=6, sampling=sampling) for s in (a, b)]
    while not all(d.done for d in decodings):
        for d in decodings:
            d.step()
    pairs = zip(decodings, (a, b), strict=True)
    together = [(d.generation.tokens, logits_bytes(s)) for d, s in pairs]
    assert together == alone
    assert all(d.generation.finish_reason == "length" and d.step() is None for d in decodings)


def test_draw_leaves_its_token_unfed_until_feed():
    """Decoding.draw: the token comes back before the model sees it (the slot's depth and
    logits are the prompt's), feed() then runs it; draw + feed decodes what generate does,
    and a cancel after a draw keeps the unfed token out of the history."""
    tokens = prompt(70)
    want = cold(tiny_pool(1), tokens)
    expected = want.generate(max_tokens=4).tokens
    slot = cold(tiny_pool(1), tokens)
    rec = RecordingModel(slot.pool.model)
    slot.pool.model = rec
    decoding = slot.decoding(max_tokens=4)
    before = logits_bytes(slot)
    drawn = decoding.draw()
    assert drawn is not None and drawn.token == expected[0]
    assert (slot.depth, rec.calls, logits_bytes(slot)) == (70, [], before)
    decoding.feed()
    decoding.feed()  # nothing left to feed: no second forward
    assert (slot.depth, rec.calls) == (71, [1])
    while not decoding.done:
        decoding.draw()
        decoding.feed()
    assert decoding.generation.tokens == expected and slot.depth == 74
    assert logits_bytes(slot) == logits_bytes(want)
    cancelled = cold(tiny_pool(1), tokens).decoding(max_tokens=4)
    cancelled.draw()
    cancelled.cancel()
    assert cancelled.slot.depth == 70 and cancelled.generation.finish_reason == "cancelled"
    assert cancelled.draw() is None and cancelled.slot.depth == 70
