"""LocalDirStore: the embedded default, one file per object under a root directory.

A put writes a private temp file, fsyncs it, then hard-links it into place:
os.link fails with EEXIST when the name exists, so put-if-absent is atomic
even under concurrent writers (in this or another process), and a reader
never sees a half-written object. The directory is fsynced after the link.

A chunk reader maps an object instead of reading it (`map`): the open that decrypts it
reads its bytes where they are, in the page cache, with no copy into a buffer first.
Measured (one 11.8 MB sealed chunk in the page cache, AMD EPYC VM, one thread, median of
41): read into a reused buffer, then an AES-256-GCM open, 2.8 ms; mapped (its pages
mapped up front, MAP_POPULATE), then opened, 1.2-1.5 ms. A file truncated in place
while mapped would end the process (SIGBUS) once the open reached the lost pages. No
object is ever rewritten (a put links a new file and a delete unlinks one; a mapping
keeps its file either way), so only a writer into the store's files behind kvpack's
back could do that, during the one chunk's open that a mapping lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cas.buffers import read_into
from cas.errors import ObjectMissing, ObjectTooLarge, StoreUnavailable
from cas.store import ObjectInfo

TEMP_PREFIX = ".tmp-"
# Every page mapped in the one call (Linux), not faulted in one by one as the open reads.
POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # 0 where there is none (macOS)
MAP_FLAGS = mmap.MAP_SHARED | POPULATE


class Mapped:
    """An object's bytes, mapped read-only from its file (LocalDirStore.map), or held in
    memory (an empty file, which cannot be mapped; a test's stand-in); `view` is valid
    until `close`."""

    def __init__(self, area: mmap.mmap | bytes | bytearray) -> None:
        self._area = area
        self.view = memoryview(area)

    def __enter__(self) -> Mapped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advise_willneed(self) -> None:
        if isinstance(self._area, mmap.mmap):
            self._area.madvise(mmap.MADV_WILLNEED)

    def close(self) -> None:
        self.view.release()
        if isinstance(self._area, mmap.mmap):
            # A view of it still held (by a traceback's frames): unmapped once that goes.
            with contextlib.suppress(BufferError):
                self._area.close()


class LocalDirStore:
    remote = False
    maps = True  # see `map`

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalDirStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid object key {key!r}: want relative 'a/b/c' without '..'")
        if parts[-1].startswith(TEMP_PREFIX):
            raise ValueError(f"invalid object key {key!r}: {TEMP_PREFIX!r} names are reserved")
        return self.root.joinpath(*parts)

    async def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        path = self._path(key)
        return await asyncio.to_thread(_guard, "put", key, _put_if_absent, path, data)

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        return await asyncio.to_thread(_guard, "get", key, path.read_bytes)

    async def get_into(self, key: str, out: memoryview) -> int:
        path = self._path(key)
        return await asyncio.to_thread(_guard, "get", key, _read_into, path, key, out)

    def map(self, key: str, limit: int) -> Mapped:
        """The object's bytes in place (see the module words), for a reader that only
        reads them; ObjectMissing, ObjectTooLarge past `limit` bytes. It blocks (the
        pages are mapped, from the disk if need be): call it on a worker thread."""
        return _guard("get", key, _map, self._path(key), key, limit)

    def preload(self, keys: Iterable[str], *, until: float | None = None) -> tuple[int, int]:
        """Each object's file read into the page cache (mapped with its pages populated,
        then unmapped), so a restarted server's first reads of them find memory, not
        the disk (kvpack/service/warm.py); missing ones skipped, and none started once
        time.monotonic() has passed `until`. (objects, bytes) read. It blocks on the
        disk."""
        count = size = 0
        for key in keys:
            if until is not None and time.monotonic() > until:
                break
            try:
                mapped = self.map(key, sys.maxsize)
            except ObjectMissing:
                continue
            with mapped:
                if not POPULATE:  # read ahead, not page by page as they are touched
                    mapped.advise_willneed()
                _touch(mapped.view)
                count, size = count + 1, size + mapped.view.nbytes
        return count, size

    async def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        st = await asyncio.to_thread(_guard, "stat", key, path.stat)
        return ObjectInfo(st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    async def delete(self, key: str) -> None:
        path = self._path(key)
        await asyncio.to_thread(_guard, "delete", key, path.unlink, missing_ok=True)

    async def list_keys(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(_guard, "list", prefix, self._list, prefix)

    async def aclose(self) -> None:
        return None

    def _list(self, prefix: str) -> list[str]:
        # Walk only below the deepest directory the prefix names.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*base.split("/")) if base else self.root
        if not start.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(TEMP_PREFIX):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


def _guard(op: str, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Translate OS errors once. A missing path is ObjectMissing on reads and nothing on
    delete; every other OS error (and a missing path on writes) is StoreUnavailable."""
    try:
        return fn(*args, **kwargs)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            if op in ("get", "stat"):
                raise ObjectMissing(key) from e
            if op == "delete":
                return None
        raise StoreUnavailable(op, key, f"{type(e).__name__}: {e.strerror or e}") from e


def _put_if_absent(path: Path, data: bytes | bytearray | memoryview) -> bool:
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and refuses to replace: the put-if-absent
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(path.parent)
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_into(path: Path, key: str, out: memoryview) -> int:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size > len(out):
            raise ObjectTooLarge(key, size, len(out))
        return read_into(f.readinto, out, size)


def _touch(view: memoryview) -> None:
    """One byte of each page read. A page just read from the disk can be in the page cache
    and still cost its first reader: on a development VM, the first 7,936-token restore
    after a restart whose warm start had mapped the chunk files back but not touched them
    took up to 0.94 s (median 0.62 s over 13 restarts; its AES-GCM stalled on loads from
    the mapped file, 83% of that function's samples on one load); with each page touched
    here, 0.26-0.34 s, what the requests after it took (docs/measurements.md). Likely
    the cost engine/memory.py measured for pages the VM had handed back to its host;
    not verified."""
    bytes(view[:: mmap.PAGESIZE])


def _map(path: Path, key: str, limit: int) -> Mapped:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ObjectTooLarge(key, size, limit)
        if size == 0:  # mmap refuses an empty file; the reader refuses the empty object
            return Mapped(b"")
        return Mapped(mmap.mmap(fd, size, flags=MAP_FLAGS, prot=mmap.PROT_READ))
    finally:
        os.close(fd)
