"""Sampling on the tiny model (engine/sampling.py through Slot.generate / Slot.decoding):
each processor and filter changes what it should, seeded draws repeat, logprobs are a
distribution, and the slot's own logits are never touched."""

from __future__ import annotations

import math

import pytest

from engine.errors import InvalidRequest
from engine.sampling import Sampling
from tests.engine.slotkit import logits_bytes, prompt, tiny_pool

P = prompt(100, seed=3)


@pytest.fixture(scope="module")
def slot():
    return tiny_pool(1).slot(0)


def run(slot, sampling: Sampling, n: int = 20) -> list[int]:
    slot.reset()
    slot.prefill(P)
    return slot.generate(max_tokens=n, sampling=sampling).tokens


@pytest.fixture(scope="module")
def greedy(slot) -> list[int]:
    return run(slot, Sampling(), 200)


def test_filters_that_keep_only_the_top_token_draw_exactly_the_greedy_tokens(slot, greedy):
    """top_k=1, min_p=1 and a tiny top_p each leave one candidate: at temperature 1 the
    seeded draw is then the argmax, token for token (mlx-lm's filters are wired in)."""
    for kw in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        assert run(slot, Sampling(temperature=1.0, seed=5, **kw)) == greedy[:20], kw
    assert run(slot, Sampling(temperature=1.0, seed=5)) != greedy[:20]  # unfiltered differs


def test_the_same_seed_draws_the_same_tokens_another_seed_others(slot):
    a = run(slot, Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=7))
    assert run(slot, Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=7)) == a
    assert run(slot, Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=8)) != a


def test_logit_bias_forces_or_forbids_a_token(slot, greedy):
    assert run(slot, Sampling(logit_bias=((65, 100.0),)), 5) == [65] * 5
    assert run(slot, Sampling(logit_bias=((greedy[0], -100.0),)), 1) != greedy[:1]


def test_presence_and_frequency_penalties_read_the_completion_only(slot, greedy):
    """Greedy tiny cycles (200 tokens, far fewer distinct); a large presence or frequency
    penalty makes every completion token distinct, yet the first token, drawn before the
    completion holds anything, is the greedy one (the prompt is not penalized)."""
    assert len(set(greedy)) < len(greedy)
    for kw in ({"presence_penalty": 100.0}, {"frequency_penalty": 100.0}):
        tokens = run(slot, Sampling(**kw), 200)
        assert len(set(tokens)) == len(tokens) and tokens[0] == greedy[0], kw


def test_repetition_penalty_reads_the_prompt_too(slot, greedy):
    """A large repetition penalty keeps tokens of the prompt out of the completion."""
    assert any(t in P for t in greedy[:20])
    assert not any(t in P for t in run(slot, Sampling(repetition_penalty=1e4)))


def test_logprobs_are_a_distribution_and_the_slots_logits_stay_as_they_were(slot, greedy):
    """Greedy with top_logprobs: the drawn token is the most likely one, its logprob is the
    first alternative's, the alternatives are sorted, and the probabilities of all tokens
    sum to 1. A penalized draw leaves the slot's witnessed logits byte-identical."""
    slot.reset()
    slot.prefill(P)
    before = logits_bytes(slot)
    decoding = slot.decoding(
        max_tokens=1, sampling=Sampling(frequency_penalty=1.0), top_logprobs=slot.pool.vocab_size
    )
    logits = slot.logits
    drawn = decoding.step()
    assert bytes(memoryview(logits)) == before
    assert drawn.token == greedy[0] == drawn.top[0][0]
    assert drawn.logprob == pytest.approx(drawn.top[0][1])
    values = [lp for _, lp in drawn.top]
    assert values == sorted(values, reverse=True) and len(values) == slot.pool.vocab_size
    assert math.fsum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-4)
    top5 = run_top(slot, 5)
    assert [t for t, _ in top5] == [t for t, _ in drawn.top[:5]]


def run_top(slot, n):
    slot.reset()
    slot.prefill(P)
    return slot.decoding(max_tokens=1, top_logprobs=n).step().top


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": True}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"logit_bias": ((1, float("nan")),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidRequest) as e:
        Sampling(**kw)
    assert e.value.field == field


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(slot):
    slot.reset()
    slot.prefill(P)
    with pytest.raises(InvalidRequest) as e:
        slot.decoding(max_tokens=1, sampling=Sampling(logit_bias=((10**6, 1.0),)))
    assert e.value.field == "logit_bias"
