"""The object store: where sealed objects live.

- object: an immutable run of bytes under a key built by cas.layout.object_key.
- put-if-absent: the only write. "Already exists" is success (False), never an
  error, because equal keys always carry equal bytes (content addressing).
- backend: one implementation of ObjectStore (LocalDirStore, S3Store). Every
  backend passes the same contract suite (tests/cas/test_contract.py).

Errors: ObjectMissing (no such key), ObjectTooLarge (get_into buffer too small),
StoreUnavailable (outage after retries; StoreRejected when refused for good).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    size: int
    modified: datetime  # UTC


@runtime_checkable
class ObjectStore(Protocol):
    """Raw immutable objects; one implementation per backend."""

    # Whether each read crosses a network: a round trip worth hiding behind other reads
    # (a reader then fetches chunks while their manifest is on its way, kvpack/vault.py).
    remote: bool

    async def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Store `data` under `key` unless an object is there: True created, False existed."""
        ...

    async def get(self, key: str) -> bytes:
        """The whole object; ObjectMissing."""
        ...

    async def get_into(self, key: str, out: memoryview) -> int:
        """Stream the object into `out`, return its size; ObjectMissing, ObjectTooLarge.
        A backend whose `lands` attribute is True (S3Store) also takes `landed`
        (cas/buffers.py):
        called on the reading thread as the bytes arrive, so a reader can open them while
        they are in the cache (cas/trail.py). It may be called again from 0 when a failed
        attempt is retried; an exception it raises ends the read. A backend whose `maps`
        attribute is True (LocalDirStore) also offers `map(key, limit)`: the object's
        bytes where they lie, read-only and without a copy, for a reader that closes
        them once done (cas/local.py); it blocks, so it is called on a worker thread. It
        also offers `preload(keys)`: the objects' files read into the page cache."""
        ...

    async def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; ObjectMissing."""
        ...

    async def delete(self, key: str) -> None:
        """Remove `key`; deleting a missing key is not an error."""
        ...

    async def list_keys(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, sorted."""
        ...

    async def aclose(self) -> None:
        """Release connections; the store may not be used afterwards."""
        ...
