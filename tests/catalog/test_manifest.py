"""Manifests: canonical encoding, MAC before decoding, typed refusals."""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from cas.ids import ChunkId
from cas.keys import Keyring
from catalog.chain import token_chain
from catalog.errors import GenerationExhausted, ManifestInvalid
from catalog.ids import IdentityDigest
from catalog.manifest import (
    MAGIC,
    Manifest,
    PartRef,
    encode_body,
    idempotency_key,
    make_manifest,
    manifest_id,
    open_manifest,
    open_sealed,
    seal_manifest,
)

IDENTITY = IdentityDigest(bytes(range(32)))


def sample(**over) -> Manifest:
    chain = token_chain(list(range(300)), alignment=256)
    fields = dict(
        identity=IDENTITY,
        depth=300,
        alignment=256,
        chain=chain.digest,
        logits_witnessed=True,
        parts=[
            PartRef("layer0.k.block0", ChunkId(b"\x01" * 32), 1024),
            PartRef("logits", ChunkId(b"\x02" * 32), 64),
        ],
        layout={"layers": 2, "dtype": "float16", "ring": {"window": 128, "offset": 3}},
        generation=7,
        producer="test-producer",
        created_at=datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
    )
    fields.update(over)
    return make_manifest(**fields)


def envelope_with_body(body: bytes, keyring: Keyring, version: int = 1) -> bytes:
    """A correctly MAC'd envelope around arbitrary body bytes (to test what the MAC admits)."""
    key_id, key = keyring.subkey("manifest-mac")
    magic = MAGIC + bytes([version])
    tail = bytes([len(key_id)]) + key_id.encode() + b"\x00\x00" + body
    return magic + hmac.new(key, magic + tail, hashlib.sha256).digest() + tail


def test_seal_then_open_round_trips():
    """Happy path: what was sealed opens equal, with the key id inside."""
    ring = Keyring.generate()
    m = sample()
    opened = open_sealed(seal_manifest(m, ring), ring)
    assert opened.manifest == m and opened.key_id == ring.current and opened.signature == b""
    assert m.aligned is False and m.bytes == 1088


def test_encoding_is_canonical_and_deterministic():
    """Equal manifests encode to equal bytes, whatever the layout's key order."""
    a = sample(layout={"b": 1, "a": [1, 2]})
    b = sample(layout={"a": [1, 2], "b": 1})
    assert encode_body(a) == encode_body(b)
    doc = json.loads(encode_body(a))
    assert doc["identity"] == IDENTITY.hex and doc["version"] == 1
    assert encode_body(a) == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def test_every_flipped_bit_is_refused():
    """Fault: one flipped bit anywhere in the envelope -> ManifestInvalid, nothing returned."""
    ring = Keyring.generate()
    sealed = seal_manifest(sample(), ring)
    for i in range(len(sealed)):
        for bit in (0x01, 0x80):
            damaged = bytearray(sealed)
            damaged[i] ^= bit
            with pytest.raises(ManifestInvalid):
                open_manifest(bytes(damaged), ring)


def test_truncated_envelope_is_refused():
    """Fault: a truncated object -> ManifestInvalid."""
    ring = Keyring.generate()
    sealed = seal_manifest(sample(), ring)
    for n in (0, 5, 40, 45, len(sealed) - 1):
        with pytest.raises(ManifestInvalid):
            open_manifest(sealed[:n], ring)


def test_mac_by_an_unknown_key_is_refused():
    """Fault: a manifest MAC'd by a key this keyring does not hold -> ManifestInvalid."""
    theirs = Keyring.generate().rotate()  # current key id "k2"
    ours = Keyring.generate()  # holds only "k1"
    with pytest.raises(ManifestInvalid, match="unknown key id 'k2'"):
        open_manifest(seal_manifest(sample(), theirs), ours)


def test_mac_under_a_different_secret_with_the_same_key_id_is_refused():
    """Fault: same key id, different vault -> the MAC does not verify."""
    with pytest.raises(ManifestInvalid, match="MAC does not verify"):
        open_manifest(seal_manifest(sample(), Keyring.generate()), Keyring.generate())


def test_rotated_keyring_still_opens_what_the_old_key_sealed():
    """Key rotation: the old key still verifies; new seals name the new key id."""
    ring = Keyring.generate()
    old = seal_manifest(sample(), ring)
    rotated = ring.rotate()
    assert open_manifest(old, rotated) == sample()
    assert open_sealed(seal_manifest(sample(), rotated), rotated).key_id == rotated.current


def test_unknown_envelope_version_is_refused():
    """Branch: envelope version != 1 -> ManifestInvalid before any key lookup."""
    ring = Keyring.generate()
    with pytest.raises(ManifestInvalid, match="unknown envelope version 2"):
        open_manifest(envelope_with_body(encode_body(sample()), ring, version=2), ring)


def test_unknown_body_version_is_refused_even_with_a_valid_mac():
    """Branch: authentic body of format version 2 -> refused, not guessed at."""
    ring = Keyring.generate()
    doc = json.loads(encode_body(sample()))
    doc["version"] = 2
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(ManifestInvalid, match="unknown manifest format version 2"):
        open_manifest(envelope_with_body(body, ring), ring)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(extra=1),
        lambda d: d.pop("producer"),
        lambda d: d.update(depth="300"),
        lambda d: d.update(depth=True),
        lambda d: d.update(aligned=True),  # contradicts depth 300 % 256
        lambda d: d.update(identity="zz"),
        lambda d: d.update(planes=[{"role": "x", "chunk": "00", "size": 1}]),
        lambda d: d.update(layout=[]),
        lambda d: d.update(created_at="yesterday"),
        lambda d: d.update(created_at="2026-01-02T03:04:05.678901+00:00"),  # ISO, not ours
        lambda d: d.update(created_at="2026-01-02T03:04:05Z"),
        lambda d: d.update(created_at="2026-01-02T03:04:05.678901"),
    ],
)
def test_malformed_authentic_bodies_are_refused(mutate):
    """Branch: a well-MAC'd but malformed body -> ManifestInvalid naming the problem."""
    ring = Keyring.generate()
    doc = json.loads(encode_body(sample()))
    mutate(doc)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(ManifestInvalid):
        open_manifest(envelope_with_body(body, ring), ring)


def test_non_canonical_body_is_refused():
    """Branch: same content, other byte encoding (spaces) -> refused."""
    ring = Keyring.generate()
    body = json.dumps(json.loads(encode_body(sample())), sort_keys=True).encode()
    with pytest.raises(ManifestInvalid, match="canonical"):
        open_manifest(envelope_with_body(body, ring), ring)


def test_signature_room_is_covered_by_the_mac():
    """The reserved signature travels in the envelope and cannot be altered."""
    ring = Keyring.generate()
    sealed = seal_manifest(sample(), ring, signature=b"producer-signature")
    assert open_sealed(sealed, ring).signature == b"producer-signature"
    forged = sealed.replace(b"producer-signature", b"producer-signaturX")
    with pytest.raises(ManifestInvalid, match="MAC"):
        open_manifest(forged, ring)


def test_generation_never_wraps():
    """Generations above 2**63-1 (or negative) are refused with GenerationExhausted."""
    assert sample(generation=2**63 - 1).generation == 2**63 - 1
    for bad in (2**63, -1):
        with pytest.raises(GenerationExhausted):
            sample(generation=bad)


def test_created_at_is_normalized_to_utc_and_must_be_aware():
    """Branch: naive time refused; other zones converted to UTC."""
    with pytest.raises(ValueError, match="timezone-aware"):
        sample(created_at=datetime(2026, 1, 1))
    east = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    assert sample(created_at=east).created_at == datetime(2026, 1, 1, 10, tzinfo=UTC)


def test_layout_must_be_json_able():
    """Bad input: a layout that JSON cannot encode -> ValueError."""
    with pytest.raises(ValueError, match="JSON"):
        sample(layout={"x": object()})
    with pytest.raises(ValueError, match="JSON"):
        sample(layout={"x": float("nan")})


def test_manifest_id_derives_from_the_idempotency_key():
    """Same identity and history -> same id; another identity or history -> another id."""
    m = sample()
    assert m.id == manifest_id(IDENTITY, m.chain)
    assert m.id.hex == idempotency_key(IDENTITY, m.chain)[:16].hex()
    assert sample(generation=99).id == m.id
    assert manifest_id(IdentityDigest(bytes(32)), m.chain) != m.id
    other = token_chain(list(range(301)), alignment=256).digest
    assert manifest_id(IDENTITY, other) != m.id
