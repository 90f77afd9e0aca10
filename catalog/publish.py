"""Publication and loading of durable cuts.

publish: chunks stored and verified first, then the manifest object, then the
catalog rows in one transaction, so a reader never sees a manifest whose
chunks are not all stored (docs/architecture.md, invariant 6). In order:

1. the idempotency key (domain tag + identity + full-history chain digest)
   finds an existing manifest → return it (same history, one manifest); one whose
   manifest object is gone or fails its checks is condemned (catalog/condemn.py) and
   the history is published anew;
2. reserve: insert or touch a chunk row per chunk id and commit, before any
   upload (GC spares a chunk for a grace period after its last reference; a
   chunk GC has already condemned is waited for, then stored afresh). The same
   transaction names the chunks already stored: a committed manifest references
   them and GC has not condemned them;
3. ChunkStore.put_many of the others only: seal, put-if-absent, verify. A chunk
   already stored is neither sealed nor uploaded again (counted in a ChunkTally):
   its manifest was committed after it was stored and verified (invariant 6), its
   object is deleted only after its row is condemned, and step 5 re-checks that
   row, so a chunk collected meanwhile restarts the publish at 2, where it is
   no longer stored and is uploaded afresh;
4. the sealed manifest object under its own key: object_key("manifest",
   identity, "<manifest id>-<generation>"). Every attempt writes a distinct
   object, so no writer ever adopts an object a collector may be deleting;
5. one transaction: lock our chunk rows, re-check that each is the very row
   we reserved (not condemned, same first_stored_at), touch them, insert the
   identity, the manifest row (ON CONFLICT on the idempotency key DO NOTHING)
   and its manifest_chunks. A collected reservation restarts at 2; a lost
   race deletes our object and returns the winner's manifest.

load_cut: the manifest object a Cut names (the Cut carries its catalog row's
facts, so nothing is read from the catalog again), its MAC, then its identity,
depth, chain, bytes and generation against the row's (open_cut), then every chunk
verified into one buffer (the engine's reader fetches them into its own buffers
instead: kvpack/vault.py read_cut). Nothing unverified is returned. A manifest object
that is gone is a verification failure (ManifestMissing), not an outage: its row
promises it. Given the vault's OpenedManifests (catalog/opened.py), both hold every
manifest they open or seal, and open one held there without reading it again: the
object is immutable, and the row is checked against it all the same (check_row).

Generation: a hybrid clock per process (wall-clock nanoseconds, bumped to stay
strictly increasing); it stays below 2**63-1 until the year 2262 and is refused
beyond, never wrapped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from cas.chunks import Blob, ChunkStore
from cas.errors import ObjectMissing, ObjectTooLarge
from cas.ids import ChunkId
from cas.keys import Keyring
from cas.layout import object_key
from cas.seal import sealed_size
from cas.store import ObjectStore
from catalog import queries
from catalog.condemn import condemn, kind_of
from catalog.errors import (
    ChunksBeingCollected,
    GenerationExhausted,
    ManifestInvalid,
    ManifestMissing,
    StaleGeneration,
)
from catalog.ids import IdentityDigest
from catalog.manifest import (
    MAX_GENERATION,
    Manifest,
    PartRef,
    SealedManifest,
    encode_body,
    idempotency_key,
    make_manifest,
    manifest_id,
    open_sealed,
    seal_manifest,
)
from catalog.opened import OpenedManifests
from catalog.queries import Cut
from catalog.scope import Scope
from catalog.tx import Checkpoint, no_checkpoint, run_tx

MAX_RESTARTS = 5
Signer = Callable[[bytes], bytes]  # manifest body -> signature slot

_generation_lock = threading.Lock()
_last_generation = 0


def next_generation() -> int:
    """Strictly increasing within this process; refused (never wrapped) past 2**63-1."""
    global _last_generation
    with _generation_lock:
        generation = max(time.time_ns(), _last_generation + 1)
        if generation > MAX_GENERATION:
            raise GenerationExhausted(generation)
        _last_generation = generation
        return generation


@dataclass
class ChunkTally:
    """Distinct chunks publishes sealed and uploaded vs found stored already (skipped);
    one publish that restarts counts each attempt."""

    sealed: int = 0
    stored: int = 0


@dataclass(frozen=True)
class LoadedCut:
    """A verified cut: its manifest and each part's bytes, in manifest order."""

    manifest: Manifest
    parts: list[tuple[str, memoryview]]
    signature: bytes  # the envelope's signature slot (empty when unsigned)


async def publish(
    *,
    chunks: ChunkStore,
    db: Engine,
    keyring: Keyring,
    scope: Scope,
    tokens: Sequence[int],
    parts: Sequence[tuple[str, Blob]],
    layout: Mapping[str, Any],
    logits_witnessed: bool,
    producer: str,
    provenance: str = "local",
    sign: Signer | None = None,
    reclaim_wait_s: float = 10.0,
    checkpoint: Checkpoint | None = None,
    tally: ChunkTally | None = None,
    opened: OpenedManifests | None = None,
) -> Manifest:
    """Publish the cut after `tokens`; the same history published again is the same manifest.

    `sign(body)` returns the signature slot sealed into the manifest envelope (the
    producer's Ed25519 signature, catalog/signing.py); None leaves it empty.
    `checkpoint(name)` is awaited at "reserved", "chunks_stored", "manifest_stored",
    "committed" and "waiting_for_collector" (tests pause there to interleave).
    `tally` counts the chunks sealed and the ones already stored. `opened` holds the
    manifest returned (catalog/opened.py).
    """
    if chunks.namespace != scope.namespace:
        raise ValueError(f"chunk store of {chunks.namespace!r} for scope {scope}")
    chain = scope.chain(tokens)
    if chain.depth == 0:
        raise ValueError("cannot publish an empty history")
    identity = scope.identity
    key = idempotency_key(identity, chain.digest)
    mid = manifest_id(identity, chain.digest)
    point = checkpoint or no_checkpoint

    existing = await run_tx(db, lambda s: queries.cut_by_idempotency_key(session=s, key=key))
    if existing is not None:
        try:
            return (await open_cut(chunks.objects, keyring, existing, identity, opened)).manifest
        except (ManifestInvalid, StaleGeneration) as e:
            # A damaged row must not block its history for ever: condemn it, publish anew.
            await condemn(
                objects=chunks.objects,
                db=db,
                manifest_id=existing.manifest_id,
                kind=kind_of(e),
                reason=str(e),
            )

    blobs = [data for _, data in parts]
    # Each chunk is digested once per publish; the store seals under these ids.
    ids: list[ChunkId] = await asyncio.to_thread(lambda: [chunks.chunk_id(b) for b in blobs])
    sizes = {i.hex: len(b) for i, b in zip(ids, blobs, strict=True)}
    stored = {i: sealed_size(n, keyring.current) for i, n in sizes.items()}
    hex_ids = [i.hex for i in ids]

    for _ in range(MAX_RESTARTS):
        reserved, held = await _reserve(db, sizes, stored, reclaim_wait_s, point)
        await point("reserved")
        fresh = {i.hex: (i, b) for i, b in zip(ids, blobs, strict=True) if i.hex not in held}
        await chunks.put_many([b for _, b in fresh.values()], ids=[i for i, _ in fresh.values()])
        if tally is not None:
            tally.sealed += len(fresh)
            tally.stored += len(held)
        await point("chunks_stored")

        manifest, sealed, okey = _seal(
            keyring=keyring,
            identity=identity,
            chain=chain.digest,
            depth=chain.depth,
            alignment=scope.alignment,
            logits_witnessed=logits_witnessed,
            parts=[PartRef(role, i, len(b)) for (role, b), i in zip(parts, ids, strict=True)],
            layout=layout,
            producer=producer,
            sign=sign,
        )
        while not await chunks.objects.put_if_absent(okey, sealed):
            # Another process drew the same generation: draw again (the object is per attempt).
            manifest, sealed, okey = _reseal(manifest, keyring, sign)
        await point("manifest_stored")

        values = {
            "id": mid.hex,
            "identity": identity.hex,
            "depth": manifest.depth,
            "chain": manifest.chain.hex,
            "aligned": manifest.aligned,
            "logits_witnessed": manifest.logits_witnessed,
            "bytes": manifest.bytes,
            "generation": manifest.generation,
            "producer": producer,
            "provenance": provenance,
            "idempotency_key": key.hex(),
            "object_key": okey,
            "created_at": manifest.created_at,
        }
        try:
            winner = await run_tx(
                db,
                partial(
                    _commit,
                    scope=scope,
                    values=values,
                    parts=parts,
                    ids=hex_ids,
                    reserved=reserved,
                ),
            )
        except _Collected:
            # Our publish outlived the grace period: reserve and upload again.
            await chunks.objects.delete(okey)
            continue
        if winner is None:
            await point("committed")
            if opened is not None:
                opened.put(okey, open_sealed(sealed, keyring), len(sealed))
            return manifest
        await chunks.objects.delete(okey)  # nobody else can name this attempt's object
        return (await open_cut(chunks.objects, keyring, winner, identity, opened)).manifest
    raise ChunksBeingCollected([i.hex for i in ids])


async def load_cut(
    *,
    chunks: ChunkStore,
    keyring: Keyring,
    cut: Cut,
    identity: IdentityDigest,
    opened: OpenedManifests | None = None,
) -> LoadedCut:
    """Fetch and verify a cut: MAC, identity, agreement with its row, then every chunk
    (open_cut, then every chunk into one buffer)."""
    sealed = await open_cut(chunks.objects, keyring, cut, identity, opened)
    parts = await _in_one_buffer(chunks, sealed.manifest)
    return LoadedCut(sealed.manifest, parts, sealed.signature)


async def _in_one_buffer(chunks: ChunkStore, manifest: Manifest) -> list[tuple[str, memoryview]]:
    buffer, parts, offset = await chunks.get_many(manifest.chunk_refs), [], 0
    for p in manifest.parts:
        parts.append((p.role, buffer[offset : offset + p.size]))
        offset += p.size
    return parts


# -- steps -----------------------------------------------------------------------------


async def _reserve(
    db: Engine,
    sizes: Mapping[str, int],
    stored: Mapping[str, int],
    wait_s: float,
    point: Checkpoint,
) -> tuple[dict[str, datetime], set[str]]:
    """Committed chunk rows for every id (waiting while GC finishes deleting condemned
    ones), and the ids among them already stored."""
    deadline = time.monotonic() + wait_s
    delay = 0.01

    def reserve(s: Session) -> tuple[dict[str, queries.ChunkClaim], set[str]]:
        now = datetime.now(UTC)
        got = queries.reserve_chunks(session=s, chunks=sizes, now=now, stored_sizes=stored)
        return got, queries.stored_chunks(session=s, ids=list(sizes))

    while True:
        got, held = await run_tx(db, reserve)
        condemned = sorted(i for i, c in got.items() if c.condemned)
        if not condemned:
            return {i: c.first_stored_at for i, c in got.items()}, held
        if time.monotonic() > deadline:
            raise ChunksBeingCollected(condemned)
        await point("waiting_for_collector")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


class _Collected(Exception):
    """A reservation was collected before the commit (rolls the transaction back)."""


def _commit(
    session: Session,
    scope: Scope,
    values: dict[str, Any],
    parts: Sequence[tuple[str, Any]],
    ids: Sequence[str],
    reserved: Mapping[str, datetime],
) -> Cut | None:
    """Rows for the manifest in one transaction; the winner's row if another publish won."""
    now = datetime.now(UTC)
    queries.ensure_identity(
        session=session,
        identity=scope.identity,
        components=scope.components,
        now=now,
        namespace=scope.namespace,
        model=scope.model,
    )
    held = queries.claims(session=session, ids=ids, lock=True)
    for i in ids:
        claim = held.get(i)
        if claim is None or claim.condemned or claim.first_stored_at != reserved[i]:
            raise _Collected(i)
    queries.touch_chunks(session=session, ids=ids, now=now)
    rows = [(role, i) for (role, _), i in zip(parts, ids, strict=True)]
    if queries.insert_manifest(session=session, row=values, chunks=rows):
        return None
    return queries.cut_by_idempotency_key(
        session=session, key=bytes.fromhex(values["idempotency_key"])
    )


def _seal(*, keyring: Keyring, sign: Signer | None, **fields: Any) -> tuple[Manifest, bytes, str]:
    manifest = make_manifest(generation=next_generation(), **fields)
    return manifest, _envelope(manifest, keyring, sign), _object_key(manifest)


def _reseal(old: Manifest, keyring: Keyring, sign: Signer | None) -> tuple[Manifest, bytes, str]:
    fields = {f: getattr(old, f) for f in old.__dataclass_fields__}
    manifest = Manifest(**{**fields, "generation": next_generation()})
    return manifest, _envelope(manifest, keyring, sign), _object_key(manifest)


def _envelope(manifest: Manifest, keyring: Keyring, sign: Signer | None) -> bytes:
    signature = sign(encode_body(manifest)) if sign is not None else b""
    return seal_manifest(manifest, keyring, signature=signature)


def _object_key(manifest: Manifest) -> str:
    """Per publish attempt: the manifest id and the generation it drew."""
    return object_key(
        "manifest", manifest.identity.hex, f"{manifest.id.hex}-{manifest.generation:016x}"
    )


# Far above any manifest (a few KiB: an entry per part); a larger object is not one.
MAX_MANIFEST_BYTES = 16 << 20


async def open_cut(
    objects: ObjectStore,
    keyring: Keyring,
    cut: Cut,
    identity: IdentityDigest,
    opened: OpenedManifests | None = None,
) -> SealedManifest:
    """The manifest a cut's row names, verified against the row and the asked identity:
    ManifestMissing, ManifestInvalid or StaleGeneration otherwise (`kvpack vault verify`
    checks every cut with it). With `opened`, a manifest held there is not fetched again
    (catalog/opened.py) and one fetched is held."""
    _asked(cut, identity)  # before any read
    held = _held(opened, cut, identity)
    if held is not None:
        return held
    try:
        data = await objects.get(cut.object_key)
    except ObjectMissing as e:
        raise ManifestMissing(cut.manifest_id, cut.object_key) from e
    return _checked(data, keyring, cut, identity, opened)


def open_mapped_cut(
    objects: ObjectStore,
    keyring: Keyring,
    cut: Cut,
    identity: IdentityDigest,
    opened: OpenedManifests | None = None,
) -> SealedManifest:
    """open_cut from a store that maps its objects (a local directory), on the calling
    thread: a local file is read without a trip through the event loop and back."""
    _asked(cut, identity)
    held = _held(opened, cut, identity)
    if held is not None:
        return held
    try:
        with objects.map(cut.object_key, MAX_MANIFEST_BYTES) as mapped:  # type: ignore[attr-defined]
            data = bytes(mapped.view)
    except ObjectMissing as e:
        raise ManifestMissing(cut.manifest_id, cut.object_key) from e
    except ObjectTooLarge as e:
        raise ManifestInvalid(f"manifest object {cut.object_key} has {e.size} bytes") from e
    return _checked(data, keyring, cut, identity, opened)


def _held(
    opened: OpenedManifests | None, cut: Cut, identity: IdentityDigest
) -> SealedManifest | None:
    held = opened.get(cut.object_key) if opened is not None else None
    return None if held is None else check_row(held, cut, identity)


def _asked(cut: Cut, identity: IdentityDigest) -> None:
    if cut.identity != identity:
        raise ManifestInvalid(f"cut {cut.manifest_id} is of identity {cut.identity.short}")


def _checked(
    data: bytes,
    keyring: Keyring,
    cut: Cut,
    identity: IdentityDigest,
    opened: OpenedManifests | None,
) -> SealedManifest:
    sealed = check_row(open_sealed(data, keyring), cut, identity)
    if opened is not None:
        opened.put(cut.object_key, sealed, len(data))
    return sealed


def check_row(sealed: SealedManifest, cut: Cut, identity: IdentityDigest) -> SealedManifest:
    """`sealed`, a MAC-verified manifest, if it is the one the cut's row describes for the
    asked identity; ManifestInvalid or StaleGeneration otherwise."""
    _asked(cut, identity)
    manifest = sealed.manifest
    if manifest.identity != identity:
        raise ManifestInvalid(f"manifest {cut.object_key} is of identity {manifest.identity.short}")
    facts = (
        manifest.id,
        manifest.depth,
        manifest.chain,
        manifest.aligned,
        manifest.logits_witnessed,
        manifest.bytes,
    )
    if facts != (cut.manifest_id, cut.depth, cut.chain, cut.aligned, cut.logits_witnessed,
                 cut.bytes):  # fmt: skip
        raise ManifestInvalid(f"manifest object {cut.object_key} does not match its catalog row")
    if manifest.generation != cut.generation:
        raise StaleGeneration(cut.manifest_id, cut.generation, manifest.generation)
    return sealed
