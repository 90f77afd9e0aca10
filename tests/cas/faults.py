"""Fault-injecting wrappers around a real ObjectStore (restic style).

Each wrapper delegates to the real backend and breaks exactly one thing on the
read path; tests name the branch they expect the fault to reach. A wrapper reads
through get_into (it does not map) unless it is a Tampering one: those map where the
real store maps (cas/local.py), and break the mapped bytes the same way.
"""

from __future__ import annotations

from cas.errors import ObjectMissing
from cas.local import Mapped
from cas.store import ObjectInfo, ObjectStore


class Wrapper:
    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.remote = inner.remote

    async def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def get_into(self, key: str, out: memoryview) -> int:
        return await self.inner.get_into(key, out)

    async def stat(self, key: str) -> ObjectInfo:
        return await self.inner.stat(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def list_keys(self, prefix: str) -> list[str]:
        return await self.inner.list_keys(prefix)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Tampering(Wrapper):
    """Maps where the real store maps; `_tamper` breaks the mapped bytes."""

    @property
    def maps(self) -> bool:
        return getattr(self.inner, "maps", False)

    def map(self, key: str, limit: int) -> Mapped:
        with self.inner.map(key, limit) as mapped:
            return Mapped(self._tamper(key, bytearray(mapped.view)))

    def _tamper(self, key: str, data: bytearray) -> bytearray:
        raise NotImplementedError


class FlipByte(Tampering):
    """Reads come back with one bit flipped at `at` (negative counts from the end)."""

    def __init__(self, inner: ObjectStore, at: int = -1, *, only: str | None = None) -> None:
        super().__init__(inner)
        self.at, self.only = at, only

    def _hit(self, key: str) -> bool:
        return self.only is None or key == self.only

    async def get(self, key: str) -> bytes:
        data = bytearray(await self.inner.get(key))
        if self._hit(key):
            data[self.at] ^= 0x01
        return bytes(data)

    async def get_into(self, key: str, out: memoryview) -> int:
        n = await self.inner.get_into(key, out)
        if self._hit(key):
            out[self.at % n] ^= 0x01
        return n

    def _tamper(self, key: str, data: bytearray) -> bytearray:
        if self._hit(key):
            data[self.at % len(data)] ^= 0x01
        return data


class Truncate(Tampering):
    """Reads lose their last `drop` bytes."""

    def __init__(self, inner: ObjectStore, drop: int = 1) -> None:
        super().__init__(inner)
        self.drop = drop

    async def get(self, key: str) -> bytes:
        return (await self.inner.get(key))[: -self.drop]

    async def get_into(self, key: str, out: memoryview) -> int:
        return max(0, await self.inner.get_into(key, out) - self.drop)

    def _tamper(self, key: str, data: bytearray) -> bytearray:
        return data[: max(0, len(data) - self.drop)]


class Missing(Tampering):
    """Every read says the object is gone."""

    async def get(self, key: str) -> bytes:
        raise ObjectMissing(key)

    async def get_into(self, key: str, out: memoryview) -> int:
        raise ObjectMissing(key)

    async def stat(self, key: str) -> ObjectInfo:
        raise ObjectMissing(key)

    def map(self, key: str, limit: int) -> Mapped:
        raise ObjectMissing(key)
