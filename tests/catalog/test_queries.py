"""find_deepest and friends, on SQLite and PostgreSQL (savepoint per test)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event, update

from catalog import queries
from catalog.chain import token_chain
from catalog.ids import ManifestId
from catalog.models import ChunkRow, ManifestRow
from tests.catalog.helpers import A, add_cut, identity, tokens

ALICE = identity("alice")
BOB = identity("bob")


def deepest(session, ident, history, **kw):
    return queries.find_deepest(
        session=session, identity=ident, chain=token_chain(history, alignment=A), **kw
    )


def test_aligned_ancestors_serve_a_longer_prompt(db_session):
    """Branch: no exact cut -> the deepest aligned ancestor (not exact)."""
    h = tokens(1, 900)
    add_cut(db_session, ident=ALICE, history=h, depth=256)
    mid512 = add_cut(db_session, ident=ALICE, history=h, depth=512)
    cut = deepest(db_session, ALICE, h[:700])
    assert cut is not None
    assert (cut.manifest_id, cut.depth, cut.aligned) == (mid512, 512, True)


def test_deepest_sealed_cut_wins_including_the_exact_one(db_session):
    """Branch: an exact non-aligned cut deeper than every ancestor wins, with its facts."""
    h = tokens(2, 900)
    for depth in (256, 512):
        add_cut(db_session, ident=ALICE, history=h, depth=depth)
    exact = add_cut(db_session, ident=ALICE, history=h, depth=700, logits=True, nbytes=7)
    cut = deepest(db_session, ALICE, h[:700])
    assert cut.manifest_id == exact and cut.depth == 700 and not cut.aligned
    assert cut.logits_witnessed and cut.bytes == 7 and cut.identity == ALICE


def test_non_aligned_cuts_match_only_exactly(db_session):
    """Branch: a non-aligned cut is no ancestor: a longer prompt falls back to aligned ones."""
    h = tokens(3, 900)
    add_cut(db_session, ident=ALICE, history=h, depth=256)
    add_cut(db_session, ident=ALICE, history=h, depth=300)
    assert deepest(db_session, ALICE, h[:300]).depth == 300
    assert deepest(db_session, ALICE, h[:301]).depth == 256
    assert deepest(db_session, ALICE, h[:600]).depth == 256


def test_only_a_non_aligned_cut_and_a_longer_prompt_is_a_miss(db_session):
    """Branch: nothing aligned below the prompt -> None, even though a prefix was published."""
    h = tokens(4, 400)
    add_cut(db_session, ident=ALICE, history=h, depth=200)
    assert deepest(db_session, ALICE, h[:200]).depth == 200
    assert deepest(db_session, ALICE, h[:400]) is None


def test_another_identity_is_unreachable(db_session):
    """Invariant 1: the same tokens under another identity find nothing."""
    h = tokens(5, 600)
    add_cut(db_session, ident=ALICE, history=h, depth=512)
    assert deepest(db_session, ALICE, h) is not None
    assert deepest(db_session, BOB, h) is None


def test_a_diverging_prompt_stops_at_the_last_shared_boundary(db_session):
    """Chains differ after the first changed token: only earlier ancestors match."""
    h = tokens(6, 800)
    for depth in (256, 512, 768):
        add_cut(db_session, ident=ALICE, history=h, depth=depth)
    other = list(h)
    other[400] += 1
    assert deepest(db_session, ALICE, other).depth == 256
    assert deepest(db_session, ALICE, h).depth == 768


def test_an_exact_cut_without_logits_serves_only_as_an_ancestor(db_session):
    """Invariant 3, in the query itself: a full-depth cut without witnessed logits is not
    offered for that prompt (the aligned ancestor below it is, in the same one query),
    yet it still serves as the ancestor of a longer prompt."""
    h = tokens(7, 600)
    add_cut(db_session, ident=ALICE, history=h, depth=256)
    add_cut(db_session, ident=ALICE, history=h, depth=512, logits=False)
    assert deepest(db_session, ALICE, h[:512]).depth == 256
    assert deepest(db_session, ALICE, h[:600]).depth == 512


def test_depth_bounds_cap_the_answer(db_session):
    """Branch: at_most excludes deeper links, deeper_than shallower ones (both ends open
    as documented: depth in (deeper_than, at_most])."""
    h = tokens(11, 600)
    for depth in (256, 512):
        add_cut(db_session, ident=ALICE, history=h, depth=depth)
    assert deepest(db_session, ALICE, h).depth == 512
    assert deepest(db_session, ALICE, h, at_most=511).depth == 256
    assert deepest(db_session, ALICE, h, at_most=100) is None
    assert deepest(db_session, ALICE, h, deeper_than=256).depth == 512
    assert deepest(db_session, ALICE, h, deeper_than=512) is None


def test_empty_prompt_finds_nothing(db_session):
    """Branch: no links -> None without a query."""
    assert deepest(db_session, ALICE, []) is None


def test_touch_cut_sets_last_hit_at(db_session):
    """touch_cut stamps the row; an unknown id reports False."""
    h = tokens(8, 300)
    mid = add_cut(db_session, ident=ALICE, history=h, depth=256)
    at = datetime(2030, 5, 6, 7, 8, 9, tzinfo=UTC)
    assert queries.touch_cut(session=db_session, manifest_id=mid, at=at)
    db_session.expire_all()
    assert db_session.get(ManifestRow, mid.hex).last_hit_at == at
    assert not queries.touch_cut(session=db_session, manifest_id=ManifestId(bytes(16)))


def test_least_recently_hit_orders_never_hit_by_creation(db_session):
    """GC order: coalesce(last hit, created): oldest use first."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    h = tokens(9, 1100)
    m1 = add_cut(db_session, ident=ALICE, history=h, depth=256, at=t0)
    m2 = add_cut(db_session, ident=ALICE, history=h, depth=512, at=t0 + timedelta(seconds=1))
    m3 = add_cut(db_session, ident=ALICE, history=h, depth=768, at=t0 + timedelta(seconds=2))
    queries.touch_cut(session=db_session, manifest_id=m1, at=t0 + timedelta(seconds=5))
    order = [mid for mid, _ in queries.least_recently_hit(session=db_session, limit=10)]
    assert order.index(m2) < order.index(m3) < order.index(m1)


def test_find_deepest_brings_the_found_cuts_chunk_list_when_asked(db_session):
    """with_chunks: the cut found carries its own chunk list, in part order (not id
    order), and not a shallower candidate's; in one statement on PostgreSQL. Without it
    the cut carries none."""
    h = tokens(12, 700)
    add_cut(db_session, ident=ALICE, history=h, depth=256, chunks=[("aa" * 32, 5)])
    listed = [("ff" * 32, 11), ("0b" * 32, 7), ("aa" * 32, 5)]
    add_cut(db_session, ident=ALICE, history=h, depth=512, chunks=listed)
    conn = db_session.connection()
    with statements(conn) as seen:
        cut = deepest(db_session, ALICE, h[:600], with_chunks=True)
    assert cut.depth == 512 and cut.chunks == tuple(listed)
    assert len(seen) == (1 if conn.dialect.name == "postgresql" else 2)
    assert deepest(db_session, ALICE, h[:600]).chunks is None
    assert deepest(db_session, ALICE, h[:300], with_chunks=True).chunks == (("aa" * 32, 5),)
    assert deepest(db_session, BOB, h[:600], with_chunks=True) is None


def test_find_deepest_is_one_query_served_by_the_identity_chain_index(db_session):
    """find_deepest issues exactly one statement, planned on ix_manifests_identity_chain
    (PostgreSQL: with sequential scans disabled, as the tiny test table would prefer them)."""
    h = tokens(10, 600)
    add_cut(db_session, ident=ALICE, history=h, depth=512)
    conn = db_session.connection()
    with statements(conn) as seen:
        assert deepest(db_session, ALICE, h).depth == 512
    assert len(seen) == 1
    assert "ix_manifests_identity_chain" in plan_of(conn, *seen[0])


@contextmanager
def statements(conn) -> Iterator[list[tuple[str, Any]]]:
    """Every (statement, parameters) the connection executes meanwhile."""
    seen: list[tuple[str, Any]] = []

    def capture(_conn, _cursor, statement, parameters, _context, _many):
        seen.append((statement, parameters))

    event.listen(conn, "before_cursor_execute", capture)
    try:
        yield seen
    finally:
        event.remove(conn, "before_cursor_execute", capture)


def plan_of(conn, statement, parameters) -> str:
    """The database's plan for a captured statement (PostgreSQL: with sequential scans
    disabled, as the tiny test tables would prefer them)."""
    if conn.dialect.name == "sqlite":
        plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters).all()
    else:
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        plan = conn.exec_driver_sql(f"EXPLAIN {statement}", parameters).all()
    return " ".join(str(r) for r in plan)


def test_recent_cuts_and_each_batch_of_recent_chunks_walk_the_last_use_index(db_session):
    """A restart's warm start reads the most recent cuts in ix_manifests_last_use's order
    instead of sorting every manifest: recent_cuts, and recent_chunks' first batch and
    the batches that go on from where one ended."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    h = tokens(16, 600)
    for i, depth in enumerate((256, 512)):
        add_cut(db_session, ident=ALICE, history=h, depth=depth,
                at=t0 + timedelta(seconds=i), chunks=[(f"{depth:064x}", 1)])  # fmt: skip
    conn = db_session.connection()
    with statements(conn) as seen:
        assert len(queries.recent_cuts(session=db_session, limit=5)) == 2
        assert len(queries.recent_chunks(session=db_session, budget=10, batch=1)) == 2
    ordered = [(s, p) for s, p in seen if "FROM manifests" in s and "ORDER BY coalesce" in s]
    assert len(ordered) == 4  # recent_cuts; three batches, the last one empty
    for statement, parameters in ordered:
        plan = plan_of(conn, statement, parameters)
        assert "ix_manifests_last_use" in plan and "TEMP B-TREE" not in plan, plan
        assert "Sort" not in plan, plan


def test_recent_chunks_go_on_from_where_each_batch_ended(db_session):
    """Cuts that tie on their last use (published at one instant), read two at a time:
    every cut's chunk once, the cuts by id from the highest, none skipped or repeated."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    h = tokens(17, 2600)
    chunk_of = {}
    for depth in range(256, 2561, 256):
        chunk = (f"{depth:064x}", 1)
        chunk_of[add_cut(db_session, ident=ALICE, history=h, depth=depth, at=t0,
                         chunks=[chunk]).hex] = chunk  # fmt: skip
    got = queries.recent_chunks(session=db_session, budget=100, batch=2)
    assert got == [chunk_of[cut] for cut in sorted(chunk_of, reverse=True)]
    # A warm start's time ran out: no batch is started after it.
    past = time.monotonic()
    assert queries.recent_chunks(session=db_session, budget=100, batch=2, until=past) == []


def test_recent_chunks_take_the_most_recently_used_cuts_first_within_the_budget(db_session):
    """What a restart preloads: cuts by last use (a hit, else creation), newest first and
    each in part order; a chunk two cuts share counted once; a condemned chunk left out;
    stopped before the chunk that would pass the budget."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    h = tokens(13, 1100)
    a, b, c, d = ("aa" * 32, 10), ("bb" * 32, 20), ("cc" * 32, 30), ("dd" * 32, 40)
    gone = ("ee" * 32, 5)
    old = add_cut(db_session, ident=ALICE, history=h, depth=256, at=t0, chunks=[a, d])
    add_cut(db_session, ident=ALICE, history=h, depth=512, at=t0 + timedelta(seconds=1),
            chunks=[a, gone, c])  # fmt: skip
    add_cut(db_session, ident=BOB, history=h, depth=256, at=t0 + timedelta(seconds=2),
            chunks=[b])  # fmt: skip
    queries.touch_cut(session=db_session, manifest_id=old, at=t0 + timedelta(seconds=5))
    db_session.execute(update(ChunkRow).where(ChunkRow.id == gone[0])
                       .values(condemned_at=t0, condemned_by="test"))  # fmt: skip

    def recent(budget):
        return queries.recent_chunks(session=db_session, budget=budget, batch=2)

    assert recent(1000) == [a, d, b, c]  # the hit cut, then by creation; `a` once
    assert recent(99) == [a, d, b]  # c would make 100
    assert recent(100) == [a, d, b, c]
    assert recent(9) == [] and recent(0) == []


def test_recent_cuts_are_the_most_recently_used_first_up_to_the_limit(db_session):
    """Whose manifests a restart opens ahead: cuts by last use (a hit, else creation),
    newest first, every identity's, at most `limit`, each with its row's facts."""
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    h = tokens(14, 1100)
    old = add_cut(db_session, ident=ALICE, history=h, depth=256, at=t0)
    mid = add_cut(db_session, ident=ALICE, history=h, depth=512, at=t0 + timedelta(seconds=1))
    new = add_cut(db_session, ident=BOB, history=h, depth=256, at=t0 + timedelta(seconds=2))
    queries.touch_cut(session=db_session, manifest_id=old, at=t0 + timedelta(seconds=5))

    def recent(limit):
        return [c.manifest_id for c in queries.recent_cuts(session=db_session, limit=limit)]

    assert recent(10) == [old, new, mid]
    assert recent(2) == [old, new] and recent(0) == []
    [first] = queries.recent_cuts(session=db_session, limit=1)
    assert first == queries.get_cut(session=db_session, manifest_id=old)
