"""Producer keys, bundles and endorsements; export statements' strict encoding."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from catalog.ids import ChainDigest, IdentityDigest, ManifestId
from catalog.signing import (
    EXPORT_DOMAIN,
    MANIFEST_DOMAIN,
    Bundle,
    BundleInvalid,
    ProducerKeys,
    SignatureInvalid,
    verify,
)
from catalog.statement import Statement, StatementInvalid, claims_for, decode, encode


def test_a_signature_verifies_only_under_its_key_domain_and_message():
    keys = ProducerKeys.generate("vault-a")
    slot = keys.sign(EXPORT_DOMAIN, b"body")
    assert verify(keys.public_keys(), EXPORT_DOMAIN, b"body", slot) == keys.current_id
    with pytest.raises(SignatureInvalid, match="does not verify"):
        verify(keys.public_keys(), EXPORT_DOMAIN, b"bodY", slot)
    with pytest.raises(SignatureInvalid, match="does not verify"):  # domains never cross
        verify(keys.public_keys(), MANIFEST_DOMAIN, b"body", slot)
    with pytest.raises(SignatureInvalid, match="not trusted"):
        verify(ProducerKeys.generate("vault-a").public_keys(), EXPORT_DOMAIN, b"body", slot)
    with pytest.raises(SignatureInvalid, match="bytes"):
        verify(keys.public_keys(), EXPORT_DOMAIN, b"body", slot[:-1])


def test_rotation_endorses_the_new_key_and_keeps_the_old_one(tmp_path):
    keys = ProducerKeys.generate("vault-a")
    old_slot = keys.sign(MANIFEST_DOMAIN, b"m")
    rotated = keys.rotate()
    assert rotated.current_id != keys.current_id
    # What the old key signed still verifies with the rotated file's keys.
    assert verify(rotated.public_keys(), MANIFEST_DOMAIN, b"m", old_slot) == keys.current_id
    path = tmp_path / "producer-key.json"
    rotated.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    again = ProducerKeys.load(path)
    assert again.bundle() == rotated.bundle()
    bundle = Bundle.from_json(rotated.bundle().to_json())
    [first, second] = bundle.keys
    assert second.endorsed_by == first.id
    assert [k.id for k in bundle.endorsed_from({first.id: first.public})] == [second.id]
    assert bundle.endorsed_from({}) == []  # nothing trusted: nothing follows


def test_a_tampered_or_broken_endorsement_chain_is_refused():
    bundle = ProducerKeys.generate("vault-a").rotate().rotate().bundle()
    doc = json.loads(bundle.to_json())
    sig = doc["keys"][2]["endorsement"]
    doc["keys"][2]["endorsement"] = ("0" if sig[0] != "0" else "1") + sig[1:]
    with pytest.raises(BundleInvalid, match="does not verify"):
        Bundle.from_json(json.dumps(doc))
    # A foreign key spliced in, claiming an endorsement it does not have.
    foreign = ProducerKeys.generate("vault-a").bundle().keys[0]
    spliced = dataclasses.replace(
        bundle,
        keys=(
            *bundle.keys,
            dataclasses.replace(foreign, endorsed_by=bundle.keys[2].id, endorsement=b"\0" * 64),
        ),  # fmt: skip
    )
    with pytest.raises(BundleInvalid):
        spliced.check()
    # A renamed producer invalidates every endorsement (the name is signed).
    with pytest.raises(BundleInvalid):
        dataclasses.replace(bundle, producer="vault-b").check()


def statement(**over) -> Statement:
    fields = dict(
        identity=IdentityDigest(b"\1" * 32),
        depth=150,
        alignment=64,
        chain=ChainDigest(b"\2" * 32),
        logits_witnessed=True,
        layout={"format": 1, "blocks": []},
        parts=claims_for([("k0", b"abc"), ("logits", b"")]),
        producer="vault-a",
        generation=2**63 - 1,
        manifest=ManifestId.from_hex("ab" * 16),
    )
    return Statement(**{**fields, **over})


def test_statement_round_trips_and_refuses_anything_non_canonical():
    s = statement()
    body = encode(s)
    assert decode(body) == s
    assert s.size == 3 and s.parts[0].matches(b"abc") and not s.parts[0].matches(b"abd")
    doc = json.loads(body)
    cases = {
        "extra field": {**doc, "extra": 1},
        "negative depth": {**doc, "depth": -1},
        "generation past 2**63-1": {**doc, "generation": 2**63},
        "bool for int": {**doc, "depth": True},
        "short digest": {**doc, "chain": "ab"},
        "no planes": {**doc, "planes": []},
    }
    for name, bad in cases.items():
        with pytest.raises(StatementInvalid):
            decode(json.dumps(bad, sort_keys=True, separators=(",", ":")).encode())
        assert name
    with pytest.raises(StatementInvalid, match="canonical"):
        decode(json.dumps(doc, sort_keys=True, indent=1).encode())
    with pytest.raises(StatementInvalid, match="not JSON"):
        decode(b"\xff")


def test_a_key_file_is_created_once_and_never_replaced(tmp_path):
    path = tmp_path / "producer-key.json"
    first = ProducerKeys.create(path, "vault-a")
    with pytest.raises(FileExistsError):
        ProducerKeys.create(path, "vault-a")
    assert ProducerKeys.load_or_create(path, "vault-a").current_id == first.current_id
    assert [p.name for p in tmp_path.iterdir()] == ["producer-key.json"]  # no temp left
