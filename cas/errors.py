"""Errors are types that carry data. Nothing above cas/ matches on strings."""

from __future__ import annotations

from cas.ids import ChunkId


class VaultError(Exception):
    """Base of every error kvpack raises about stored state."""


class ObjectMissing(VaultError, FileNotFoundError):
    def __init__(self, key: str) -> None:
        super().__init__(f"object not found: {key}")
        self.key = key


class StoreUnavailable(VaultError):
    """The object store could not be reached after retries (an outage, not a verdict)."""

    def __init__(self, op: str, key: str, cause: str) -> None:
        super().__init__(f"object store unavailable during {op} {key}: {cause}")
        self.op, self.key, self.cause = op, key, cause


class StoreRejected(StoreUnavailable):
    """The object store refused a request for good (access denied, no such bucket, bad
    request): not retried, but still treated as unavailability by callers that degrade open."""

    def __init__(self, op: str, key: str, code: str, cause: str) -> None:
        super().__init__(op, key, f"{code}: {cause}")
        self.code = code


class ObjectTooLarge(VaultError):
    """An object is larger than the buffer a caller sized for it (get_into)."""

    def __init__(self, key: str, size: int, capacity: int) -> None:
        super().__init__(f"object {key} has {size} bytes, more than the {capacity} expected")
        self.key, self.size, self.capacity = key, size, capacity


class ChunkMissing(VaultError):
    def __init__(self, chunk_id: ChunkId) -> None:
        super().__init__(f"chunk {chunk_id.short} is missing")
        self.chunk_id = chunk_id


class ChunkCorrupt(VaultError):
    """A chunk failed its seal or digest check; its bytes are never returned."""

    def __init__(self, chunk_id: ChunkId, reason: str) -> None:
        super().__init__(f"chunk {chunk_id.short} is corrupt: {reason}")
        self.chunk_id, self.reason = chunk_id, reason


class ObjectCorrupt(VaultError):
    """A sealed object (cas/sealed.py) failed its seal, or was sealed for another key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"object {key} is corrupt: {reason}")
        self.key, self.reason = key, reason


class UnknownKey(VaultError):
    """A sealed object or MAC names a key id this keyring does not hold."""

    def __init__(self, key_id: str) -> None:
        super().__init__(f"unknown vault key id {key_id!r}")
        self.key_id = key_id
