"""Format 1 sealing, as the code before format 2 wrote it (AES-256-GCM-SIV, the nonce the
chunk id's first 12 bytes, AAD header | id): for tests that a vault written then still
opens. Nothing in cas seals format 1 any more."""

from __future__ import annotations

from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV

from cas.ids import ChunkId
from cas.keys import Keyring
from cas.seal import NONCE_SIZE, PURPOSE_V1, VERSION_V1, header


def seal_v1(keyring: Keyring, chunk_id: ChunkId, plaintext: bytes) -> bytes:
    key_id, key = keyring.subkey(PURPOSE_V1)
    head = header(key_id, version=VERSION_V1)
    nonce = chunk_id.raw[:NONCE_SIZE]
    return head + nonce + AESGCMSIV(key).encrypt(nonce, plaintext, head + chunk_id.raw)
