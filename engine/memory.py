"""Freed memory kept for the next restore: glibc's malloc told not to give it back.

A restore writes a cut into fresh buffers (the shadow, engine/intake.py) and its commit
frees the slot's old ones. By default glibc serves a buffer over its mmap threshold with
a mapping of its own and unmaps it on free, trims free memory at the top of its heaps,
and gives each thread an arena of its own: the next restore's buffers are then pages the
kernel must map and zero again. On a VM that hands freed pages back to its host they
come back at the host's pace: measured here, a 2,048-token restore into such pages took
0.26-0.29 s, into pages the process held 0.018 s (84 MiB).

- `keep_freed()`: one arena for every thread, the mmap threshold fixed at its maximum
  (32 MiB on 64-bit; fixing it also stops glibc raising it on its own) and the trim
  threshold raised, so every buffer of a KV cache comes from one heap and what any
  thread frees serves the next restore, whatever its size. The process keeps its
  high-water mark instead of returning it. engine/__init__.py calls it at import,
  before the threads that would get arenas of their own exist. KVPACK_MALLOC=system
  leaves glibc's defaults; elsewhere than glibc it does nothing.
- `reserve(nbytes)`: map that much heap once and free it, so that the first restore
  after a start finds its pages mapped (the warm start's memory phase,
  kvpack/service/warm.py). Only worth it once `keep_freed()` took.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "KVPACK_MALLOC"
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only past 2 GiB free
CHUNK = 16 << 20  # under the mmap threshold: heap, not a mapping of its own
PAGE = 4096

_kept: bool | None = None


def keep_freed() -> bool:
    """Make glibc keep freed memory for reuse (see the module words); idempotent;
    whether it is in effect."""
    global _kept
    if _kept is None:
        _kept = os.environ.get(ENV, "").strip().lower() != "system" and _mallopt()
    return _kept


def kept() -> bool:
    """Whether `keep_freed()` is in effect in this process."""
    return bool(_kept)


def _mallopt() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD))  # fmt: skip
    return all([bool(mallopt(param, value)) for param, value in settings])


def reserve(nbytes: int) -> None:
    """Map `nbytes` of heap (rounded up to CHUNK) and free it again."""
    zeros = bytes(len(range(0, CHUNK, PAGE)))
    chunks = [bytearray(CHUNK) for _ in range(-(-nbytes // CHUNK))]
    for chunk in chunks:
        chunk[::PAGE] = zeros  # a write per page maps it
    del chunks
