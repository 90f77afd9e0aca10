"""Export, directly (no HTTP): what a vault offers a peer, signed, and what it never offers."""

from __future__ import annotations

import base64

import blake3
import pytest
from sqlalchemy import update

from catalog.models import ManifestRow
from catalog.signing import EXPORT_DOMAIN, verify
from catalog.statement import decode
from kvpack.remote.exporter import Exporter
from tests.engine.slotkit import TINY_A, prompt
from tests.kvpack.remote.peerkit import complete, vault

P = prompt(150, seed=21)


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    service = vault(tmp_path_factory.mktemp("exporter"))
    complete(service, P)
    complete(service, P, namespace="other")
    assert service.flush(60)
    yield service
    service.close()


def find(service, *, scope="*", namespace="default", min_depth=0, tokens=P):
    chain = service.tenant(namespace).scope.chain(tokens)
    identity = service.tenant(namespace).scope.identity
    return Exporter(service.vault).find(
        identity=identity, chain=chain, min_depth=min_depth, scope=scope
    )


def test_the_deepest_cut_is_offered_as_a_statement_signed_by_this_producer(producer):
    answer = find(producer)
    assert answer is not None and answer.depth == len(P)
    keys = producer.vault.producer_keys
    assert verify(keys.public_keys(), EXPORT_DOMAIN, answer.statement, answer.signature)
    statement = decode(answer.statement)
    assert (statement.depth, statement.producer, statement.manifest) == (
        len(P), keys.producer, answer.manifest,
    )  # fmt: skip
    assert statement.size == answer.size
    doc = answer.to_json()
    assert base64.b64decode(doc["statement"]) == answer.statement and doc["depth"] == len(P)


def test_the_planes_are_the_parts_the_statement_claims(producer):
    answer = find(producer)
    data = Exporter(producer.vault).planes(manifest_id=answer.manifest, scope="*")
    statement = decode(answer.statement)
    offset = 0
    for claim in statement.parts:
        part = data[offset : offset + claim.size]
        assert blake3.blake3(part).digest() == claim.digest
        offset += claim.size
    assert offset == len(data) == answer.size


def test_nothing_deeper_than_asked_and_nothing_of_another_alignment(producer):
    assert find(producer, min_depth=len(P)) is None
    shallower = find(producer, min_depth=TINY_A)
    assert shallower is not None and shallower.depth == len(P)
    chain = producer.tenant("default").scope.chain(P)
    other_a = type(chain)(alignment=TINY_A * 2, depth=chain.depth, links=chain.links)
    exporter = Exporter(producer.vault)
    identity = producer.tenant("default").scope.identity
    assert exporter.find(identity=identity, chain=other_a, min_depth=0, scope="*") is None


def test_a_namespace_scoped_key_sees_only_its_tenant(producer):
    assert find(producer, scope="default") is not None
    assert find(producer, scope="other") is None  # the default tenant's cut
    assert find(producer, scope="other", namespace="other") is not None


def test_an_imported_cut_is_never_re_exported(producer):
    """Provenance other than "local" (a peer's cut promoted here) is not offered."""
    answer = find(producer)
    with producer.vault.transaction() as s:
        s.execute(
            update(ManifestRow)
            .where(ManifestRow.id == answer.manifest.hex)
            .values(provenance="peer:elsewhere")
        )
    try:
        again = find(producer)
        assert again is None or again.manifest != answer.manifest
        assert Exporter(producer.vault).planes(manifest_id=answer.manifest, scope="*") is None
    finally:
        with producer.vault.transaction() as s:
            s.execute(
                update(ManifestRow)
                .where(ManifestRow.id == answer.manifest.hex)
                .values(provenance="local")
            )
