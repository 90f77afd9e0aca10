"""`kvpack vault forget --model` on a vault that two models share: the forgotten model's
cuts are unreachable at once (0 hits, also for a peer asking through the exporter), the
other model's hits are unchanged, and GC then reclaims the forgotten model's bytes."""

from __future__ import annotations

import pytest

from engine.identity import arrays_digest
from engine.models import load_model
from engine.models.loaded import assemble
from engine.models.tiny import tiny_model, tiny_tokenizer
from kvpack.cli import main
from kvpack.service.service import CompletionRequest, Service
from kvpack.vault import Vault
from tests.engine.slotkit import TINY_A, prompt

P = prompt(200, seed=31)


@pytest.fixture
def two_models(settings):
    """The built-in tiny and a second tiny ("tiny-b", other weights), each in its own
    service on one vault."""
    from engine.models.tiny import tiny_weights

    b = assemble(
        name="tiny-b",
        model=tiny_model(2),
        tokenizer=tiny_tokenizer(),
        weights_digest=arrays_digest(dict(tiny_weights(2))),
        alignment=TINY_A,
        namespace="default",
    )
    services = []

    def service(loaded):
        svc = Service(loaded=loaded, vault=Vault.open(settings))
        services.append(svc)
        return svc

    yield lambda: service(load_model("tiny", alignment=TINY_A)), lambda: service(b)
    for svc in services:
        svc.close()


def ask(svc: Service):
    return svc.complete(CompletionRequest(tokens=P, max_tokens=8))


def test_forget_a_model_leaves_the_other_and_gc_reclaims_its_bytes(settings, two_models, capsys):
    make_a, make_b = two_models
    a, b = make_a(), make_b()
    cold_a, cold_b = ask(a), ask(b)
    assert a.flush(60) and b.flush(60)
    scope_a, scope_b = a.tenant("default").scope, b.tenant("default").scope
    a_chunks = chunk_keys(a, scope_a)
    assert a_chunks and a_chunks.isdisjoint(chunk_keys(b, scope_b))
    flags = ["--data-dir", str(settings.data_dir), "--alignment", str(TINY_A)]

    assert main(["vault", "forget", "--model", "tiny", *flags]) == 0
    assert "forgot 2 cut(s)" in capsys.readouterr().out
    assert a.vault.find(scope_a, scope_a.chain(P)) is None
    exported = a.exporter.find(
        identity=scope_a.identity, chain=scope_a.chain(P), min_depth=0, scope="*"
    )
    assert exported is None
    again = ask(a)  # the running instance: resident is capped by durable (now nothing)
    assert (again.tier, again.tokens) == ("none", cold_a.tokens)
    assert a.flush(60)
    assert main(["vault", "forget", "--model", "tiny", *flags]) == 0  # its republished cuts
    capsys.readouterr()

    assert main(["vault", "gc", "--grace", "0s", *flags]) == 0
    left = set(a.vault.run(a.vault.objects.list_keys("chunks/")))
    assert left.isdisjoint(a_chunks) and chunk_keys(b, scope_b) <= left
    fresh_b = make_b()
    hit = ask(fresh_b)
    assert (hit.tier, hit.cached_tokens, hit.tokens) == ("durable", len(P), cold_b.tokens)
    fresh_a = make_a()
    assert fresh_a.accounting.total("kvpack_hits_total") == 0
    miss = ask(fresh_a)
    assert (miss.tier, miss.tokens) == ("none", cold_a.tokens)


def chunk_keys(svc: Service, scope) -> set[str]:
    from catalog.queries import manifest_chunk_ids

    cuts = [svc.vault.find(scope, scope.chain(P[:d])) for d in (192, 200)]
    ids = {
        c
        for cut in cuts
        if cut
        for c in svc.vault.read(
            lambda s, cut=cut: manifest_chunk_ids(session=s, manifest_id=cut.manifest_id)
        )
    }
    return {f"chunks/{i[:2]}/{i}" for i in ids}
