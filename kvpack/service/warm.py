"""Warm start: what the first request after a restart would otherwise pay, paid before
the server reports ready.

- memory: the service's restore reserve mapped and freed (engine/memory.py), so that the
  first restore's buffers are pages the process holds, not pages to fault in.
- shadow: how this machine best makes a large cut's shadow buffers, measured on the
  model's own (SlotPool.calibrate, engine/unfilled.py): without a zero fill they cost a
  fixed few milliseconds, and from what size that beats the zero fill differs between
  machines (a 2,048-token restore of the demo model on an AMD EPYC VM allocated in 14.5
  ms zero-filled, 21.5 ms unfilled; on an Intel Xeon VM unfilled was the faster).
- store: one stat of a key that is never written (Vault.check_store): the S3 client is
  created on the vault's loop (credentials, endpoint rules, the service model: a few
  hundred milliseconds). Then the durable reader's setup (Vault.warm_reads, cas
  ChunkStore.warm): a scratch buffer of a block's size for each chunk in flight, the
  worker threads that open chunks, and as many gets of that key, each answered
  "missing", so the operation a restore reads with has run and the connection pool
  holds a connection per chunk in flight. From a local directory, whose chunks are
  mapped, not read: the opener threads, each mapping that key once, and no scratch
  buffer.
- manifests: those of the WARM_MANIFESTS most recently used cuts (last hit, else
  published), opened and verified into the vault's OpenedManifests (catalog/opened.py)
  for at most PRELOAD_SECONDS, from any store: a first durable hit then starts its
  chunks' reads at once instead of reading its manifest beside them: one request and
  one verification less for the store and this process. Measured
  (`benchmarks/bench_s3_postgres.py 256 --restarts 5`, SeaweedFS on loopback,
  alternating with the code before): on one AMD EPYC VM the restarted servers'
  256-token restores took 17-19 ms at the median against 20-22 ms (three runs each),
  on another 18 and 17 ms against 16 and 17 ms (two each), where the chunks' GET, not
  the manifest beside it, set the pace. The phase took 0.01 s from a local directory.
- chunk: from a remote store, the first chunk of the default tenant's most recently
  used cut (its manifest held by the phase before) read the way a durable hit reads
  it, into a buffer that is then dropped (Vault.warm_chunk): from S3 the direct GET
  answered 200, its body opened behind the read on the reading thread, hashed and
  checked. The store phase's probe is answered "missing" and runs none of that, so
  without it the first hit after a restart ran it all for the first time
  (docs/measurements.md, *a recent chunk read at the warm start*).
- cache: the chunks of the most recently used cuts (last hit, else published), up to the
  `preload` setting's bytes (1 GiB by default) and for at most PRELOAD_SECONDS, read
  into the page cache from a local directory store (Vault.preload), as PostgreSQL's
  autoprewarm does for its buffers: the first hits after a restart or a reboot then read
  memory, and each page has been touched once (cas/local.py). Measured on a development
  VM (demo model, 7,936 tokens, the vault's chunk files dropped from the page cache
  before each of four restarts): without it the first restore read its 366 MB from the
  disk and took 0.57-0.71 s; with it 0.26-0.34 s, what the second requests took
  (0.28-0.33 s). The warm start read the vault's 745 MB back in 0.6-1.8 s; 0.1 s when
  they were still in memory (docs/measurements.md).
- catalog: one trivial query and one find_deepest through the vault's Reader: a pooled
  connection, and the lookup's statement path taken once; and a hit's stamp of a cut
  that does not exist, the write every durable hit makes on the background worker.
  Unwarmed, that first stamp ran beside the first request's first token: traced (demo
  model, 256 tokens, local vault, three restarts), the restore's end to the first
  token's draw took 0.9–2.8 ms on the first request after a restart, 0.2 ms warmed.
- engine: on the default tenant's first slot, a short prefill, the export of that cut
  and its encoding to planes, its restore both ways a hit restores (the Snapshot, as a
  resident hit installs; the planes through an intake, as a durable hit reads), and one
  decoded token; then the slot is reset. The code a durable restore and a first
  step run has run once, with nothing left behind: no cut is published, no counter moves.
  MLX streams belong to the thread that made them (engine/streams.py), so `kvpack serve`
  runs the warm start on its engine thread, where requests run (Scheduler.call).
- objects: a full garbage collection, then every object left (the model's modules, the
  tokenizer's tables: they live as long as the process) frozen out of later ones
  (gc.freeze). Otherwise the first full collection after the start walks them all on
  whichever request it lands on: 0.11 s measured here, inside a 2,048-token durable
  restore that then took 0.17 s instead of 0.06 s.

A dependency that does not answer is logged and skipped: readiness (/readyz) reports it,
and the server still starts (invariant 9: an outage slows a request, it does not fail it).
Each phase's seconds are returned for the startup log.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from cas.buffers import scatter
from catalog.ids import ManifestId
from catalog.queries import Cut
from catalog.scope import Scope
from engine import format as planes_format
from engine import memory
from engine.intake import Intake
from engine.slots import Slot
from engine.state import Planes
from kvpack.service.service import Service, block_bytes
from kvpack.vault import Vault

log = logging.getLogger(__name__)
WARM_TOKENS = 8  # a short prefill: the first forward's setup, not a real prompt's cost
# The most the cache phase reads for: a slow disk (a few hundred MB/s, or a network
# volume) delays readiness by this much at most, whatever the preload setting.
PRELOAD_SECONDS = 10.0
WARM_MANIFESTS = 256  # cuts whose manifests are opened ahead (a few KiB each: catalog/opened.py)


def warm(service: Service) -> dict[str, float]:
    """Warm the store, the catalog and the engine (see the module docstring)."""
    tenant = service.tenant(service.loaded.identity.namespace)
    vocab = tenant.pool.vocab_size
    tokens = [(7919 * i + 1) % vocab for i in range(WARM_TOKENS)]
    vault, scope = service.vault, tenant.scope
    recent: list[Cut] = []  # the manifests phase's cuts, for the chunk phase
    phases: dict[str, Callable[[], object]] = {
        "memory": lambda: memory.reserve(service.restore_reserve) if memory.kept() else None,
        "shadow": tenant.pool.calibrate,
        "store": lambda: _store(vault, scope.namespace, block_bytes(service.loaded)),
        "manifests": lambda: recent.extend(_manifests(vault)),
        "chunk": lambda: vault.warm_chunk(scope, recent),
        "cache": lambda: _preload(vault, service.preload),
        "catalog": lambda: _catalog(vault, scope, tokens),
        "engine": lambda: _engine(service, tenant.pool.slot(0), tokens),
        "objects": _freeze,
    }
    seconds: dict[str, float] = {}
    for name, phase in phases.items():
        t = time.perf_counter()
        try:
            phase()
        except Exception as e:  # noqa: BLE001 - warming is best effort; readiness reports
            log.warning("warm start: %s skipped: %s: %s", name, type(e).__name__, e)
        seconds[name] = time.perf_counter() - t
    return seconds


def _freeze() -> None:
    gc.collect()
    gc.freeze()


def _store(vault: Vault, namespace: str, size: int) -> None:
    _answered(vault.check_store)
    vault.warm_reads(namespace, size)


def _manifests(vault: Vault) -> list[Cut]:
    held = vault.preload_manifests(WARM_MANIFESTS, PRELOAD_SECONDS)
    if held:
        log.info("warm start: the manifests of %d recently used cuts opened", len(held))
    return held


def _preload(vault: Vault, budget: int) -> None:
    chunks, size = vault.preload(budget, PRELOAD_SECONDS)
    if chunks:
        log.info("warm start: %d chunks of recently used cuts (%d MiB) read into memory",
                 chunks, size >> 20)  # fmt: skip


def _catalog(vault: Vault, scope: Scope, tokens: list[int]) -> None:
    _answered(vault.check_catalog)
    vault.find(scope, scope.chain(tokens))
    vault.touch_cut(ManifestId(bytes(ManifestId.SIZE)))  # a hit's stamp, of no cut


def _answered(check: Callable[[], dict[str, Any]]) -> None:
    report = check()
    if not report["up"]:
        raise ConnectionError(report.get("detail", "no answer"))


def _engine(service: Service, slot: Slot, tokens: list[int]) -> None:
    tokenizer = service.loaded.tokenizer
    try:
        tokenizer.encode("warm start")  # a text prompt's first tokenizing
        slot.prefill(tokens)
        snapshot = slot.export()
        planes = planes_format.encode(snapshot)
        for cut in (snapshot, _InMemory(planes)):  # a resident hit's install, a durable one's
            slot.reset()
            slot.restore(cut, prompt=tokens)
        decoding = slot.decoding(max_tokens=1)
        while not decoding.done:
            if (drawn := decoding.step()) is not None:
                tokenizer.decode([drawn.token])
    finally:
        slot.reset()


class _InMemory:
    """Planes as an intake Source: the path a durable restore takes, fed from memory."""

    def __init__(self, planes: Planes) -> None:
        self.planes = planes

    @property
    def layout(self) -> Mapping[str, Any]:
        return self.planes.layout

    @property
    def depth(self) -> int:
        return self.planes.depth

    def fill(self, intake: Intake) -> None:
        sizes = [(role, memoryview(data).nbytes) for role, data in self.planes.parts]
        for (_, data), segments in zip(self.planes.parts, intake.destinations(sizes), strict=True):
            scatter(data, segments)
