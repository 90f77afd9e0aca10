"""engine.memory: freed memory kept in the process, so a restore finds its pages mapped.

Each case runs in a fresh interpreter (the malloc settings are made once, at import).
What is measured is page faults (ru_minflt), not time: a buffer served from memory the
process already holds faults no page in; one from the kernel faults every page.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.layout import KVLayout
from tests.engine.slotkit import TINY_A, tiny_pool

ROOT = Path(__file__).resolve().parents[2]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# 64 MiB mapped and freed (on the main thread), then 48 MiB of MLX caches made on
# another thread, the way a restore makes its shadow on the engine's thread.
_PROBE = """
import json, resource, threading
import engine
import mlx.core as mx
from engine import memory
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
memory.reserve(64 << 20)
out = {}
def restore():
    before = faults()
    caches = [mx.zeros((1, 3, 4096, 64), dtype=mx.float32) for _ in range(16)]
    mx.eval(caches)
    out["faults"] = faults() - before
worker = threading.Thread(target=restore)
worker.start()
worker.join()
print(json.dumps({"kept": memory.kept(), "pages": 48 << 20 >> 12, **out}))
"""


def probe(**env: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_memory_freed_on_one_thread_serves_a_restore_on_another():
    """keep_freed (at engine import) + reserve: a thread's new caches land in pages the
    process mapped before, so they fault almost none in; with KVPACK_MALLOC=system
    (glibc's defaults: an arena per thread, a mapping per big buffer) they fault in
    nearly every page."""
    kept = probe()
    assert kept["kept"] is True
    assert kept["faults"] < kept["pages"] // 10, kept
    system = probe(KVPACK_MALLOC="system")
    assert system["kept"] is False
    assert system["faults"] > system["pages"] // 2, system


def test_cache_bytes_is_what_a_cut_of_the_full_layers_holds():
    """KVLayout.cache_bytes: a full layer's K/V grow with the depth, counted from the
    arrays of an exported cut's block parts; a sliding layer's stop at its window."""
    pool = tiny_pool(1)
    slot = pool.slot(0)
    slot.prefill([1 + i % 50 for i in range(2 * TINY_A)])
    blocks = sum(p.nbytes for p in slot.export().parts if p.kind == "block")
    layers = pool.layout.layers
    full = KVLayout(tuple(x for x in layers if not x.sliding), pool.layout.dtype)
    sliding = KVLayout(tuple(x for x in layers if x.sliding), pool.layout.dtype)
    assert full.cache_bytes(2 * TINY_A) == blocks > 0
    window = max(x.window or 0 for x in sliding.layers)
    assert 0 < sliding.cache_bytes(window) == sliding.cache_bytes(10 * window)
    assert pool.layout.cache_bytes(2 * TINY_A) == blocks + sliding.cache_bytes(window)
