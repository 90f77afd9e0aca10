"""Whole-vault verification (`kvpack vault verify`), like restic's `check --read-data`.

What is checked, for every cut the catalog lists:
- its manifest object exists, its MAC verifies and it agrees with its row (catalog/
  publish.py open_cut: identity, depth, chain, bytes, generation);
- its signature is by one of this vault's producer keys (when the keys are given);
- its manifest_chunks rows name the manifest's parts, in order;
- every chunk it references exists, with an object size that a chunk of the row's
  plaintext size seals to, equal to the size the catalog recorded for it, and the
  manifest's part size equal to the chunk row's;
- with read_data, every referenced chunk (or a `sample` fraction of them) is fetched,
  its seal opened and its plaintext re-hashed under its namespace's digest key.

Words:
- problem: one broken object (a manifest object or a chunk), what is wrong with it
  (its kind, catalog/condemn.py), and the cuts it breaks.
- repair: condemn every cut a problem breaks (catalog/condemn.py): its rows go, a
  broken chunk's object goes, and the next request recomputes and republishes it.
Verification reads, never writes, unless asked to repair.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sqlalchemy import Engine, distinct, func, select
from sqlalchemy.orm import Session

from cas.chunks import ChunkRef, ChunkStore, bounded
from cas.errors import ChunkCorrupt, ChunkMissing, ObjectMissing
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.seal import sealed_size
from cas.store import ObjectStore
from catalog.condemn import Condemned, condemn, kind_of
from catalog.errors import ManifestInvalid, StaleGeneration
from catalog.ids import ManifestId
from catalog.manifest import encode_body
from catalog.models import ChunkRow, IdentityRow, ManifestChunkRow, ManifestRow
from catalog.publish import open_cut
from catalog.queries import CUT_COLUMNS, Cut
from catalog.signing import MANIFEST_DOMAIN, SignatureInvalid, verify
from catalog.tx import run_tx

MAX_CONCURRENCY = 8
Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class CutRef:
    manifest_id: str  # hex
    identity: str  # hex
    depth: int

    def to_json(self) -> dict[str, Any]:
        return {"manifest": self.manifest_id, "identity": self.identity, "depth": self.depth}


@dataclass
class Problem:
    object_key: str
    kind: str
    detail: str
    cuts: list[CutRef] = field(default_factory=list)
    chunk: str | None = None  # hex, when the broken object is a chunk

    def to_json(self) -> dict[str, Any]:
        return {
            "object": self.object_key,
            "kind": self.kind,
            "detail": self.detail,
            "chunk": self.chunk,
            "cuts": [c.to_json() for c in self.cuts],
        }


@dataclass
class VerifyReport:
    manifests: int = 0
    chunks: int = 0  # distinct referenced chunks
    chunks_read: int = 0
    bytes_read: int = 0
    read_data: bool = False
    sample: float = 1.0
    problems: list[Problem] = field(default_factory=list)
    repaired: list[Condemned] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def broken_cuts(self) -> set[str]:
        return {c.manifest_id for p in self.problems for c in p.cuts}

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "manifests": self.manifests,
            "chunks": self.chunks,
            "chunks_read": self.chunks_read,
            "bytes_read": self.bytes_read,
            "read_data": self.read_data,
            "sample": self.sample,
            "broken_cuts": len(self.broken_cuts),
            "problems": [p.to_json() for p in self.problems],
            "repaired": [c.manifest_id.hex for c in self.repaired],
        }


@dataclass
class _Catalog:
    cuts: list[tuple[Cut, str | None]]  # (cut, namespace)
    parts: dict[str, list[str]]  # manifest hex -> chunk ids in ordinal order
    chunks: dict[str, tuple[int, int | None]]  # chunk hex -> (size, stored size)


def plan_size(*, session: Session, read_data: bool, sample: float) -> int:
    """How many steps verify will report through `progress` (for a progress bar)."""
    manifests = session.scalar(select(func.count()).select_from(ManifestRow)) or 0
    chunks = session.scalar(select(func.count(distinct(ManifestChunkRow.chunk)))) or 0
    reads = round(chunks * sample) if read_data else 0
    return int(manifests) + int(chunks) + int(reads)


async def verify_vault(
    *,
    objects: ObjectStore,
    db: Engine,
    keyring: Keyring,
    public_keys: Mapping[str, bytes] | None,
    read_data: bool = False,
    sample: float = 1.0,
    repair: bool = False,
    progress: Progress | None = None,
    rng: random.Random | None = None,
) -> VerifyReport:
    """Check every cut (see the module docstring); with `repair`, condemn what is broken."""
    if not 0 < sample <= 1:
        raise ValueError(f"sample must be in (0, 1], got {sample}")
    step = progress or (lambda n: None)
    report = VerifyReport(read_data=read_data, sample=sample)
    cat = await run_tx(db, _read_catalog)
    report.manifests = len(cat.cuts)
    users: dict[str, list[CutRef]] = defaultdict(list)
    namespace_of: dict[str, str] = {}
    for cut, ns in cat.cuts:
        ref = CutRef(cut.manifest_id.hex, cut.identity.hex, cut.depth)
        for chunk in cat.parts.get(cut.manifest_id.hex, []):
            users[chunk].append(ref)
            if ns is not None:
                namespace_of.setdefault(chunk, ns)
    stores: dict[str, ChunkStore] = {}

    def store(ns: str) -> ChunkStore:
        if ns not in stores:
            stores[ns] = ChunkStore(objects, keyring, namespace=ns)
        return stores[ns]

    async def check_manifest(cut: Cut, ns: str | None) -> None:
        ref = CutRef(cut.manifest_id.hex, cut.identity.hex, cut.depth)
        problem = await _manifest_problem(
            store(ns or "default"),
            keyring,
            public_keys,
            cut,
            cat.parts.get(cut.manifest_id.hex, []),
        )
        if problem is not None:
            problem.cuts.append(ref)
            report.problems.append(problem)
        step(1)

    await bounded([partial(check_manifest, c, n) for c, n in cat.cuts], MAX_CONCURRENCY)

    referenced = sorted(users)
    report.chunks = len(referenced)
    plausible_for = {
        size: {sealed_size(size, k) for k in keyring.keys} for size, _ in cat.chunks.values()
    }
    sound: list[str] = []

    async def check_chunk(chunk: str) -> None:
        size, stored = cat.chunks[chunk]
        key = ChunkStore.key(ChunkId.from_hex(chunk))
        problem = None
        try:
            info = await objects.stat(key)
        except ObjectMissing:
            problem = Problem(key, "chunk_missing", "the chunk object is gone")
        else:
            if info.size not in plausible_for[size]:
                problem = Problem(
                    key,
                    "chunk_truncated" if info.size < min(plausible_for[size]) else "size_mismatch",
                    f"object has {info.size} bytes; a chunk of {size} plaintext "
                    f"bytes seals to {sorted(plausible_for[size])}",
                )
            elif stored is not None and info.size != stored:
                problem = Problem(
                    key, "size_mismatch", f"object has {info.size} bytes, the catalog says {stored}"
                )
        if problem is None:
            sound.append(chunk)
        else:
            problem.chunk = chunk
            problem.cuts.extend(users[chunk])
            report.problems.append(problem)
        step(1)

    await bounded([partial(check_chunk, c) for c in referenced], MAX_CONCURRENCY)

    if read_data:
        chosen = sorted(sound)
        if sample < 1:
            chosen = sorted((rng or random.Random()).sample(chosen, round(len(chosen) * sample)))

        async def read(chunk: str) -> None:
            size, _ = cat.chunks[chunk]
            ns = namespace_of.get(chunk)
            key = ChunkStore.key(ChunkId.from_hex(chunk))
            try:
                if ns is None:
                    raise ChunkCorrupt(ChunkId.from_hex(chunk), "no namespace to re-hash under")
                await store(ns).get(ChunkRef(ChunkId.from_hex(chunk), size))
            except (ChunkCorrupt, ChunkMissing) as e:
                report.problems.append(Problem(key, kind_of(e), str(e), list(users[chunk]), chunk))
            else:
                report.chunks_read += 1
                report.bytes_read += size
            step(1)

        # Two at a time: each read holds a whole chunk (and its sealed copy) in memory.
        await bounded([partial(read, c) for c in chosen], 2)

    report.problems.sort(key=lambda p: (p.kind, p.object_key))
    if repair:
        for p in report.problems:
            broken = None if p.chunk is None else ChunkId.from_hex(p.chunk)
            for ref in p.cuts:
                report.repaired += await condemn(
                    objects=objects,
                    db=db,
                    manifest_id=ManifestId.from_hex(ref.manifest_id),
                    kind=p.kind,
                    reason=f"verify: {p.detail}",
                    chunk=broken,
                )
                broken = None  # the first condemnation took the chunk and all its cuts
    return report


async def _manifest_problem(
    chunks: ChunkStore,
    keyring: Keyring,
    public_keys: Mapping[str, bytes] | None,
    cut: Cut,
    parts: list[str],
) -> Problem | None:
    key = cut.object_key
    try:
        sealed = await open_cut(chunks.objects, keyring, cut, cut.identity)
    except (ManifestInvalid, StaleGeneration) as e:
        return Problem(key, kind_of(e), str(e))
    manifest = sealed.manifest
    if public_keys is not None:
        if not sealed.signature:
            return Problem(key, "unsigned", "the manifest carries no producer signature")
        try:
            await asyncio.to_thread(
                verify, public_keys, MANIFEST_DOMAIN, encode_body(manifest), sealed.signature
            )
        except SignatureInvalid as e:
            return Problem(key, "signature_invalid", str(e))
    named = [p.chunk_id.hex for p in manifest.parts]
    if named != parts:
        return Problem(
            key,
            "parts_mismatch",
            f"the manifest names {len(named)} chunks, its rows {len(parts)} others",
        )
    return None


def _read_catalog(s: Session) -> _Catalog:
    m, i = ManifestRow, IdentityRow
    cuts = []
    for row in s.execute(
        select(*CUT_COLUMNS, i.namespace, i.components)
        .join(i, i.digest == m.identity)
        .order_by(m.identity, m.depth, m.id)
    ):
        ns = row.namespace or (row.components or {}).get("namespace")
        cuts.append((Cut.of(row), ns if isinstance(ns, str) else None))
    parts: dict[str, list[str]] = defaultdict(list)
    for mid, chunk in s.execute(
        select(ManifestChunkRow.manifest, ManifestChunkRow.chunk).order_by(
            ManifestChunkRow.manifest, ManifestChunkRow.ordinal
        )
    ):
        parts[mid].append(chunk)
    chunks = {
        r.id: (r.size, r.stored_size)
        for r in s.execute(select(ChunkRow.id, ChunkRow.size, ChunkRow.stored_size))
    }
    return _Catalog(cuts, dict(parts), chunks)
