"""engine.interop on `tiny` (its mlx-lm directories from the `tiny_models` fixture): engine
cuts continue in mlx-lm's own generate bit-identically under the documented conditions,
caches mlx-lm computes in aligned steps restore into a slot like a cold run, and caches
that do not fit are refused with the restore gate's errors."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from engine.errors import (
    IdentityMismatch,
    InvalidRequest,
    LogitsMissing,
    RestoreRefused,
    ShapeMismatch,
)
from engine.format import encode
from engine.interop import from_mlx_lm, prefill_aligned, resumes, to_mlx_lm
from engine.models import load_model
from engine.slots import SlotPool
from engine.state import Snapshot
from tests.engine.slotkit import PROMPT, TINY_A, cold, continue_greedy, drop_logits, physical

STEPS = 24


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


@dataclasses.dataclass
class Side:
    """One model directory seen by both: the engine's pool and mlx-lm's own load of it."""

    pool: SlotPool
    model: object  # mlx-lm's module, loaded separately from the pool's
    tokenizer: object  # mlx-lm's TokenizerWrapper


def side(directory, namespace: str = "default") -> Side:
    pool = SlotPool(load_model(str(directory), alignment=TINY_A, namespace=namespace), num_slots=2)
    model, tokenizer = mlx_lm_load(str(directory))
    return Side(pool, model, tokenizer)


def run(s: Side, prompt, cache=None, *, step: int = TINY_A) -> list[tuple[int, bytes]]:
    """mlx-lm's stream_generate: each token with the bytes of its log-probabilities."""
    return [
        (r.token, bytes(memoryview(r.logprobs)))
        for r in stream_generate(
            s.model,
            s.tokenizer,
            prompt,
            max_tokens=STEPS,
            prompt_cache=cache,
            prefill_step_size=step,
        )
    ]


def engine_cuts(pool: SlotPool, tokens) -> dict[int, Snapshot]:
    """The cuts a cold engine prefill of `tokens` makes: every aligned one and the end."""
    slot = pool.slot(0)
    slot.reset()
    cuts: dict[int, Snapshot] = {}
    slot.prefill(tokens, on_boundary=lambda d: cuts.setdefault(d, slot.export()))
    cuts[len(tokens)] = slot.export()
    return cuts


@pytest.mark.parametrize("variant", ["float32", "q4g64", "bfloat16"])
def test_mlx_lm_generate_from_a_restored_cut_is_bit_identical_to_cold(tiny_models, variant):
    """Engine cuts of PROMPT[:-1] (aligned at 64 and 256, and the exact cut at n - 1), each
    through its planes and in memory, continue in mlx-lm's own stream_generate (on
    mlx-lm's separately loaded model, prefill_step_size = A) with the very tokens and
    log-probability bytes of mlx-lm's cold run — twice from the same in-memory cut, so
    mlx-lm's writes never reach the cut; generate's text agrees too."""
    s = side(tiny_models[variant])
    n = len(PROMPT)
    reference = run(s, PROMPT)
    assert len(set(t for t, _ in reference)) > 4
    cuts = engine_cuts(s.pool, PROMPT[:-1])
    for depth in (TINY_A, 4 * TINY_A, n - 1):
        assert resumes(depth, prompt_len=n, alignment=TINY_A)
        for cut in (encode(cuts[depth]), cuts[depth], cuts[depth]):
            pc = to_mlx_lm(s.pool, cut)
            assert pc.depth == depth and len(pc.caches) == s.pool.layout.num_layers
            assert all(c.offset == depth for c in pc.caches)
            assert run(s, PROMPT[depth:], pc.caches) == reference, depth
    text = generate(s.model, s.tokenizer, PROMPT, max_tokens=STEPS, prefill_step_size=TINY_A)
    pc = to_mlx_lm(s.pool, cuts[4 * TINY_A])
    assert (
        text
        and generate(
            s.model,
            s.tokenizer,
            PROMPT[4 * TINY_A :],
            max_tokens=STEPS,
            prompt_cache=pc.caches,
            prefill_step_size=TINY_A,
        )
        == text
    )


def test_resumes_states_the_depth_condition():
    """Aligned depths and n - 1 resume; zero, the whole prompt and other depths do not."""
    assert [d for d in range(0, 131) if resumes(d, prompt_len=130, alignment=64)] == [64, 128, 129]
    assert not resumes(128, prompt_len=128, alignment=64)
    assert resumes(127, prompt_len=128, alignment=64)


def test_to_mlx_lm_hands_out_the_logits_and_refuses_what_a_restore_refuses(tiny_models):
    """The exact cut's PromptCache carries its witnessed logits; a logit-less aligned cut
    gives None; a logit-less exact cut is LogitsMissing and a cut of another identity
    (another tenant) IdentityMismatch."""
    s = side(tiny_models["float32"])
    cuts = engine_cuts(s.pool, PROMPT)
    exact = to_mlx_lm(s.pool, cuts[len(PROMPT)])
    assert mx.array_equal(exact.logits, cuts[len(PROMPT)].logits)
    assert to_mlx_lm(s.pool, drop_logits(cuts[2 * TINY_A])).logits is None
    with pytest.raises(LogitsMissing):
        to_mlx_lm(s.pool, drop_logits(cuts[len(PROMPT)]))
    tenant = side(tiny_models["float32"], namespace="tenant-b")
    with pytest.raises(IdentityMismatch):
        to_mlx_lm(tenant.pool, encode(cuts[len(PROMPT)]))


def test_a_cache_mlx_lm_prefilled_in_aligned_steps_restores_like_a_cold_run(tiny_models):
    """mlx-lm's own model and caches, prefilled by prefill_aligned: the whole prompt with
    its logits (an exact cut) and the first 256 tokens without (an ancestor), each made a
    Snapshot by from_mlx_lm and restored through its planes into an engine slot, leave the
    engine's cold cache bytes and continue like it — also after mlx-lm went on decoding
    into the very caches the snapshot was taken from."""
    s = side(tiny_models["float32"])
    reference_slot = cold(s.pool, PROMPT, 0)
    state, reference = physical(reference_slot), continue_greedy(reference_slot, STEPS)
    caches = make_prompt_cache(s.model)
    logits = prefill_aligned(s.model, caches, PROMPT, alignment=TINY_A)
    exact = from_mlx_lm(s.pool, caches, tokens=PROMPT, logits=logits)
    head = make_prompt_cache(s.model)
    prefill_aligned(s.model, head, PROMPT[: 4 * TINY_A], alignment=TINY_A)
    ancestor = from_mlx_lm(s.pool, head, tokens=PROMPT[: 4 * TINY_A])
    assert ancestor.logits is None and exact.depth == len(PROMPT)
    run(s, [7], caches)  # mlx-lm keeps writing into the caches
    b = s.pool.slot(1)
    b.restore(encode(exact), prompt=PROMPT)
    assert physical(b) == state and continue_greedy(b, STEPS) == reference
    b.reset()
    b.restore(encode(ancestor), prompt=PROMPT)
    b.prefill(PROMPT[4 * TINY_A :])
    assert physical(b) == state and continue_greedy(b, STEPS) == reference


def _prefilled(model, tokens, caches=None):
    caches = make_prompt_cache(model) if caches is None else caches
    logits = prefill_aligned(model, caches, tokens, alignment=TINY_A)
    return caches, logits


def test_from_mlx_lm_refuses_caches_that_do_not_fit(tiny_models):
    """Wrong layer count, all-rotating caches (as max_kv_size makes), a quantized KV
    cache, a batch of two, another depth than the tokens, no tokens at all, a non-aligned
    cut without logits, logits of the wrong shape (or a scalar), a whole prompt in one step
    (its ring is too long for aligned steps) and the caches of the bfloat16 copy: each a
    RestoreRefused, the errors a restore raises."""
    s = side(tiny_models["float32"])
    p = PROMPT[:150]
    caches, logits = _prefilled(s.model, p)
    one_step = make_prompt_cache(s.model)
    mx.eval(s.model(mx.array(p)[None], cache=one_step))
    batch = make_prompt_cache(s.model)
    mx.eval(s.model(mx.array([p, p]), cache=batch))
    quantized = list(caches)
    quantized[1] = QuantizedKVCache(group_size=32, bits=8)  # tiny's head dim is too small
    quantized[1].offset = len(p)
    bf16 = side(tiny_models["bfloat16"])
    half, half_logits = _prefilled(bf16.model, p)
    rotating = [RotatingKVCache(max_size=64, keep=4) for _ in caches]
    cases = {
        "layer count": (caches[:-1], p, logits, ShapeMismatch),
        "rotating": (_prefilled(s.model, p, rotating)[0], p, logits, ShapeMismatch),
        "quantized kv": (quantized, p, logits, ShapeMismatch),
        "batch": (batch, p, logits, ShapeMismatch),
        "depth": (caches, p[:-1], logits, ShapeMismatch),
        "unaligned, no logits": (caches, p, None, RestoreRefused),
        "logits shape": (caches, p, logits[None], ShapeMismatch),
        "logits scalar": (caches, p, logits[0], ShapeMismatch),
        "no tokens": (make_prompt_cache(s.model), [], None, ShapeMismatch),
        "one step": (one_step, p, logits, ShapeMismatch),
        "dtype": (half, p, half_logits, ShapeMismatch),
    }
    outcomes = {}
    for name, (given, tokens, lg, _) in cases.items():
        try:
            from_mlx_lm(s.pool, given, tokens=tokens, logits=lg)
            outcomes[name] = "accepted"
        except RestoreRefused as e:
            outcomes[name] = type(e).__name__
    assert outcomes == {name: case[-1].__name__ for name, case in cases.items()}
    assert from_mlx_lm(s.pool, caches, tokens=p, logits=logits).depth == len(p)


def test_prefill_aligned_checks_its_input(tiny_models):
    """No tokens, a bad alignment, or layers at different depths: InvalidRequest."""
    s = side(tiny_models["float32"])
    caches, _ = _prefilled(s.model, PROMPT[:10])
    with pytest.raises(InvalidRequest):
        prefill_aligned(s.model, caches, [], alignment=TINY_A)
    with pytest.raises(InvalidRequest):
        prefill_aligned(s.model, caches, [1], alignment=0)
    mixed = [*caches[:-1], make_prompt_cache(s.model)[-1]]
    with pytest.raises(InvalidRequest, match="different depths"):
        prefill_aligned(s.model, mixed, [1], alignment=TINY_A)
