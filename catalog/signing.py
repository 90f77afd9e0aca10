"""Producer keys: Ed25519 signatures that say which vault produced a pack.

Words (see docs/architecture.md):
- producer: a vault's name, the `producer` of the manifests it seals.
- producer key: an Ed25519 key pair of one producer. Its id is the first 8 bytes of
  SHA-256 over the raw public key, in hex, so an id names exactly one public key.
- key file: every key the producer ever had, oldest first (mode 0600); the newest
  signs, the older ones stay so what they signed still verifies.
- endorsement: at rotation the outgoing key signs (domain, producer, new id, new
  public key). A peer that trusts an old key can trust its successors by walking
  the endorsements, so rotating never strands a trust store.
- bundle: the public half of a key file (producer, keys, endorsements): what
  `kvpack keys show` prints and what a peer serves at /v1/peer/keys.
- signature slot: key id (8 bytes) + Ed25519 signature (64 bytes) over a domain
  tag and the message; the domain keeps a manifest signature from ever passing as
  an export signature, and the reverse.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from cas.keys import write_secret

KEY_ID_SIZE = 8
SIGNATURE_SIZE = 64
SLOT_SIZE = KEY_ID_SIZE + SIGNATURE_SIZE
KEY_FILE_FORMAT = "kvpack-producer-keys-v1"
BUNDLE_FORMAT = "kvpack-producer-bundle-v1"
MANIFEST_DOMAIN = b"kvpack-manifest-signature-v1\0"
EXPORT_DOMAIN = b"kvpack-export-statement-v1\0"
ENDORSE_DOMAIN = b"kvpack-key-endorsement-v1\0"


class SignatureInvalid(ValueError):
    """A signature slot is malformed, names an untrusted key, or does not verify."""


class BundleInvalid(ValueError):
    """A public bundle is malformed or its endorsement chain does not verify."""


def key_id(public: bytes) -> str:
    return hashlib.sha256(public).digest()[:KEY_ID_SIZE].hex()


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _endorsement_message(producer: str, new_id: str, new_public: bytes) -> bytes:
    name = producer.encode()
    return ENDORSE_DOMAIN + len(name).to_bytes(2, "big") + name + bytes.fromhex(new_id) + new_public


@dataclass(frozen=True)
class PublicKeyEntry:
    id: str
    public: bytes
    endorsed_by: str | None = None  # the previous key, which signed `endorsement`
    endorsement: bytes | None = None


@dataclass(frozen=True)
class Bundle:
    producer: str
    keys: tuple[PublicKeyEntry, ...]

    def to_json(self) -> str:
        doc = {
            "format": BUNDLE_FORMAT,
            "producer": self.producer,
            "keys": [
                {
                    "id": k.id,
                    "public": k.public.hex(),
                    "endorsed_by": k.endorsed_by,
                    "endorsement": k.endorsement.hex() if k.endorsement else None,
                }
                for k in self.keys
            ],
        }
        return json.dumps(doc, indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> Bundle:
        """Parse and check a bundle: ids match their keys, every endorsement verifies."""
        try:
            doc = json.loads(text)
            if doc.get("format") != BUNDLE_FORMAT:
                raise ValueError(f"format {doc.get('format')!r} is not {BUNDLE_FORMAT!r}")
            producer = doc["producer"]
            if not isinstance(producer, str) or not producer:
                raise ValueError("producer must be a non-empty string")
            keys = tuple(
                PublicKeyEntry(
                    id=k["id"],
                    public=bytes.fromhex(k["public"]),
                    endorsed_by=k.get("endorsed_by"),
                    endorsement=bytes.fromhex(k["endorsement"]) if k.get("endorsement") else None,
                )
                for k in doc["keys"]
            )
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise BundleInvalid(f"not a producer bundle: {e}") from None
        bundle = cls(producer, keys)
        bundle.check()
        return bundle

    def check(self) -> None:
        """Ids name their keys; each key after the first is endorsed by the one before."""
        if not self.keys:
            raise BundleInvalid("a bundle holds at least one key")
        for i, k in enumerate(self.keys):
            if len(k.public) != 32 or key_id(k.public) != k.id:
                raise BundleInvalid(f"key {k.id!r} does not match its public key")
            if i == 0:
                continue
            prev = self.keys[i - 1]
            if k.endorsed_by != prev.id or k.endorsement is None:
                raise BundleInvalid(f"key {k.id} is not endorsed by its predecessor {prev.id}")
            try:
                Ed25519PublicKey.from_public_bytes(prev.public).verify(
                    k.endorsement, _endorsement_message(self.producer, k.id, k.public)
                )
            except InvalidSignature:
                raise BundleInvalid(f"endorsement of key {k.id} does not verify") from None

    def endorsed_from(self, trusted: Mapping[str, bytes]) -> list[PublicKeyEntry]:
        """The keys this bundle adds to `trusted` (id -> public key): every key after the
        first one `trusted` already holds with the same public key. Nothing if none is."""
        self.check()
        for i, k in enumerate(self.keys):
            if trusted.get(k.id) == k.public:
                return [n for n in self.keys[i + 1 :] if n.id not in trusted]
        return []


@dataclass(frozen=True)
class _PrivateEntry:
    private: Ed25519PrivateKey
    public: PublicKeyEntry


class ProducerKeys:
    """A producer's key file: sign with the newest key, verify with any."""

    def __init__(self, producer: str, entries: Sequence[_PrivateEntry]) -> None:
        if not producer or not entries:
            raise ValueError("a producer key file needs a producer name and a key")
        self.producer = producer
        self._entries = tuple(entries)

    @classmethod
    def generate(cls, producer: str) -> ProducerKeys:
        private = Ed25519PrivateKey.generate()
        public = _raw(private.public_key())
        return cls(producer, [_PrivateEntry(private, PublicKeyEntry(key_id(public), public))])

    @property
    def current_id(self) -> str:
        return self._entries[-1].public.id

    def rotate(self) -> ProducerKeys:
        """A new signing key, endorsed by the current one; the old keys stay."""
        private = Ed25519PrivateKey.generate()
        public = _raw(private.public_key())
        new_id = key_id(public)
        old = self._entries[-1]
        endorsement = old.private.sign(_endorsement_message(self.producer, new_id, public))
        entry = PublicKeyEntry(new_id, public, old.public.id, endorsement)
        return ProducerKeys(self.producer, [*self._entries, _PrivateEntry(private, entry)])

    def sign(self, domain: bytes, message: bytes) -> bytes:
        """A signature slot over domain + message by the current key."""
        entry = self._entries[-1]
        return bytes.fromhex(entry.public.id) + entry.private.sign(domain + message)

    def bundle(self) -> Bundle:
        return Bundle(self.producer, tuple(e.public for e in self._entries))

    def public_keys(self) -> dict[str, bytes]:
        return {e.public.id: e.public.public for e in self._entries}

    def to_json(self) -> str:
        keys = []
        for e in self._entries:
            raw = e.private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            pub = e.public
            keys.append(
                {
                    "private": raw.hex(),
                    "endorsed_by": pub.endorsed_by,
                    "endorsement": pub.endorsement.hex() if pub.endorsement else None,
                }
            )
        return json.dumps({"format": KEY_FILE_FORMAT, "producer": self.producer, "keys": keys})

    @classmethod
    def from_json(cls, text: str) -> ProducerKeys:
        doc = json.loads(text)
        if doc.get("format") != KEY_FILE_FORMAT:
            raise ValueError(f"key file format {doc.get('format')!r} is not {KEY_FILE_FORMAT!r}")
        entries = []
        for k in doc["keys"]:
            private = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(k["private"]))
            public = _raw(private.public_key())
            endorsement = bytes.fromhex(k["endorsement"]) if k.get("endorsement") else None
            entries.append(
                _PrivateEntry(
                    private, PublicKeyEntry(key_id(public), public, k["endorsed_by"], endorsement)
                )
            )
        keys = cls(doc["producer"], entries)
        keys.bundle().check()
        return keys

    def save(self, path: Path) -> None:
        write_secret(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> ProducerKeys:
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"producer key file {path}: {e}") from None

    @classmethod
    def create(cls, path: Path, producer: str) -> ProducerKeys:
        """A new key file at `path`; FileExistsError if one is there. Written beside it,
        then linked into place, so a file another process created meanwhile is never
        replaced (two processes never sign with different first keys)."""
        keys = cls.generate(producer)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        keys.save(tmp)
        try:
            os.link(tmp, path)
        finally:
            tmp.unlink()
        return keys

    @classmethod
    def load_or_create(cls, path: Path, producer: str) -> ProducerKeys:
        try:
            return cls.load(path)
        except FileNotFoundError:
            pass
        try:
            return cls.create(path, producer)
        except FileExistsError:  # another process created it first: use theirs
            return cls.load(path)


def verify(public_keys: Mapping[str, bytes], domain: bytes, message: bytes, slot: bytes) -> str:
    """The id of the key in `public_keys` whose signature `slot` is; SignatureInvalid if
    the slot is malformed, names a key not in `public_keys`, or does not verify."""
    if len(slot) != SLOT_SIZE:
        raise SignatureInvalid(f"signature slot is {len(slot)} bytes, not {SLOT_SIZE}")
    kid = slot[:KEY_ID_SIZE].hex()
    public = public_keys.get(kid)
    if public is None:
        raise SignatureInvalid(f"signed by key {kid}, which is not trusted")
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(slot[KEY_ID_SIZE:], domain + message)
    except InvalidSignature:
        raise SignatureInvalid(f"signature by key {kid} does not verify") from None
    return kid


def slot_key_id(slot: bytes) -> str | None:
    """The key id a signature slot names (None when the slot is malformed)."""
    return slot[:KEY_ID_SIZE].hex() if len(slot) == SLOT_SIZE else None
