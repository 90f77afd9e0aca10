"""Shared helpers for catalog tests: small deterministic histories and payloads."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from catalog import queries
from catalog.chain import token_chain
from catalog.ids import IdentityDigest, ManifestId
from catalog.manifest import idempotency_key, manifest_id
from catalog.publish import load_cut, publish
from catalog.scope import Scope

A = 256  # the production alignment; histories stay small (a few hundred token ids)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def identity(name: str) -> IdentityDigest:
    return IdentityDigest(name.encode().ljust(32, b"\0")[:32])


def scope(ident: IdentityDigest, namespace: str = "test") -> Scope:
    """The scope of `ident` in the chunk_store fixture's namespace."""
    return Scope(ident, namespace, A, components={"model": "tiny"})


def payloads(seed: int, n: int = 3, size: int = 512) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    return [(f"plane{i}", rng.randbytes(size)) for i in range(n)]


def add_cut(
    session: Session,
    *,
    ident: IdentityDigest,
    history: list[int],
    depth: int,
    logits: bool = True,
    nbytes: int = 100,
    at: datetime | None = None,
    chunks: Sequence[tuple[str, int]] = (),
) -> ManifestId:
    """A catalog row for the cut after history[:depth] (no objects: for query tests),
    referencing `chunks` ((chunk id hex, size), their rows made) in that order."""
    chain = token_chain(history[:depth], alignment=A)
    now = at or datetime.now(UTC)
    queries.ensure_identity(session=session, identity=ident, components={"t": 1}, now=now)
    mid = manifest_id(ident, chain.digest)
    row: dict[str, Any] = {
        "id": mid.hex,
        "identity": ident.hex,
        "depth": depth,
        "chain": chain.digest.hex,
        "aligned": depth % A == 0,
        "logits_witnessed": logits,
        "bytes": nbytes,
        "generation": 1,
        "producer": "test",
        "provenance": "local",
        "idempotency_key": idempotency_key(ident, chain.digest).hex(),
        "object_key": f"manifests/{ident.hex}/{mid.hex}",
        "created_at": now,
    }
    if chunks:
        sizes = dict(chunks)
        queries.reserve_chunks(session=session, chunks=sizes, now=now, stored_sizes={})
    listed = [(f"part/{i}", chunk) for i, (chunk, _) in enumerate(chunks)]
    assert queries.insert_manifest(session=session, row=row, chunks=listed)
    return mid


ALICE = identity("alice")
BOB = identity("bob")


def do_publish(store, engine, history, parts, ident=ALICE, **kw):
    """publish() with test defaults; keyword arguments override them."""
    args = dict(
        chunks=store,
        db=engine,
        keyring=store.keyring,
        scope=scope(ident, store.namespace),
        tokens=history,
        parts=parts,
        layout={"layers": 1, "dtype": "float16"},
        logits_witnessed=True,
        producer="test",
    )
    args.update(kw)
    return publish(**args)


def find(engine, history, ident=ALICE):
    with Session(engine) as s:
        return queries.find_deepest(
            session=s, identity=ident, chain=token_chain(history, alignment=A)
        )


def load_of(store, engine, cut, ident=ALICE):
    """load_cut() of `cut` with the test store's keyring."""
    return load_cut(chunks=store, keyring=store.keyring, cut=cut, identity=ident)


async def load(store, engine, history, ident=ALICE):
    cut = find(engine, history, ident)
    assert cut is not None, "the published cut is not in the catalog"
    return await load_of(store, engine, cut, ident)
