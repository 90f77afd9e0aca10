"""LocalDirStore specifics: atomic put-if-absent across processes, no visible temp files,
OS errors translated once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ProcessPoolExecutor

import pytest

from cas.errors import StoreUnavailable
from cas.local import TEMP_PREFIX, LocalDirStore


def _put_from_process(root: str, body: bytes) -> bool:
    return asyncio.run(LocalDirStore(root).put_if_absent("chunks/aa/race", body))


def test_put_if_absent_is_atomic_across_processes(tmp_path):
    """4 processes race to create one key: one wins, its complete bytes are what is stored."""
    bodies = [bytes([i]) * 300_000 for i in range(4)]
    with ProcessPoolExecutor(4) as pool:
        created = list(pool.map(_put_from_process, [str(tmp_path)] * 4, bodies))
    assert created.count(True) == 1
    stored = (tmp_path / "chunks" / "aa" / "race").read_bytes()
    assert stored == bodies[created.index(True)]


def test_no_temp_files_remain_or_show(tmp_path):
    """After puts (created and existed) no temp file is left; list_keys never shows one."""
    store = LocalDirStore(tmp_path)
    asyncio.run(store.put_if_absent("a/b", b"1"))
    asyncio.run(store.put_if_absent("a/b", b"2"))
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b"]
    (tmp_path / "a" / f"{TEMP_PREFIX}stray").write_bytes(b"x")  # a crashed writer's leftover
    assert asyncio.run(store.list_keys("a/")) == ["a/b"]
    with pytest.raises(ValueError):
        asyncio.run(store.put_if_absent(f"a/{TEMP_PREFIX}x", b"x"))


def test_os_errors_become_store_unavailable(tmp_path):
    """A root that is not a directory: writes raise StoreUnavailable naming the op and key."""
    root = tmp_path / "file"
    root.write_bytes(b"not a dir")
    store = LocalDirStore(root)
    with pytest.raises(StoreUnavailable) as e:
        asyncio.run(store.put_if_absent("k/1", b"x"))
    assert (e.value.op, e.value.key) == ("put", "k/1")
