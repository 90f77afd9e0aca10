"""Models as users keep them, through the service (the product path): quantized copies of
`tiny` (the `tiny_models` fixture, converted with mlx-lm's own utilities) serve cold =
warm (resident) = durable bit-identically; a 4-bit and an 8-bit copy on one vault never
meet each other's cuts; several services share one vault, which only its opener closes;
a Hugging Face repo id resolves in the cache (the `hub_cache` fixture). The demo model's
4-bit and 8-bit copies (the `demo_models` fixture) do the same, slow."""

from __future__ import annotations

import pytest

from kvpack.config import Settings
from kvpack.service.service import Completion, CompletionRequest, Service
from kvpack.tiers.resident import ResidentTier
from kvpack.vault import Vault
from tests.engine.slotkit import physical, prompt

P = prompt(300, seed=21)  # four aligned blocks and a partial one at A = 64
MAX = 24


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


def ask(svc: Service, tokens: list[int], max_tokens: int = MAX) -> tuple[Completion, list[tuple]]:
    """A greedy completion and the slot's cache bytes after it (prompt and decode)."""
    done = svc.complete(CompletionRequest(tokens=tokens, max_tokens=max_tokens))
    slot = svc.tenant("default").pool.slot(0)
    return done, physical(slot)


@pytest.mark.parametrize("variant", ["float32", "q4g64", "q8g64"])
def test_cold_warm_and_durable_are_bit_identical(settings, tiny_models, variant):
    """One copy: cold (no tier), then resident (the exact cut), then a fresh service on the
    same vault with no resident budget (durable): the same tokens and the same cache bytes
    after decoding them, so every restored bit equals the cold run's."""
    first = Service.open(settings, model=str(tiny_models[variant]))
    try:
        cold, cold_state = ask(first, P)
        assert (cold.tier, cold.cached_tokens) == ("none", 0) and len(set(cold.tokens)) > 3
        assert first.flush(60) and first.background.stats()["failed"] == 0
        warm, warm_state = ask(first, P)
        assert (warm.tier, warm.cached_tokens) == ("resident", len(P))
    finally:
        first.close()
    second = Service.open(settings, model=str(tiny_models[variant]), resident_budget_bytes=0)
    try:
        durable, durable_state = ask(second, P)
    finally:
        second.close()
    assert (durable.tier, durable.cached_tokens) == ("durable", len(P))
    assert cold.tokens == warm.tokens == durable.tokens
    assert cold_state == warm_state == durable_state


def test_a_4bit_and_an_8bit_copy_never_meet_each_others_cuts(settings, tiny_models):
    """Two services on one vault and one resident tier: the 4-bit copy's cuts (resident
    and durable) are invisible to the 8-bit copy, which recomputes the same prompt (no
    tier) and publishes its own; each then serves itself from the resident tier; the
    catalog holds one exact cut per identity."""
    vault = Vault.open(settings)
    resident = ResidentTier()
    q4, q8 = (
        Service.open(settings, model=str(tiny_models[v]), vault=vault, resident=resident)
        for v in ("q4g64", "q8g64")
    )
    try:
        assert q4.loaded.identity != q8.loaded.identity
        first, _ = ask(q4, P)
        assert first.tier == "none" and q4.flush(60)
        other, _ = ask(q8, P)
        assert (other.tier, other.cached_tokens) == ("none", 0)
        assert q8.flush(60)
        assert ask(q4, P)[0].tier == ask(q8, P)[0].tier == "resident"
        cuts = {}
        for name, svc in (("q4", q4), ("q8", q8)):
            scope = svc.tenant("default").scope
            cuts[name] = vault.find(scope, scope.chain(P))
            assert cuts[name] is not None and cuts[name].depth == len(P)
        assert cuts["q4"].manifest_id != cuts["q8"].manifest_id
        assert {s.identity for s in resident.scopes()} == {
            q4.tenant("default").scope.identity,
            q8.tenant("default").scope.identity,
        }
    finally:
        q4.close()
        q8.close()
        vault.close()


def test_a_shared_vault_stays_open_until_its_opener_closes_it(settings, tiny_models):
    """Closing a service that was handed a vault leaves the vault serving the next service
    (its durable cut loads); a service that opened its own vault closes it."""
    vault = Vault.open(settings)
    try:
        a = Service.open(settings, model="tiny", vault=vault)
        cold, _ = ask(a, P)
        a.close()
        assert not vault.io.loop.is_closed()
        b = Service.open(settings, model="tiny", vault=vault, resident_budget_bytes=0)
        warm, _ = ask(b, P)
        b.close()
        assert (warm.tier, warm.tokens) == ("durable", cold.tokens)
    finally:
        vault.close()
    own = Service.open(settings, model="tiny")
    own.close()
    assert own.vault.io.loop.is_closed()


def test_a_hugging_face_repo_id_serves_cold_warm_and_durable(settings, hub_cache, tiny_models):
    """`kvpack-test/tiny@int4` (a branch of the cached repo: the 4-bit copy) through the
    service: the model of that snapshot, cold, then resident, then durable on a fresh
    service; the same tokens each time."""
    spec = "kvpack-test/tiny@int4"
    svc = Service.open(settings, model=spec, hf_cache=hub_cache)
    try:
        assert svc.loaded.name == spec
        direct = Service.open(settings, model=str(tiny_models["q4g64"]), vault=svc.vault)
        assert direct.loaded.identity == svc.loaded.identity
        direct.close()
        cold, _ = ask(svc, P)
        assert svc.flush(60)
        warm, _ = ask(svc, P)
    finally:
        svc.close()
    fresh = Service.open(settings, model=spec, hf_cache=hub_cache, resident_budget_bytes=0)
    try:
        durable, _ = ask(fresh, P)
    finally:
        fresh.close()
    assert [c.tier for c in (cold, warm, durable)] == ["none", "resident", "durable"]
    assert cold.tokens == warm.tokens == durable.tokens


DEMO_A = 32  # quantized kernels are slow on a CPU: a short chat prompt spans a few blocks
QUESTION = [{"role": "user", "content": "Name the largest planet of the solar system."}]


@pytest.mark.slow
def test_the_demo_models_quantized_copies_through_the_service(tmp_path, demo_models):
    """The demo model's 4-bit and 8-bit copies on one vault: each cold = resident =
    durable (a fresh service, no resident budget) in tokens and cache bytes, and neither
    is ever served the other's cuts."""
    settings = Settings.load(data_dir=tmp_path / "vault", alignment=DEMO_A, env={})
    results: dict[str, list[tuple[Completion, list[tuple]]]] = {}
    vault = Vault.open(settings)
    try:
        resident = ResidentTier()  # one resident tier too: neither sees the other's there
        services = {
            v: Service.open(settings, model=str(demo_models[v]), vault=vault, resident=resident)
            for v in ("q4", "q8")
        }
        tokens = services["q4"].loaded.tokenizer.apply_chat_template(QUESTION)
        assert len(tokens) > DEMO_A
        for v, svc in services.items():
            results[v] = [ask(svc, tokens, max_tokens=8)]
            assert svc.flush(120)
        for v, svc in services.items():
            results[v].append(ask(svc, tokens, max_tokens=8))
            svc.close()
        for v in services:
            fresh = Service.open(
                settings, model=str(demo_models[v]), vault=vault, resident_budget_bytes=0
            )
            results[v].append(ask(fresh, tokens, max_tokens=8))
            fresh.close()
    finally:
        vault.close()
    for v, runs in results.items():
        assert [c.tier for c, _ in runs] == ["none", "resident", "durable"], v
        assert runs[0][0].tokens == runs[1][0].tokens == runs[2][0].tokens, v
        assert runs[0][1] == runs[1][1] == runs[2][1], v
