"""Vault keys: one stable digest secret and rotating sealing keys.

- The digest secret names chunks. It never rotates, so a chunk keeps its id
  (and dedups) across key rotations; it is keyed per namespace.
- Sealing keys have ids ("k1", "k2", ...). The current key seals and MACs;
  every key in the ring still opens and verifies what it sealed.
Subkeys are derived with HKDF-SHA256 per purpose, so the chunk seal and the
manifest MAC never share a key.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from cas.errors import UnknownKey

SECRET_SIZE = 32
FORMAT = "kvpack-keyring-v1"


def write_secret(path: Path, text: str) -> None:
    """Write a secret file with mode 0600, atomically (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _derive(secret: bytes, info: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info.encode()).derive(secret)


@dataclass(frozen=True)
class Keyring:
    digest_secret: bytes
    keys: Mapping[str, bytes]
    current: str
    _cache: dict[tuple[str, str, str], bytes] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if len(self.digest_secret) != SECRET_SIZE:
            raise ValueError(f"digest secret must be {SECRET_SIZE} bytes")
        if self.current not in self.keys:
            raise ValueError(f"current key id {self.current!r} is not in the keyring")
        for key_id, secret in self.keys.items():
            if len(secret) != SECRET_SIZE:
                raise ValueError(f"key {key_id!r} must be {SECRET_SIZE} bytes")

    @classmethod
    def generate(cls) -> Keyring:
        return cls(secrets.token_bytes(SECRET_SIZE), {"k1": secrets.token_bytes(SECRET_SIZE)}, "k1")

    def rotate(self) -> Keyring:
        """A new current key; the old ones stay to open what they sealed."""
        n = 1 + max(int(k[1:]) for k in self.keys if k[1:].isdigit())
        new_id = f"k{n}"
        return Keyring(
            self.digest_secret, {**self.keys, new_id: secrets.token_bytes(SECRET_SIZE)}, new_id
        )

    def digest_key(self, namespace: str) -> bytes:
        """The BLAKE3 key that names chunks in `namespace`."""
        return self._memo("digest", "", namespace, self.digest_secret)

    def subkey(self, purpose: str, key_id: str | None = None) -> tuple[str, bytes]:
        """(key id, 32-byte key) for `purpose`; the current key when key_id is None."""
        key_id = self.current if key_id is None else key_id
        try:
            secret = self.keys[key_id]
        except KeyError:
            raise UnknownKey(key_id) from None
        return key_id, self._memo(purpose, key_id, "", secret)

    def _memo(self, purpose: str, key_id: str, namespace: str, secret: bytes) -> bytes:
        slot = (purpose, key_id, namespace)
        if slot not in self._cache:
            self._cache[slot] = _derive(secret, f"kvpack/{purpose}/{namespace}")
        return self._cache[slot]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "digest_secret": self.digest_secret.hex(),
                "keys": {k: v.hex() for k, v in self.keys.items()},
                "current": self.current,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Keyring:
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise ValueError(f"keyring format {doc.get('format')!r} is not {FORMAT!r}")
        keys = {k: bytes.fromhex(v) for k, v in doc["keys"].items()}
        return cls(bytes.fromhex(doc["digest_secret"]), keys, doc["current"])

    def save(self, path: Path) -> None:
        write_secret(path, self.to_json())

    @classmethod
    def load_or_create(cls, path: Path) -> Keyring:
        if path.exists():
            return cls.from_json(path.read_text())
        ring = cls.generate()
        ring.save(path)
        return ring
