"""Self-healing (kvpack/tiers/durable.py refused, catalog/condemn.py): a durable cut that
fails verification is condemned on first sight, the request recomputes the right
answer, and the recompute republishes cleanly, so the next identical request (on a fresh
instance, where only the durable tier can serve) is a durable hit again."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from catalog import queries
from catalog.models import CondemnationRow
from kvpack.service.service import Completion, CompletionRequest, Service
from tests.engine.slotkit import prompt

P = prompt(300, seed=21)


def ask(svc: Service, tokens: list[int]) -> Completion:
    return svc.complete(CompletionRequest(tokens=tokens, max_tokens=12))


def exact_cut(svc: Service):
    scope = svc.tenant("default").scope
    return svc.vault.find(scope, scope.chain(P))


def flip_a_chunk(svc: Service, cut) -> None:
    chunk = svc.vault.read(
        lambda s: queries.manifest_chunk_ids(session=s, manifest_id=cut.manifest_id)[-1]
    )
    key = f"chunks/{chunk[:2]}/{chunk}"
    objects = svc.vault.objects
    data = bytearray(svc.vault.run(objects.get(key)))
    data[len(data) // 3] ^= 0x10
    svc.vault.run(objects.delete(key))
    assert svc.vault.run(objects.put_if_absent(key, bytes(data)))


def delete_the_manifest(svc: Service, cut) -> None:
    svc.vault.run(svc.vault.objects.delete(cut.object_key))


@pytest.mark.parametrize(
    ("breaks", "reason"),
    [(flip_a_chunk, "chunk_corrupt"), (delete_the_manifest, "manifest_missing")],
)
def test_a_broken_cut_is_condemned_recomputed_and_a_durable_hit_again(
    settings, open_service, breaks, reason
):
    """Request 1 (fresh instance) meets the damage: a verification failure counted with
    its reason, the cut condemned (find no longer offers it), a miss with the cold
    output. Request 2 on another fresh instance is a durable hit with the same output."""
    first = open_service(settings)
    cold = ask(first, P)
    assert first.flush(60)
    first.close()

    svc = open_service(settings)
    broken = exact_cut(svc)
    breaks(svc, broken)
    one = ask(svc, P)
    assert (one.tier, one.tokens) == ("none", cold.tokens)
    a = svc.accounting
    assert a.total("kvpack_verification_failures_total", tier="durable") == 1
    assert a.total("kvpack_condemned_cuts_total", reason=reason) >= 1
    rows = svc.vault.read(lambda s: list(s.scalars(select(CondemnationRow))))
    assert broken.manifest_id.hex in {r.manifest for r in rows}
    assert {r.kind for r in rows} == {reason}
    assert svc.flush(60)
    svc.close()

    again = open_service(settings)
    healed = exact_cut(again)
    assert healed is not None and healed.object_key != broken.object_key
    two = ask(again, P)
    assert (two.tier, two.cached_tokens, two.tokens) == ("durable", len(P), cold.tokens)
    assert again.accounting.total("kvpack_verification_failures_total") == 0
