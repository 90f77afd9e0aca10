"""The remote tier end to end: two vaults on loopback, each with its own data dir, object
store and catalog. B imports A's packs through quarantine; every attack is refused,
quarantined with its reason, never served, and the request still answers by recompute."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from cas.errors import ObjectMissing
from catalog.chain import token_chain
from catalog.models import ManifestRow, TrustedKeyRow
from catalog.signing import EXPORT_DOMAIN, ProducerKeys
from kvpack.remote.peers import Peer
from kvpack.service.service import Service
from kvpack.tiers.base import Ask
from tests.engine.slotkit import TINY_A, prompt
from tests.kvpack.conftest import s3_settings
from tests.kvpack.remote.peerkit import (
    Proxy,
    api_key,
    complete,
    edit_statement,
    flip,
    serve,
    trust_producer,
    vault,
)
from tests.kvpack.serverkit import call, serving

P = prompt(150, seed=11)  # two aligned blocks and an exact end
Q = prompt(150, seed=12)  # another prompt A has computed
TIMEOUT_S = 2.0


@dataclass
class Producer:
    service: Service
    url: str
    key: str
    cold: list[int]  # A's cold output for P


@dataclass
class Importer:
    service: Service
    proxy: Proxy
    path: Path


@pytest.fixture(scope="module")
def producer(tmp_path_factory) -> Producer:
    a = vault(tmp_path_factory.mktemp("a"))
    cold = complete(a, P)
    assert cold.tier == "none"
    complete(a, P, namespace="other")  # the same tokens under another tenant's identity
    complete(a, Q)
    assert a.flush(60)
    key = api_key(a, role="peer", namespace="*")
    with serve(a) as url:
        yield Producer(a, url, key, cold.tokens)
    a.close()


@pytest.fixture
def importer(tmp_path, producer) -> Importer:
    b = vault(tmp_path / "b")
    trust_producer(b, producer.service.vault.producer_keys.bundle())
    proxy = Proxy(producer.url)
    with serving(proxy.app()) as url:
        b.use_peers([Peer("a", url, producer.key)], timeout_s=TIMEOUT_S)
        yield Importer(b, proxy, tmp_path / "b")
        b.close()


def counter(service: Service, name: str, **labels: str) -> float:
    """A counter summed over tenant namespaces."""
    return service.accounting.total(name, **labels)


def manifests(service: Service) -> list[ManifestRow]:
    return service.vault.read(lambda s: list(s.scalars(select(ManifestRow))))


def default_identity(service: Service) -> str:
    return service.tenant("default").scope.identity.hex


def test_b_imports_a_pack_it_never_saw_and_serves_it_bit_identical(producer, importer):
    assert_imports_and_serves(importer.service, producer)


@pytest.mark.s3
def test_b_on_s3_and_its_own_database_imports_from_a(producer, tmp_path, db_url, s3_config):
    """The same, with B's catalog on db_url (SQLite and PostgreSQL) and B's objects
    under its own prefix of a real S3 bucket."""
    store = {**s3_settings(s3_config), "store_url": f"s3://{s3_config.bucket}/{s3_config.prefix}b"}
    b = vault(tmp_path / "b", database_url=db_url, **store)
    try:
        trust_producer(b, producer.service.vault.producer_keys.bundle())
        b.use_peers([Peer("a", producer.url, producer.key)], timeout_s=TIMEOUT_S)
        assert_imports_and_serves(b, producer)
    finally:
        b.close()


def assert_imports_and_serves(b: Service, producer: Producer) -> None:
    assert manifests(b) == [] and counter(b, "kvpack_hits_total", tier="remote") == 0
    got = complete(b, P)
    assert (got.tier, got.cached_tokens) == ("remote", len(P))
    assert got.tokens == producer.cold
    assert counter(b, "kvpack_hits_total", tier="remote") == 1
    assert counter(b, "kvpack_remote_imports_total", outcome="promoted") == 1
    [row] = manifests(b)
    assert row.producer == producer.service.vault.producer_keys.producer
    assert row.provenance == "peer:a" and row.depth == len(P)
    [record] = b.quarantine.list()
    assert (record.state, record.manifest, record.depth) == ("promoted", row.id, len(P))
    with pytest.raises(ObjectMissing):
        b.quarantine.get(record.import_id, "statement")  # promoted: quarantine copy gone


def other_identity(producer: Producer) -> str:
    return producer.service.tenant("other").identity.hex


def untrusted_signature(producer: Producer):
    impostor = ProducerKeys.generate(producer.service.vault.producer_keys.producer)
    return lambda raw: impostor.sign(EXPORT_DOMAIN, raw)


ATTACKS = {
    "manifest byte flipped": (
        lambda p, proxy: setattr(proxy, "on_answer", lambda a: edit_statement(a, flip)),
        "does not verify",
    ),
    "chunk byte flipped": (
        lambda p, proxy: setattr(proxy, "on_planes", flip),
        "does not match its signed digest",
    ),
    "signed by an untrusted key": (
        lambda p, proxy: setattr(
            proxy,
            "on_answer",
            lambda a: edit_statement(a, lambda raw: raw, signature=untrusted_signature(p)),
        ),
        "not trusted",
    ),
    "a pack of another identity": (
        lambda p, proxy: setattr(proxy, "on_find", lambda d: {**d, "identity": other_identity(p)}),
        "statement is for identity",
    ),
    "truncated planes body": (
        lambda p, proxy: setattr(proxy, "on_planes", lambda data: data[: len(data) // 2]),
        "truncated planes",
    ),
    "peer times out": (
        lambda p, proxy: setattr(proxy, "stall_planes_s", TIMEOUT_S + 2),
        "timed out",
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_each_attack_is_refused_quarantined_never_served_and_recomputed(producer, importer, attack):
    arm, reason = ATTACKS[attack]
    b = importer.service
    arm(producer, importer.proxy)
    got = complete(b, P)
    assert (got.tier, got.cached_tokens) == ("none", 0)
    assert got.tokens == producer.cold  # answered correctly, by recompute
    [record] = b.quarantine.list()
    assert record.state == "refused" and reason in record.reason, record.reason
    assert b.quarantine.show(record.import_id) == record  # visible to operators
    assert [m for m in manifests(b) if m.provenance != "local"] == []  # never promoted
    assert counter(b, "kvpack_hits_total", tier="remote") == 0
    assert counter(b, "kvpack_verification_failures_total", tier="remote") == 1
    assert counter(b, "kvpack_remote_imports_total", outcome="refused") == 1


def test_a_replayed_answer_is_refused_after_the_pack_is_gone(producer, importer):
    """B imports P, loses the pack (evicted, restarted); the proxy then replays the
    answer it recorded: same generation as the one accepted → refused."""
    b = importer.service
    assert complete(b, P).tier == "remote"
    recorded = importer.proxy.recorded
    b.vault.collect(budget_bytes=0, grace=timedelta(0))
    assert manifests(b) == []
    peer_url = b.remote.peers[0].url
    b.close()
    b2 = vault(importer.path)
    try:
        b2.use_peers([Peer("a", peer_url, producer.key)], timeout_s=TIMEOUT_S)
        importer.proxy.replay = True
        got = complete(b2, P)
        assert importer.proxy.recorded == recorded
        assert (got.tier, got.tokens) == ("none", producer.cold)
        refused = b2.quarantine.list(state="refused")
        assert len(refused) == 1 and "replayed or stale" in refused[0].reason
        assert {m.provenance for m in manifests(b2)} <= {"local"}  # its own recompute only
    finally:
        b2.close()


def test_producer_key_rotation_keeps_old_packs_importable(tmp_path):
    """A pack sealed under A's first key still exports after A rotates; B, which pinned
    only the first key, learns the second through its endorsement."""
    a = vault(tmp_path / "a")
    b = vault(tmp_path / "b")
    try:
        cold = complete(a, P)
        assert a.flush(60)
        first = a.vault.producer_keys.bundle()
        trust_producer(b, first)
        bundle = a.vault.rotate_producer_key(a_key_path(tmp_path))
        new_id = bundle.keys[-1].id
        key = api_key(a, role="peer", namespace="default")
        with serve(a) as url:
            b.use_peers([Peer("a", url, key)], timeout_s=TIMEOUT_S)
            got = complete(b, P)
        assert (got.tier, got.tokens) == ("remote", cold.tokens)
        rows = b.vault.read(
            lambda s: {r.key_id: r.endorsed_by for r in s.scalars(select(TrustedKeyRow))}
        )
        assert rows == {first.keys[0].id: None, new_id: first.keys[0].id}
    finally:
        a.close()
        b.close()


def a_key_path(tmp_path: Path) -> Path:
    return tmp_path / "a" / "producer-key.json"


def test_a_tenant_scoped_peer_key_sees_only_its_namespace(producer, tmp_path):
    """A peer key for namespace "other" cannot import the default tenant's pack."""
    b = vault(tmp_path / "b")
    try:
        trust_producer(b, producer.service.vault.producer_keys.bundle())
        key = api_key(producer.service, role="peer", namespace="other")
        b.use_peers([Peer("a", producer.url, key)], timeout_s=TIMEOUT_S)
        got = complete(b, P)
        assert (got.tier, got.tokens) == ("none", producer.cold)
        assert b.quarantine.list() == []  # "no cut": nothing to quarantine
    finally:
        b.close()


def test_find_refuses_links_that_do_not_form_a_chain(producer):
    chain = token_chain(P, alignment=TINY_A)
    body = {
        "identity": default_identity(producer.service),
        "alignment": TINY_A,
        "depth": len(P),
        "links": [[d + 1, h.hex] for d, h in chain.links],
        "min_depth": 0,
    }
    status, _, _ = call(producer.url, "POST", "/v1/peer/find", token=producer.key, body=body)
    assert status == 400


def test_a_peer_that_timed_out_is_not_asked_again_during_its_backoff(producer, importer):
    b = importer.service
    importer.proxy.stall_planes_s = TIMEOUT_S + 2
    assert complete(b, P).tier == "none"
    asked = list(importer.proxy.paths)
    got = complete(b, Q)  # another miss A could serve, right after
    assert got.tier == "none" and got.tokens == complete(producer.service, Q).tokens
    assert importer.proxy.paths == asked  # the peer was not asked at all
    assert len(b.quarantine.list()) == 1


def test_a_shallow_local_cut_still_imports_the_peers_deeper_one(producer, importer):
    """The remote tier is asked whenever a peer could beat the best local cut: B holds
    P's first aligned block only (its own, computed locally), A holds all of P; B
    imports A's deeper cut and serves it, bit-identical to A's cold output."""
    b = importer.service
    shallow = complete(b, P[:TINY_A])  # B computes P's first block itself (a peer miss)
    assert shallow.tier == "none" and b.flush(30)
    b.resident.clear()  # only B's durable tier holds its shallow cut now
    assert b.durable.find(Ask.of(b.tenant("default").scope, P)).depth == TINY_A
    got = complete(b, P)
    assert (got.tier, got.cached_tokens) == ("remote", len(P))
    assert got.tokens == producer.cold
    assert {m.provenance for m in manifests(b)} >= {"local", "peer:a"}
