"""kvpack bench-catalog: a small fill on the real PostgreSQL, every leg answered as the fill
says it must be (the validity gate; with --chunk-lists, each found cut's list too), the
receipt, and the database dropped afterwards."""

from __future__ import annotations

import io
import json
import os

import psycopg
import pytest

from kvpack import cli
from kvpack.bench.catalog import (
    LEGS,
    CatalogBenchOptions,
    Fill,
    Rows,
    expected_chunks,
    lookups,
)
from tests.fixtures.db import DEFAULT_PG_URL, DatabaseFactory

SERVER = os.environ.get("KVPACK_TEST_PG_URL", DEFAULT_PG_URL)


def test_lookups_expect_the_cuts_the_fill_published():
    """The plan's expectations follow from the fill: an exact hit names its own turn's
    exact cut, an ancestor hit a published aligned cut, a miss shares no link. Each
    history is one row, however many conversations share it (a system prompt's cut), as
    the catalog's unique idempotency key allows no other."""
    fill = Fill(CatalogBenchOptions(database_url=SERVER, manifests=3000, samples=100))
    published = {}
    while fill.rows < 3000:
        conv = fill.conversation()
        fill.keep(conv)
        for ident, depth, chain, exact in fill.cuts(conv):
            assert (ident, chain) not in published, "one history published as two rows"
            published[(ident, chain)] = (depth, exact)
            fill.rows += 1
    planned = lookups(fill)
    assert all(planned[name] for name in LEGS[:-1])
    for name, asks in planned.items():
        for ident, chain, expected in asks:
            served = [
                published[(ident, c)][0]
                for d, c in chain.links
                if (ident, c) in published
                and (published[(ident, c)][1] if d == chain.depth else d % 256 == 0)
            ]
            assert max(served, default=None) == expected, name


def test_chunk_lists_name_each_block_once_and_share_equal_histories_blocks():
    """Every cut lists its blocks in order, then (exact) its partial block and logits;
    every listed chunk has one chunk row; cuts that share a history name its blocks by
    the same chunks."""
    opts = CatalogBenchOptions(database_url=SERVER, manifests=3000, samples=100, chunk_lists=True)
    fill, rows = Fill(opts), Rows()
    fill.copy_rows(rows, 3000)
    depths = {r.split("\t")[0]: int(r.split("\t")[2]) for r in _lines(rows.manifests)}
    chunk_rows = [r.split("\t")[0] for r in _lines(rows.chunks)]
    assert len(chunk_rows) == len(set(chunk_rows)) == fill.chunk_rows, "a chunk row twice"
    assert len(_lines(rows.manifest_chunks)) == fill.list_rows
    lists: dict[str, list[tuple[int, str, str]]] = {}
    for r in _lines(rows.manifest_chunks):
        mid, ordinal, role, chunk = r.split("\t")
        lists.setdefault(mid, []).append((int(ordinal), role, chunk))
    assert set(lists) == set(depths)
    by_block: dict[str, set[str]] = {}
    for mid, listed in lists.items():
        depth = depths[mid]
        assert [o for o, _, _ in listed] == list(range(expected_chunks(depth)))
        blocks = [role for _, role, _ in listed if role.startswith("block/")]
        assert blocks == [f"block/{i}" for i in range(-(-depth // 256))]
        assert (listed[-1][1] == "logits") == (depth % 256 != 0)
        assert set(chunk for _, _, chunk in listed) <= set(chunk_rows)
        for _, _, chunk in listed:
            by_block.setdefault(chunk, set()).add(mid)
    shared = [mids for mids in by_block.values() if len(mids) > 1]
    assert shared, "no block shared between cuts: equal histories must share chunks"


def _lines(buf: io.StringIO) -> list[str]:
    return [line for line in buf.getvalue().split("\n") if line]


@pytest.mark.postgres
@pytest.mark.parametrize("lists", [False, True], ids=["row", "with chunk lists"])
def test_bench_catalog_fills_times_every_leg_and_drops_its_database(tmp_path, capsys, lists):
    DatabaseFactory("postgres", tmp_path)  # skips (or fails under CI) without PostgreSQL
    before = _databases()
    argv = ["bench-catalog", "--database-url", SERVER, "--manifests", "2000", "--samples", "30",
            "--receipts-dir", str(tmp_path), *(["--chunk-lists"] if lists else [])]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "INVALID" not in out
    (receipt_path,) = tmp_path.glob("*-catalog.json")
    receipt = json.loads(receipt_path.read_text())
    assert receipt["valid"] and receipt["manifests"] >= 2000
    assert set(receipt["legs"]) == set(LEGS)
    for name in LEGS:
        leg = receipt["legs"][name]
        assert leg["lookups"] == 30 and leg["wrong"] == 0 and leg["p50_ms"] > 0
    assert receipt["legs"]["miss"]["server_execution_ms"] > 0
    assert _databases() == before


def _databases() -> set[str]:
    with psycopg.connect(SERVER.replace("+psycopg", ""), autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'kvpack_bench_%'")
        return {r[0] for r in rows}
