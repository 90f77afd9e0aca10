"""The catalog benchmark: find_deepest on a catalog of realistic size, end to end from Python.

- fill: a fresh PostgreSQL database on the server the URL names (created, migrated to
  head, dropped afterwards unless kept) gets `manifests` rows by COPY. They are cuts as
  the service publishes them: conversations under a few identities, each a token chain
  that starts with one of a few shared system prompts and grows turn by turn; every turn
  publishes its 2,048-token multiples, its last aligned cut and its exact cut (with
  logits), and a cut an earlier turn or another conversation already published (a
  shared system prompt's) is the same manifest (one history, one manifest, as the
  catalog's unique idempotency key makes it). Chain links are random 32-byte digests,
  shared exactly where histories share tokens (what a real chain's digests look like to
  the catalog). Only the tables find_deepest reads are filled (identities, manifests).
- chunk lists (--chunk-lists): also each cut's chunk list (chunks, manifest_chunks) as
  the service records it — a chunk per block, shared wherever histories share the
  block's tokens, then a logits chunk for an exact cut — and every lookup made as a
  vault on a remote store makes it: `find` brings the found cut's list in the same
  statement (kvpack/vault.py). The validity gate checks each list too.
- legs: lookups through Vault.find, the server's own path (the catalog breaker, the
  Reader, the query): exact hits of prompts at three depth ranges, ancestor hits (a new
  turn extending a published prompt: its deepest aligned cut serves), misses (a chain
  nobody published), and a SELECT 1 round trip through the same Reader (the floor).
  Legs take turns, one lookup each, so they share the machine's state alike.
- validity gate: every answer is checked against the cut the fill says must serve; one
  wrong answer makes the run invalid (the command exits 1).
- execution: EXPLAIN ANALYZE of the same statement with a sample of each leg's
  parameters: the server's own planning and execution time (median).
- receipt: every figure as JSON, <receipts dir>/<run id>-catalog.json.
"""

from __future__ import annotations

import io
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import make_url

from cas.store import ObjectStore
from catalog.chain import TokenChain
from catalog.db import normalize_database_url
from catalog.ids import ChainDigest, IdentityDigest
from catalog.models import ChunkRow, IdentityRow, ManifestChunkRow, ManifestRow
from catalog.queries import (
    FIND_DEEPEST_POSTGRES,
    FIND_DEEPEST_WITH_CHUNKS_POSTGRES,
    Cut,
    find_deepest_parameters,
)
from catalog.scope import Scope
from kvpack.bench.serve import new_run_id, write_receipt
from kvpack.config import Settings
from kvpack.vault import Vault

A = 256  # the default alignment
DURABLE_EVERY = 2048  # the service publishes durable cuts at these multiples
BLOCK_BYTES = 11_796_480  # one 256-token block of the demo model's state (11.25 MiB)
HIT_RANGES = {"hit <= 1k": (1, 1024), "hit 1k-4k": (1025, 4096), "hit 4k-8k": (4097, 8448)}
LEGS = (*HIT_RANGES, "ancestor hit", "miss", "round trip")
LOGITS_BYTES = 196_608  # the demo model's final logits row (49,152 float32)
RECEIPT_VERSION = 1


@dataclass(frozen=True)
class CatalogBenchOptions:
    database_url: str  # the server (and the database to connect to first)
    manifests: int = 1_000_000
    samples: int = 2000  # timed lookups per leg
    identities: int = 4
    system_prompts: int = 32  # per identity
    max_blocks: int = 32  # a conversation's longest history, in blocks of A tokens
    explain_samples: int = 50
    seed: int = 0
    keep: bool = False
    chunk_lists: bool = False  # fill the chunk lists and look up as from a remote store


@dataclass
class Conversation:
    identity: IdentityDigest
    links: list[tuple[int, ChainDigest]]  # its aligned links
    turns: list[tuple[int, ChainDigest]]  # each turn's exact end


@dataclass
class Leg:
    name: str
    ms: list[float] = field(default_factory=list)
    wrong: int = 0
    chain_links: int = 0  # links per lookup (median)

    def figures(self) -> dict[str, Any]:
        ms = sorted(self.ms)
        return {
            "lookups": len(ms),
            "p50_ms": quantile(ms, 0.5),
            "p90_ms": quantile(ms, 0.9),
            "p99_ms": quantile(ms, 0.99),
            "wrong": self.wrong,
            "chain_links": self.chain_links,
        }


def quantile(sorted_ms: list[float], q: float) -> float | None:
    """The `q` quantile of ascending milliseconds (the sample at that rank), None if none."""
    if not sorted_ms:
        return None
    return round(sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))], 4)


# -- the fill --------------------------------------------------------------------------


class Fill:
    """Generates conversations and their manifest rows (see the module docstring)."""

    def __init__(self, opts: CatalogBenchOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.identities = [IdentityDigest(self._bytes()) for _ in range(opts.identities)]
        self.prompts = {
            ident: [self._extend([], 0, self.rng.randint(1, 4)) for _ in range(opts.system_prompts)]
            for ident in self.identities
        }
        # The only links conversations share; each is one manifest however many publish it.
        self._shared = {c for ps in self.prompts.values() for p in ps for _, c in p}
        self._published_shared: set[ChainDigest] = set()
        self._listed_shared: set[ChainDigest] = set()  # shared blocks with a chunk row
        self.rows = 0
        self.chunk_rows = self.list_rows = 0  # chunks, manifest_chunks
        self.sample: list[Conversation] = []  # a reservoir of conversations to look up
        self._seen = 0

    def _bytes(self) -> bytes:
        return self.rng.randbytes(32)

    def _extend(
        self, links: list[tuple[int, ChainDigest]], depth: int, blocks: int
    ) -> list[tuple[int, ChainDigest]]:
        return links + [(depth + (i + 1) * A, ChainDigest(self._bytes())) for i in range(blocks)]

    def conversation(self) -> Conversation:
        ident = self.rng.choice(self.identities)
        system = self.rng.choice(self.prompts[ident])
        blocks = self.rng.randint(len(system), self.opts.max_blocks)
        links = self._extend(system, len(system) * A, blocks - len(system))
        ends = range(len(system) * A + 1, blocks * A + A)
        depths = sorted(self.rng.sample(ends, min(len(ends), self.rng.randint(1, 4))))
        # An exact end is not aligned here (an aligned end is its own aligned link).
        turns = [(d + (d % A == 0), ChainDigest(self._bytes())) for d in depths]
        return Conversation(identity=ident, links=links, turns=turns)

    def cuts(self, conv: Conversation) -> Iterator[tuple[IdentityDigest, int, ChainDigest, bool]]:
        """(identity, depth, chain, exact) of each manifest the conversation publishes."""
        aligned = dict(conv.links)
        published: set[int] = set()
        for depth, digest in conv.turns:
            last = depth // A * A
            wanted = list(range(DURABLE_EVERY, depth + 1, DURABLE_EVERY))
            if last >= A:
                wanted.append(last)
            for d in wanted:
                if d not in published and d in aligned:
                    published.add(d)
                    if self._first(aligned[d]):
                        yield conv.identity, d, aligned[d], False
            yield conv.identity, depth, digest, True

    def _first(self, chain: ChainDigest) -> bool:
        """Whether no conversation has published this history yet (the catalog holds one
        manifest per identity and history: its idempotency key is unique)."""
        if chain not in self._shared:
            return True  # a conversation's own link: no other history has it
        if chain in self._published_shared:
            return False
        self._published_shared.add(chain)
        return True

    def keep(self, conv: Conversation) -> None:
        """Reservoir sampling: every conversation is as likely to be looked up."""
        self._seen += 1
        size = max(self.opts.samples // 4, 50)
        if len(self.sample) < size:
            self.sample.append(conv)
        elif (j := self.rng.randrange(self._seen)) < size:
            self.sample[j] = conv

    def copy_rows(self, out: Rows, limit: int) -> None:
        """Tab-separated rows until `limit` manifest rows (whole conversations)."""
        now = datetime.now(UTC).isoformat()
        producer = "bench-producer"
        while self.rows < limit:
            conv = self.conversation()
            self.keep(conv)
            listed: set[ChainDigest] = set()  # this conversation's blocks with a chunk row
            for ident, depth, chain, exact in self.cuts(conv):
                mid = self.rng.randbytes(16).hex()
                gen = 1_700_000_000_000_000_000 + self.rows
                blocks = -(-depth // A)
                fields = (
                    mid, ident.hex, str(depth), chain.hex, "f" if exact else "t",
                    "t" if exact else "f", str(blocks * BLOCK_BYTES), str(gen), producer,
                    "local", self.rng.randbytes(32).hex(),
                    f"manifests/{ident.hex}/{mid}-{gen}", now, "0",
                )  # fmt: skip
                out.manifests.write("\t".join(fields) + "\n")
                if self.opts.chunk_lists:
                    self._chunk_list(out, conv, mid, depth, exact, listed, now)
                self.rows += 1

    def _chunk_list(
        self,
        out: Rows,
        conv: Conversation,
        mid: str,
        depth: int,
        exact: bool,
        listed: set[ChainDigest],
        now: str,
    ) -> None:
        """A cut's chunk rows: a block's chunk is named by its aligned link (equal
        histories, equal block, one chunk), an exact cut's partial last block and its
        logits by chunks of their own."""
        blocks = [c for _, c in conv.links[: depth // A]]
        parts = [(f"block/{i}", c.hex) for i, c in enumerate(blocks)]
        for c in blocks:
            seen = self._listed_shared if c in self._shared else listed
            if c not in seen:
                seen.add(c)
                self._chunk_row(out, c.hex, BLOCK_BYTES, now)
        if exact:
            tail = (depth % A) * BLOCK_BYTES // A
            for role, size in ((f"block/{depth // A}", tail), ("logits", LOGITS_BYTES)):
                chunk = self.rng.randbytes(32).hex()
                self._chunk_row(out, chunk, size, now)
                parts.append((role, chunk))
        for ordinal, (role, chunk) in enumerate(parts):
            out.manifest_chunks.write(f"{mid}\t{ordinal}\t{role}\t{chunk}\n")
        self.list_rows += len(parts)

    def _chunk_row(self, out: Rows, chunk: str, size: int, now: str) -> None:
        out.chunks.write(f"{chunk}\t{size}\t{size}\t{now}\t{now}\n")
        self.chunk_rows += 1


@dataclass
class Rows:
    """One batch of COPY text per table, each field named after its table."""

    manifests: io.StringIO = field(default_factory=io.StringIO)
    chunks: io.StringIO = field(default_factory=io.StringIO)
    manifest_chunks: io.StringIO = field(default_factory=io.StringIO)


def expected_chunks(depth: int) -> int:
    """How many chunks the cut at `depth` lists: its blocks, and for an exact
    cut (never aligned here) its partial last block and its logits."""
    return depth // A if depth % A == 0 else depth // A + 2


MANIFEST_COLUMNS = (
    "id", "identity", "depth", "chain", "aligned", "logits_witnessed", "bytes", "generation",
    "producer", "provenance", "idempotency_key", "object_key", "created_at", "hits",
)  # fmt: skip
CHUNK_COLUMNS = ("id", "size", "stored_size", "first_stored_at", "last_referenced_at")
MANIFEST_CHUNK_COLUMNS = ("manifest", "ordinal", "role", "chunk")


def fill(conn: psycopg.Connection, fill_: Fill, *, log: Callable[[str], None]) -> float:
    """COPY the identities and `manifests` rows (and their chunk lists); VACUUM (ANALYZE);
    the seconds it took."""
    t0 = time.perf_counter()
    now = datetime.now(UTC)
    with conn.cursor() as cur:
        for ident in fill_.identities:
            cur.execute(
                f"INSERT INTO {IdentityRow.__tablename__} (digest, created_at, namespace, model)"
                " VALUES (%s, %s, %s, %s)",
                (ident.hex, now, "bench", "bench"),
            )
        batch = 50_000
        tables = ((ManifestRow, MANIFEST_COLUMNS), (ChunkRow, CHUNK_COLUMNS),
                  (ManifestChunkRow, MANIFEST_CHUNK_COLUMNS))  # fmt: skip
        while fill_.rows < fill_.opts.manifests:
            rows = Rows()
            fill_.copy_rows(rows, min(fill_.rows + batch, fill_.opts.manifests))
            for table, columns in tables:  # in this order: the foreign keys
                text_ = getattr(rows, table.__tablename__).getvalue()
                if text_:
                    sql = f"COPY {table.__tablename__} ({', '.join(columns)}) FROM STDIN"
                    with cur.copy(sql) as copy:
                        copy.write(text_)
            log(f"  {fill_.rows:,} manifests ({time.perf_counter() - t0:.0f} s)")
        conn.commit()
        # Vacuumed now: PostgreSQL's autovacuum would otherwise vacuum the millions of
        # new rows on its own, maybe while the lookups are timed.
        conn.autocommit = True
        for table, _ in tables:
            cur.execute(f"VACUUM (ANALYZE) {table.__tablename__}")
    return time.perf_counter() - t0


# -- the lookups -----------------------------------------------------------------------


def lookups(fill_: Fill) -> dict[str, list[tuple[IdentityDigest, TokenChain, int | None]]]:
    """Per leg: (identity, chain, the depth that must serve; None for a miss)."""
    rng = random.Random(fill_.opts.seed + 1)
    legs: dict[str, list[tuple[IdentityDigest, TokenChain, int | None]]] = {n: [] for n in LEGS}
    for conv in fill_.sample:
        aligned = dict(conv.links)
        for depth, digest in conv.turns:
            links = tuple((d, c) for d, c in conv.links if d < depth) + ((depth, digest),)
            chain = TokenChain(alignment=A, depth=depth, links=links)
            for name, (lo, hi) in HIT_RANGES.items():
                if lo <= depth <= hi:
                    legs[name].append((conv.identity, chain, depth))
            last = depth // A * A
            if last >= A:  # the next turn: the history so far, then new tokens
                more = rng.randint(1, 8)
                ext = [(d, c) for d, c in conv.links if d <= last]
                ext += [(last + (i + 1) * A, ChainDigest(rng.randbytes(32))) for i in range(more)]
                end = last + more * A + rng.randint(1, A - 1)
                ext.append((end, ChainDigest(rng.randbytes(32))))
                ancestor = TokenChain(alignment=A, depth=end, links=tuple(ext))
                assert aligned[last] == ext[last // A - 1][1]
                legs["ancestor hit"].append((conv.identity, ancestor, last))
        depth = rng.randint(A, 16 * A)
        links = tuple((d, ChainDigest(rng.randbytes(32))) for d in range(A, depth + 1, A))
        tail = (depth + 1, ChainDigest(rng.randbytes(32)))
        miss = TokenChain(alignment=A, depth=depth + 1, links=(*links, tail))
        legs["miss"].append((conv.identity, miss, None))
    return legs


def run(opts: CatalogBenchOptions, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fill a fresh database, time the legs; the receipt (see the module docstring)."""
    if opts.manifests < 1 or opts.samples < 1:
        raise ValueError("manifests and samples must be >= 1")
    run_id = new_run_id()
    name = f"kvpack_bench_{run_id.replace('-', '_').lower()}"
    with (
        fresh_database(opts.database_url, name, keep=opts.keep, log=log) as url,
        tempfile.TemporaryDirectory(prefix="kvpack-bench-catalog-") as data_dir,
    ):
        settings = Settings.load(data_dir=Path(data_dir), database_url=url, env={})
        remote = AsRemote(settings.open_store()) if opts.chunk_lists else None
        vault = Vault.open(settings, objects=remote)  # migrates the fresh database to head
        try:
            fill_ = Fill(opts)
            log(f"filling {opts.manifests:,} manifests ...")
            with psycopg.connect(_libpq(url)) as conn:
                fill_s = fill(conn, fill_, log=log)
            receipt = measure(vault, fill_, opts, log=log)
        finally:
            vault.close()
    receipt.update(
        version=RECEIPT_VERSION,
        run_id=run_id,
        options=asdict(opts) | {"database_url": _redacted(opts.database_url)},
        manifests=fill_.rows,
        chunk_rows=fill_.chunk_rows,
        manifest_chunk_rows=fill_.list_rows,
        fill_seconds=round(fill_s, 1),
    )
    receipt["valid"] = all(leg["wrong"] == 0 for leg in receipt["legs"].values())
    return receipt


def measure(
    vault: Vault, fill_: Fill, opts: CatalogBenchOptions, *, log: Callable[[str], None]
) -> dict[str, Any]:
    planned = lookups(fill_)
    legs = {name: Leg(name) for name in LEGS}
    scopes = {i: Scope(identity=i, namespace="bench", alignment=A) for i in fill_.identities}
    rng = random.Random(opts.seed + 2)
    order = [(name, rng.choice(planned[name])) for name in LEGS[:-1] if planned[name]
             for _ in range(opts.samples)]  # fmt: skip
    rng.shuffle(order)
    select_one = text("SELECT 1")
    for _, (ident, chain, _) in order[:200]:  # warm-up: pooled connection, prepared
        vault.find(scopes[ident], chain)
    trips = legs["round trip"].ms  # interleaved with the lookups
    log(f"timing {len(order):,} lookups + {opts.samples:,} round trips ...")
    for i, (name, (ident, chain, expected)) in enumerate(order):
        t = time.perf_counter()
        cut = vault.find(scopes[ident], chain)
        legs[name].ms.append((time.perf_counter() - t) * 1e3)
        if not _as_expected(cut, chain, expected, lists=opts.chunk_lists):
            legs[name].wrong += 1
        if i % max(1, len(order) // opts.samples) == 0 and len(trips) < opts.samples:
            t = time.perf_counter()
            vault.read(lambda s: s.execute(select_one).scalar())
            trips.append((time.perf_counter() - t) * 1e3)
    for name, leg in legs.items():
        if planned.get(name):
            leg.chain_links = int(statistics.median(len(c.links) for _, c, _ in planned[name]))
    explained = explain(vault, planned, opts.explain_samples)
    report = {name: leg.figures() | explained.get(name, {}) for name, leg in legs.items()}
    return {"legs": report}


def _as_expected(cut: Cut | None, chain: TokenChain, depth: int | None, *, lists: bool) -> bool:
    """The cut the fill says must serve; with lists, carrying its chunk list (its
    length, and its first block named by the chain's first link)."""
    if (None if cut is None else cut.depth) != depth:
        return False
    if cut is None or depth is None or not lists:
        return True
    listed = cut.chunks or ()
    first = listed[0][0] if listed else None
    return len(listed) == expected_chunks(depth) and first == chain.links[0][1].hex


class AsRemote:
    """A local store that says it is remote: the vault's `find` then brings the found
    cut's chunk list, as from S3 (the bench reads no object)."""

    remote = True

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def explain(
    vault: Vault, planned: dict[str, list[tuple[IdentityDigest, TokenChain, int | None]]], n: int
) -> dict[str, dict[str, float]]:
    """Per leg: the server's median planning and execution ms (EXPLAIN ANALYZE)."""
    out: dict[str, dict[str, float]] = {}
    found = FIND_DEEPEST_WITH_CHUNKS_POSTGRES if vault.objects.remote else FIND_DEEPEST_POSTGRES
    statement = f"EXPLAIN (ANALYZE, FORMAT JSON) {found}"
    with vault.db.connect() as conn:
        for name, asks in planned.items():
            if not asks:
                continue
            planning, execution = [], []
            for ident, chain, _ in asks[:n]:
                params = find_deepest_parameters(identity=ident, chain=chain, links=chain.links)
                answer = conn.exec_driver_sql(statement, params).scalar()
                plan = json.loads(answer) if isinstance(answer, str) else answer
                assert plan is not None
                planning.append(plan[0]["Planning Time"])
                execution.append(plan[0]["Execution Time"])
            out[name] = {
                "server_planning_ms": round(statistics.median(planning), 4),
                "server_execution_ms": round(statistics.median(execution), 4),
            }
    return out


# -- the database ----------------------------------------------------------------------


def _libpq(url: str) -> str:
    """The URL as psycopg.connect takes it (no SQLAlchemy driver name)."""
    return (
        make_url(normalize_database_url(url))
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )


def _redacted(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


@contextmanager
def fresh_database(
    server_url: str, name: str, *, keep: bool, log: Callable[[str], None]
) -> Iterator[str]:
    """A new database `name` on the server of `server_url` (the URL of it), dropped after."""
    parsed = make_url(normalize_database_url(server_url))
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"bench-catalog needs a PostgreSQL URL, not {_redacted(server_url)}")
    with psycopg.connect(_libpq(server_url), autocommit=True, connect_timeout=10) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = parsed.set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        if keep:
            log(f"kept database {_redacted(url)}")
        else:
            with psycopg.connect(_libpq(server_url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def format_table(receipt: dict[str, Any]) -> str:
    lines = [
        f"find_deepest, PostgreSQL, {receipt['manifests']:,} manifests"
        f"{lists(receipt)} "
        f"(filled in {receipt['fill_seconds']} s); ms from Python (Vault.find"
        f"{', with the chunk list' if receipt['options']['chunk_lists'] else ''}), and the "
        "server's own (EXPLAIN ANALYZE, median)",
        f"{'leg':<14} {'lookups':>8} {'links':>6} {'p50':>8} {'p90':>8} {'p99':>8} "
        f"{'plan':>7} {'exec':>7} {'wrong':>6}",
    ]
    for name, leg in receipt["legs"].items():

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"

        lines.append(
            f"{name:<14} {leg['lookups']:>8} {leg['chain_links']:>6} {f(leg['p50_ms']):>8} "
            f"{f(leg['p90_ms']):>8} {f(leg['p99_ms']):>8} "
            f"{f(leg.get('server_planning_ms')):>7} {f(leg.get('server_execution_ms')):>7} "
            f"{leg['wrong']:>6}"
        )
    lines.append("valid" if receipt["valid"] else "INVALID: a lookup answered the wrong cut")
    return "\n".join(lines)


def lists(receipt: dict[str, Any]) -> str:
    """The chunk rows of a fill with chunk lists, as the table's title says them."""
    if not receipt["manifest_chunk_rows"]:
        return ""
    listed, distinct = receipt["manifest_chunk_rows"], receipt["chunk_rows"]
    return f" listing {listed:,} chunks ({distinct:,} distinct)"


def save(receipt: dict[str, Any], receipts_dir: Path) -> Path:
    return write_receipt(receipts_dir, f"{receipt['run_id']}-catalog", receipt)
