"""The service's reuse ladder on `tiny` (A = 64, so a 300-token prompt spans four aligned
blocks plus a partial one): which tier serves, what the counters say, and that every
path answers exactly what a cold run answers."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine

from cas.layout import object_key
from catalog import queries
from engine.format import encode
from engine.state import Planes
from kvpack.service.service import Completion, CompletionRequest, Service
from kvpack.tiers.base import Ask
from tests.engine.slotkit import TINY_A, prompt

P = prompt(300, seed=11)
Q = prompt(300, seed=12)  # the miss control: unrelated, same size
N = 3
MAX = 24


def ask(svc: Service, tokens: list[int], *, namespace: str = "default") -> Completion:
    return svc.complete(CompletionRequest(tokens=tokens, max_tokens=MAX, namespace=namespace))


def counters(svc: Service) -> dict[str, float]:
    return svc.accounting.snapshot()


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def deepest_cut(svc: Service, tokens: list[int], namespace: str = "default"):
    scope = svc.tenant(namespace).scope
    return svc.vault.find(scope, scope.chain(tokens))


def resident_cut(svc: Service, tokens: list[int], namespace: str = "default"):
    found = svc.resident.find(Ask.of(svc.tenant(namespace).scope, tokens))
    return None if found is None else found.handle


def test_resident_warm_is_bit_identical_and_miss_control_is_served_by_no_tier(
    settings, open_service
):
    """Branch: resident (exact cut, witnessed logits) after a cold miss in the same process;
    the session tier cannot serve (the slot's history is prompt + generation). A miss
    control of the same size goes through the same path and is served by no tier."""
    svc = open_service(settings)
    cold = ask(svc, P)
    assert (cold.tier, cold.cached_tokens) == ("none", 0)
    assert svc.flush(30)
    warm = ask(svc, P)
    assert (warm.tier, warm.cached_tokens) == ("resident", len(P))
    assert warm.tokens == cold.tokens and warm.finish_reason == cold.finish_reason
    assert warm.prefill_seconds == 0.0 and warm.restore_seconds > 0
    control = ask(svc, Q)
    assert (control.tier, control.cached_tokens) == ("none", 0)


def test_counter_alibi_resident_and_session_continuation(settings, open_service):
    """Branches: n resident hits move hits by exactly n and the resident byte ESTIMATE by
    n x the cut's payload, and never the prefill or miss counters; then a session
    continuation (history is a prefix of the request) moves its own counter, not hits."""
    svc = open_service(settings)
    ask(svc, P)
    assert svc.flush(30)
    cut = resident_cut(svc, P)
    before = counters(svc)
    for _ in range(N):
        assert ask(svc, P).tier == "resident"
    assert moved(before, counters(svc)) == pytest.approx(
        {
            "kvpack_hits_total:resident": N,
            "kvpack_restored_tokens_total:resident": N * len(P),
            "kvpack_resident_bytes_served_estimate_total": N * cut.estimated_bytes,
            "kvpack_restore_seconds_count:resident": N,
            "kvpack_restore_seconds_sum:resident": moved(before, counters(svc))[
                "kvpack_restore_seconds_sum:resident"
            ],
            "kvpack_first_token_seconds_count:resident": N,  # one first token per request
            "kvpack_first_token_seconds_sum:resident": moved(before, counters(svc))[
                "kvpack_first_token_seconds_sum:resident"
            ],
        }
    )
    last = ask(svc, P)
    assert last.finish_reason == "length"  # its last token was sent, never run
    before = counters(svc)
    follow = ask(svc, [*P, *last.tokens, 10, 11, 12])
    assert (follow.tier, follow.cached_tokens) == ("session", len(P) + len(last.tokens) - 1)
    delta = moved(before, counters(svc))
    assert delta["kvpack_session_continuations_total"] == 1
    assert not any(k.startswith("kvpack_hits_total") for k in delta)
    assert delta["kvpack_prefill_tokens_total"] == 4  # that token, then the new three


def test_durable_warm_on_a_fresh_instance_is_bit_identical_with_counter_alibi(
    shared_settings, open_service
):
    """Branch: durable (find_deepest -> verified chunk fetch -> restore), on a fresh
    service over the same store + catalog, whose resident budget is 0 so only durable can
    serve. n identical requests: hits by exactly n, bytes served = n x the manifest's
    bytes, no prefill, no miss; catalog last_hit_at set. A miss control: no tier."""
    first = open_service(shared_settings)
    cold = ask(first, P)
    assert cold.tier == "none"
    assert first.flush(30)
    assert first.background.stats()["failed"] == 0
    first.close()

    svc = open_service(shared_settings, resident_budget_bytes=0)
    assert svc.vault.producer == first.vault.producer  # kept in the data dir
    cut = deepest_cut(svc, P)
    assert cut is not None and cut.depth == len(P) and cut.logits_witnessed
    before = counters(svc)
    for _ in range(N):
        warm = ask(svc, P)
        assert (warm.tier, warm.cached_tokens) == ("durable", len(P))
        assert warm.tokens == cold.tokens
    delta = moved(before, counters(svc))
    assert delta["kvpack_hits_total:durable"] == N
    assert delta["kvpack_bytes_served_total:durable"] == N * cut.bytes
    assert "kvpack_prefill_tokens_total" not in delta
    assert "kvpack_misses_total" not in delta
    assert svc.flush(30)
    with svc.vault.transaction() as s:
        assert s.get(queries.ManifestRow, cut.manifest_id.hex).last_hit_at
    control = ask(svc, Q)
    assert (control.tier, control.cached_tokens) == ("none", 0)


def test_durable_caps_resident(settings, open_service):
    """Branch: resident lookup capped by the deepest durable cut (invariant 2). The
    resident tier holds the exact 300-token cut, but the catalog has lost every cut
    deeper than 128: the resident tier serves 128 tokens, not 300, and the answer is
    still the cold one."""
    svc = open_service(settings, durable_every=128)
    cold = ask(svc, P)
    assert svc.flush(30)
    deeper = [deepest_cut(svc, P[:depth]) for depth in (256, len(P))]
    assert [cut.depth for cut in deeper] == [256, len(P)]
    with svc.vault.transaction() as s:
        for cut in deeper:
            queries.delete_manifest(session=s, manifest_id=cut.manifest_id, now=datetime.now(UTC))
    assert deepest_cut(svc, P).depth == 128
    warm = ask(svc, P)
    assert (warm.tier, warm.cached_tokens) == ("resident", 128)
    assert warm.tokens == cold.tokens


def test_exact_hit_needs_witnessed_logits(settings, open_service):
    """Branch: durable exact cut without witnessed logits (invariant 3). The catalog
    holds the full 300-token cut logit-less and an aligned 256 cut: the ladder restores
    the 256 ancestor and prefills the rest — no exact restore, no verification failure —
    and answers what a cold run answers."""
    svc = open_service(settings)
    tenant = svc.tenant("default")
    slot = tenant.pool.slot(0)

    def publish(depth: int, *, logits: bool) -> None:
        slot.reset()
        slot.prefill(P[:depth])
        planes = encode(slot.export())
        if not logits:  # the same cut as a logit-less one: no logits part, none in the layout
            planes = Planes(
                layout={**planes.layout, "logits": None},
                parts=tuple((r, d) for r, d in planes.parts if r != "logits"),
            )
        svc.vault.publish(
            tenant.scope,
            P[:depth],
            layout=planes.layout,
            parts=planes.parts,
            logits_witnessed=logits,
        )

    publish(256, logits=True)
    publish(len(P), logits=False)
    cold = slot.generate(max_tokens=MAX, stop=()).tokens  # slot holds exactly P: a cold run
    slot.reset()
    before = counters(svc)
    warm = ask(svc, P)
    assert (warm.tier, warm.cached_tokens) == ("durable", 256)
    assert warm.tokens == cold[: len(warm.tokens)] and warm.finish_reason in ("length", "stop")
    delta = moved(before, counters(svc))
    assert not any(k.startswith("kvpack_verification_failures") for k in delta)


def test_identity_swap_rescopes_and_wrong_identity_is_unreachable(settings, open_service):
    """Branches: identity scoping (invariant 1). The same prompt under another namespace
    salt finds nothing that the first namespace stored (a miss, same answer). Planes made
    under the first identity but planted in the resident tier and the catalog under the
    second are refused by the engine's identity gate: each is counted as a verification
    failure, the request recomputes, and the answer is still the cold one."""
    svc = open_service(settings)
    cold = ask(svc, P)
    assert svc.flush(30)
    other = ask(svc, P, namespace="other")
    assert (other.tier, other.cached_tokens) == ("none", 0)
    assert other.tokens == cold.tokens
    assert ask(svc, P).tier == "resident"  # back under the first identity: still there
    assert svc.flush(30)

    mine, theirs = svc.tenant("default"), svc.tenant("other")
    assert mine.scope.identity != theirs.scope.identity
    fresh = prompt(300, seed=13)  # a history "other" has never published
    reference = ask(svc, fresh)  # cold, under "default"
    slot = mine.pool.slot(0)
    slot.reset()
    slot.prefill(fresh)
    planes = encode(slot.export())  # identity "default" inside the planes
    svc.resident.hold(theirs.scope, fresh, planes)
    svc.vault.publish(
        theirs.scope,
        fresh,
        layout=planes.layout,
        parts=planes.parts,
        logits_witnessed=True,
    )
    before = counters(svc)
    planted = ask(svc, fresh, namespace="other")
    assert (planted.tier, planted.cached_tokens) == ("none", 0)
    assert planted.tokens == reference.tokens
    delta = moved(before, counters(svc))
    assert delta["kvpack_verification_failures_total:resident"] == 1
    assert delta["kvpack_verification_failures_total:durable"] == 1
    assert not any(k.startswith("kvpack_hits_total") for k in delta)


def test_corrupt_chunk_recomputes_and_is_counted(settings, open_service):
    """Branch: durable verification failure. One byte of one stored chunk of the exact
    cut is flipped in the object store; a fresh service's request fails the chunk's
    verification, counts it, recomputes and answers the cold answer — no hit recorded,
    nothing corrupt reaches a slot."""
    first = open_service(settings)
    cold = ask(first, P)
    assert first.flush(30)
    first.close()

    svc = open_service(settings)
    cut = deepest_cut(svc, P)
    chunk = svc.vault.read(
        lambda s: queries.manifest_chunk_ids(session=s, manifest_id=cut.manifest_id)[0]
    )
    key = object_key("chunk", chunk)
    vault, objects = svc.vault, svc.vault.objects
    data = bytearray(vault.run(objects.get(key)))
    data[len(data) // 2] ^= 0x01
    vault.run(objects.delete(key))
    assert vault.run(objects.put_if_absent(key, bytes(data)))

    before = counters(svc)
    warm = ask(svc, P)
    assert (warm.tier, warm.cached_tokens) == ("none", 0)
    assert warm.tokens == cold.tokens
    delta = moved(before, counters(svc))
    assert delta["kvpack_verification_failures_total:durable"] == 1
    assert delta["kvpack_misses_total"] == 1
    assert not any(k.startswith("kvpack_hits_total") for k in delta)


def test_catalog_outage_slows_the_request_it_does_not_fail_it(settings, open_service, tmp_path):
    """Branch: storage outage (invariant 9, degrade open). With the catalog unreachable
    the durable cap is unknown, so neither durable nor resident serves (fail closed): the
    request recomputes and answers correctly; no verification failure is counted, and the
    failed publications are counted by the publisher, not raised."""
    svc = open_service(settings)
    cold = ask(svc, P)
    assert svc.flush(30)
    healthy = svc.vault.db
    (tmp_path / "not-a-dir").write_text("")  # a catalog path that cannot be opened
    svc.vault.db = create_engine(f"sqlite:///{tmp_path}/not-a-dir/catalog.sqlite3")
    try:
        before = counters(svc)
        warm = ask(svc, P)
        assert (warm.tier, warm.tokens) == ("none", cold.tokens)
        assert not any(k.startswith("kvpack_verification") for k in moved(before, counters(svc)))
        assert svc.flush(30)
        assert svc.publication.deferred.stats()["failed"] > 0  # the durable publications
    finally:
        svc.vault.db.dispose()
        svc.vault.db = healthy


def test_a_session_that_decoded_publishes_no_cut_of_its_decoded_state(settings, open_service):
    """Branch: publication skips states that are not cold-equivalent. A session continuation
    over history that holds decoded tokens crosses aligned boundaries, yet no cut deeper
    than the first prompt's cold prefill is published, so no later request can restore
    decoded K/V as if a cold run had computed them."""
    svc = open_service(settings)
    first = ask(svc, P)
    history = P + first.tokens
    extended = history + prompt(2 * TINY_A, seed=13)
    assert ask(svc, extended).tier == "session"
    assert svc.flush(30)
    cut = resident_cut(svc, extended)
    assert cut is not None and cut.depth == (len(P) // TINY_A) * TINY_A
    durable = deepest_cut(svc, extended)
    assert durable is not None and durable.depth <= len(P)


def test_a_drawn_token_is_sent_before_the_model_runs_it(settings, open_service):
    """Each token reaches on_token while the slot still holds only what came before it:
    on an exact hit the first token needs no forward at all. The answer is unchanged."""
    svc = open_service(settings)
    cold = ask(svc, P)
    assert svc.flush(30)
    slot = svc.tenant("default").pool.slot(0)
    depths: list[int] = []
    warm = svc.complete(
        CompletionRequest(tokens=P, max_tokens=MAX),
        on_token=lambda drawn: depths.append(slot.depth),
    )
    assert warm.tier == "resident" and warm.tokens == cold.tokens
    assert depths == [len(P) + i for i in range(len(warm.tokens))]
    # Every token but the last was run; the last was sent, and nothing draws after it.
    assert warm.finish_reason == "length" and slot.depth == len(P) + len(warm.tokens) - 1
