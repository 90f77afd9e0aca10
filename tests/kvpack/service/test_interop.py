"""mlx-lm's own caches in and out of the vault (kvpack/service/interop.py, through the
Python API's vault.prompt_cache and vault.publish), on `tiny`'s mlx-lm directories at
A = 64: what the vault holds continues in mlx-lm's own generate exactly as its cold run
does, from the resident and from the durable tier, under the documented conditions
(engine/interop.py); what mlx-lm computed in aligned steps and published is served to
model.generate like the engine's own cold state."""

from __future__ import annotations

import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import kvpack
from engine.errors import InvalidRequest, RestoreRefused, ShapeMismatch
from kvpack.config import Settings
from tests.engine.slotkit import TINY_A, prompt

P = prompt(300, seed=31)  # P[:-1]: the deepest aligned cut is at 256
Q = prompt(200, seed=32)
STEPS = 24


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


def run(mlx_model, tokenizer, tokens, cache=None) -> list[tuple[int, bytes]]:
    """mlx-lm's stream_generate at prefill_step_size = A: each token with the bytes of its
    log-probabilities (so a difference in the last bit of any step shows)."""
    return [
        (r.token, bytes(memoryview(r.logprobs)))
        for r in stream_generate(
            mlx_model,
            tokenizer,
            tokens,
            max_tokens=STEPS,
            prompt_cache=cache,
            prefill_step_size=TINY_A,
        )
    ]


def hits(model: kvpack.Model) -> float:
    return model.service.accounting.total("kvpack_hits_total")


@pytest.mark.parametrize("variant", ["float32", "q4g64"])
def test_mlx_lm_continues_the_vaults_cache_as_its_cold_run(
    settings, open_vault, tiny_models, variant
):
    """After model.generate(P): vault.prompt_cache(P[:-1]) is the aligned cut at 256 from
    the resident tier (a hit, counted), and from the durable tier on a fresh vault client;
    mlx-lm's stream_generate over P[256:] from it (mlx-lm's own model, step A) gives the
    very tokens and log-probability bytes of its cold run over P. A prompt the vault has
    never seen: depth 0, tier none, and the empty caches behave as no cache."""
    directory = tiny_models[variant]
    mlx_model, tokenizer = mlx_lm_load(str(directory))
    reference = run(mlx_model, tokenizer, P)
    assert len({t for t, _ in reference}) > 4
    vault = open_vault(settings)
    model = vault.model(str(directory))
    model.generate(P, max_tokens=4)
    assert vault.flush(60)
    before = hits(model)
    pc = vault.prompt_cache(model, P[:-1])
    assert (pc.tier, pc.depth) == ("resident", 4 * TINY_A) and pc.restore_seconds > 0
    assert kvpack.resumes(pc.depth, prompt_len=len(P), alignment=model.alignment)
    assert hits(model) == before + 1
    assert run(mlx_model, tokenizer, P[pc.depth :], pc.caches) == reference
    vault.close()

    fresh = open_vault(settings, resident_budget_bytes=0)
    model = fresh.model(str(directory))
    pc = fresh.prompt_cache(model, P[:-1])
    assert (pc.tier, pc.depth) == ("durable", 4 * TINY_A)
    assert run(mlx_model, tokenizer, P[pc.depth :], pc.caches) == reference
    unseen = fresh.prompt_cache(model, Q)
    assert (unseen.tier, unseen.depth, unseen.logits) == ("none", 0, None)
    assert all(c.offset == 0 for c in unseen.caches)
    assert run(mlx_model, tokenizer, Q, unseen.caches) == run(mlx_model, tokenizer, Q)


def test_the_exact_cut_carries_its_witnessed_logits(settings, open_vault, tiny_models):
    """vault.prompt_cache(P) after model.generate(P) is the exact cut, its caches at depth
    300 and its logits the very bytes mlx-lm's model computes over P in aligned steps."""
    vault = open_vault(settings)
    model = vault.model(str(tiny_models["float32"]))
    model.generate(P, max_tokens=1)
    assert vault.flush(60)
    pc = vault.prompt_cache(model, P)
    assert (pc.tier, pc.depth) == ("resident", len(P))
    assert all(c.offset == len(P) for c in pc.caches)
    mlx_model, _ = mlx_lm_load(str(tiny_models["float32"]))
    logits = kvpack.prefill_aligned(mlx_model, make_prompt_cache(mlx_model), P, alignment=TINY_A)
    assert pc.logits is not None and bytes(memoryview(pc.logits)) == bytes(memoryview(logits))


def test_published_mlx_lm_state_serves_generate_like_a_cold_run(
    settings, open_vault, tiny_models, tmp_path
):
    """mlx-lm's own model prefills Q in aligned steps (prefill_aligned) and vault.publish
    seals it (durable on return): model.generate(Q) is then served from the resident tier
    and, on a fresh vault client, from the durable tier, with the tokens a cold run on an
    empty vault gives. Publishing the same state again is the same manifest."""
    directory = str(tiny_models["float32"])
    mlx_model, _ = mlx_lm_load(directory)
    caches = make_prompt_cache(mlx_model)
    logits = kvpack.prefill_aligned(mlx_model, caches, Q, alignment=TINY_A)
    vault = open_vault(settings)
    model = vault.model(directory)
    manifest = vault.publish(model, Q, caches, logits=logits)
    assert (manifest.depth, manifest.logits_witnessed) == (len(Q), True)
    assert vault.publish(model, Q, caches, logits=logits).id == manifest.id
    warm = model.generate(Q, max_tokens=STEPS)
    assert (warm.tier, warm.cached_tokens, warm.prefill_seconds) == ("resident", len(Q), 0.0)
    vault.close()

    durable = open_vault(settings, resident_budget_bytes=0).model(directory)
    from_durable = durable.generate(Q, max_tokens=STEPS)
    assert (from_durable.tier, from_durable.cached_tokens) == ("durable", len(Q))
    elsewhere = Settings.load(data_dir=tmp_path / "elsewhere", alignment=TINY_A, env={})
    cold = open_vault(elsewhere).model(directory).generate(Q, max_tokens=STEPS)
    assert cold.tier == "none"
    assert warm.tokens == from_durable.tokens == cold.tokens and len(set(cold.tokens)) > 3


def test_publish_refuses_what_does_not_fit_and_stores_nothing(settings, open_vault, tiny_models):
    """The bfloat16 copy's caches offered as the float32 model's (a dtype mismatch), a
    non-aligned cut without logits, and caches holding fewer tokens than given: each a
    RestoreRefused, and the vault holds no cut of those tokens. A model of another vault
    client is an InvalidRequest."""
    vault = open_vault(settings)
    model = vault.model(str(tiny_models["float32"]))
    half, _ = mlx_lm_load(str(tiny_models["bfloat16"]))
    half_caches = make_prompt_cache(half)
    half_logits = kvpack.prefill_aligned(half, half_caches, Q, alignment=TINY_A)
    caches = model.make_prompt_cache()
    logits = model.prefill_aligned(caches, Q)
    cases = {
        "dtype": (half_caches, Q, half_logits, ShapeMismatch),
        "no logits": (caches, Q, None, RestoreRefused),
        "depth": (caches, [*Q, 5], logits, ShapeMismatch),
    }
    for name, (given, tokens, lg, error) in cases.items():
        with pytest.raises(error) as info:
            vault.publish(model, tokens, given, logits=lg)
        assert isinstance(info.value, RestoreRefused), name
        assert vault.prompt_cache(model, tokens).tier == "none", name
    other = open_vault(Settings.load(data_dir=settings.data_dir / "other", env={}))
    with pytest.raises(InvalidRequest):
        other.publish(model, Q, caches, logits=logits)
