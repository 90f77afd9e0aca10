"""Sealed objects: a blob sealed at rest under its own object key, for what is not a chunk.

Quarantined imports (kvpack/remote/quarantine.py) keep a peer's answer and planes in the
object store until they are checked. They are sealed by the chunk seal (cas/seal.py),
bound to their key so that an object moved or copied to another key does not open:

    sealed object = chunk id (32) | sealed chunk of (u16 key length | key | data)

The chunk id is the keyed digest of that plaintext under the vault's "sealed objects"
digest key, so the seal's own checks (tag, header, re-hash) cover the key as well as the
bytes, and `get` then checks that the key inside is the one asked for.
"""

from __future__ import annotations

import asyncio

from cas.errors import ChunkCorrupt, ObjectCorrupt
from cas.ids import DIGEST_SIZE, ChunkId
from cas.keys import Keyring
from cas.seal import ChunkSeal
from cas.store import ObjectStore

DIGEST_NAMESPACE = "\0sealed-objects"  # no tenant can be named this (NUL)


class SealedObjects:
    def __init__(self, objects: ObjectStore, keyring: Keyring) -> None:
        self.objects = objects
        self._seal = ChunkSeal(keyring)
        self._digest_key = keyring.digest_key(DIGEST_NAMESPACE)

    async def put(self, key: str, data: bytes | memoryview) -> bool:
        """Seal and store `data` under `key` (put-if-absent: False if `key` existed)."""
        sealed = await asyncio.to_thread(self._sealed, key, data)
        return await self.objects.put_if_absent(key, sealed)

    async def get(self, key: str) -> bytes:
        """The opened bytes; ObjectMissing, ObjectCorrupt, UnknownKey."""
        sealed = await self.objects.get(key)
        return await asyncio.to_thread(self._opened, key, memoryview(sealed))

    async def delete(self, key: str) -> None:
        await self.objects.delete(key)

    def _sealed(self, key: str, data: bytes | memoryview) -> bytes:
        plaintext = _bound(key) + bytes(data)
        chunk_id = ChunkId.of(plaintext, key=self._digest_key)
        return chunk_id.raw + self._seal.seal(chunk_id, plaintext)

    def _opened(self, key: str, sealed: memoryview) -> bytes:
        if len(sealed) < DIGEST_SIZE:
            raise ObjectCorrupt(key, f"{len(sealed)} bytes is too short for a sealed object")
        chunk_id = ChunkId(bytes(sealed[:DIGEST_SIZE]))
        body = sealed[DIGEST_SIZE:]
        try:
            out = bytearray(self._seal.plaintext_size(chunk_id, body))
            self._seal.open_into(chunk_id, body, memoryview(out), digest_key=self._digest_key)
        except ChunkCorrupt as e:
            raise ObjectCorrupt(key, e.reason) from None
        bound = _bound(key)
        if not out.startswith(bound):
            raise ObjectCorrupt(key, "sealed for another object key")
        return bytes(out[len(bound) :])


def _bound(key: str) -> bytes:
    raw = key.encode()
    return len(raw).to_bytes(2, "big") + raw
