"""The resident tier: token radix, identity scopes, chunk pool, LRU byte budget."""

from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest

from kvpack.resident import (
    AlignmentMismatch,
    ChunkPool,
    CutTooLarge,
    ResidentInputError,
    ResidentTier,
)

A = 4  # a small alignment keeps token lists short
BLOCK = 1024
ID_A = bytes(32 * [0xA1])
ID_B = bytes(32 * [0xB2])


def block_payload(prefix: tuple[int, ...]) -> bytes:
    """A block's bytes depend on every token before its end, like real KV does."""
    seed = hash(prefix) & 0xFFFFFFFF
    return random.Random(seed).randbytes(BLOCK)


def parts_for(tokens, *, witnessed=False, tag=b""):
    """One part per (partial) block of `tokens`, plus a logits part when witnessed."""
    tokens = tuple(tokens)
    parts = []
    for end in range(A, len(tokens) + A, A):
        end = min(end, len(tokens))
        parts.append(("kv", tag + block_payload(tokens[:end])))
    if witnessed:
        parts.append(("logits", tag + b"L" + block_payload(tokens)))
    return parts


def put(tier, tokens, *, identity=ID_A, witnessed=False, tag=b"", layout=None):
    return tier.insert(
        identity=identity,
        tokens=tokens,
        alignment=A,
        layout=layout if layout is not None else {"depth": len(tokens)},
        parts=parts_for(tokens, witnessed=witnessed, tag=tag),
        logits_witnessed=witnessed,
    )


def get(tier, tokens, *, identity=ID_A, cap=None):
    return tier.lookup(identity=identity, tokens=tokens, alignment=A, cap_depth=cap)


BASE = list(range(100, 120))  # 20 tokens


# -- radix ------------------------------------------------------------------------


def test_aligned_cut_serves_as_ancestor_of_longer_request():
    """Branch: an aligned cut whose tokens prefix the request is served for a longer one."""
    tier = ResidentTier()
    cut = put(tier, BASE[:8])
    got = get(tier, BASE[:13])
    assert got is cut and got.depth == 8 and got.aligned
    assert got.parts == parts_for(BASE[:8])


def test_non_aligned_cut_is_exact_hit_only():
    """Branch: a non-aligned cut serves only a request equal to it, never a longer one."""
    tier = ResidentTier()
    anc = put(tier, BASE[:4])
    odd = put(tier, BASE[:6], witnessed=True)
    assert not odd.aligned
    assert get(tier, BASE[:6]) is odd
    assert get(tier, BASE[:7]) is anc  # falls back to the aligned ancestor
    assert get(tier, BASE[:5]) is anc


def test_deepest_usable_cut_wins():
    """Branch: of several usable cuts on the request's path, the deepest is served."""
    tier = ResidentTier()
    c4, c8, c12 = (put(tier, BASE[:d]) for d in (4, 8, 12))
    assert get(tier, BASE[:14]) is c12
    assert get(tier, BASE[:11]) is c8
    assert get(tier, BASE[:5]) is c4
    assert get(tier, BASE[:3]) is None


def test_diverging_request_does_not_reach_cuts_past_the_divergence():
    """Branch: a request that differs inside an edge stops the walk before deeper cuts."""
    tier = ResidentTier()
    c4 = put(tier, BASE[:4])
    put(tier, BASE[:12])
    request = BASE[:6] + [9999] + BASE[7:14]
    assert get(tier, request) is c4
    assert get(tier, [1, 2, 3, 4, 5]) is None


def test_cap_depth_bounds_what_is_served():
    """Branch (invariant 2): no cut deeper than the durable cap is served; 0 serves none."""
    tier = ResidentTier()
    c4, c8 = put(tier, BASE[:4]), put(tier, BASE[:8])
    put(tier, BASE[:12])
    odd = put(tier, BASE[:10], witnessed=True)
    assert get(tier, BASE[:14], cap=None).depth == 12
    assert get(tier, BASE[:14], cap=8) is c8
    assert get(tier, BASE[:14], cap=11) is c8
    assert get(tier, BASE[:14], cap=4) is c4
    assert get(tier, BASE[:14], cap=0) is None
    assert get(tier, BASE[:10], cap=9) is c8  # the exact cut is deeper than the cap
    assert get(tier, BASE[:10], cap=10) is odd


def test_identity_swap_rescopes_every_lookup():
    """Branch (invariant 1): the same tokens under two identities reach two different cuts."""
    tier = ResidentTier()
    a = put(tier, BASE[:8], identity=ID_A, tag=b"a")
    b = put(tier, BASE[:8], identity=ID_B, tag=b"b")
    assert get(tier, BASE[:9], identity=ID_A) is a
    assert get(tier, BASE[:9], identity=ID_B) is b
    assert a.parts != b.parts


def test_wrong_identity_is_unreachable():
    """Branch (invariant 1): an identity with no cuts finds nothing, even for exact tokens."""
    tier = ResidentTier()
    put(tier, BASE[:8], identity=ID_A, witnessed=True)
    put(tier, BASE[:6], identity=ID_A, witnessed=True)
    for tokens in (BASE[:8], BASE[:6], BASE[:9]):
        assert get(tier, tokens, identity=ID_B) is None
        assert get(tier, tokens, identity=bytes(32)) is None


def test_exact_hit_needs_witnessed_logits_but_ancestors_do_not():
    """Branch (invariant 3): a full-depth cut without logits is not an exact hit, yet it
    still serves as an aligned ancestor of a longer request."""
    tier = ResidentTier()
    c4 = put(tier, BASE[:4])
    c8 = put(tier, BASE[:8], witnessed=False)
    assert get(tier, BASE[:8]) is c4  # not c8: no logits for the last position
    assert get(tier, BASE[:9]) is c8
    put(tier, BASE[:6], witnessed=False)
    assert get(tier, BASE[:6]) is c4  # a logit-less non-aligned cut is never served
    w8 = put(tier, BASE[:8], witnessed=True)
    assert get(tier, BASE[:8]) is w8


def test_witnessed_cut_is_not_replaced_by_a_logit_less_one():
    """Branch: re-inserting the same tokens without logits keeps the witnessed cut."""
    tier = ResidentTier()
    w = put(tier, BASE[:8], witnessed=True)
    assert put(tier, BASE[:8], witnessed=False) is w
    assert get(tier, BASE[:8]) is w
    assert len(tier) == 1


def test_reinsert_replaces_in_place_and_accounts_once():
    """Branch: re-inserting the same tokens replaces the cut and releases the old bytes."""
    tier = ResidentTier()
    old = put(tier, BASE[:8], tag=b"old")
    put(tier, BASE[:12])
    new = put(tier, BASE[:8], witnessed=True, tag=b"new")
    assert not tier.contains(old) and tier.contains(new)
    assert get(tier, BASE[:8]) is new
    assert len(tier) == 2
    assert tier.resident_bytes == unique_bytes(get(tier, BASE[:13]), new)


def unique_bytes(*cuts):
    blocks = {}
    for cut in cuts:
        blocks.update(cut.unique_blocks)
    return sum(len(b) for b in blocks.values())


def test_alignment_is_fixed_per_identity():
    """Branch: an identity's alignment is part of it; another alignment is an error."""
    tier = ResidentTier()
    put(tier, BASE[:8])
    with pytest.raises(AlignmentMismatch) as e:
        tier.lookup(identity=ID_A, tokens=BASE[:8], alignment=8, cap_depth=None)
    assert (e.value.expected, e.value.got) == (A, 8)
    with pytest.raises(AlignmentMismatch):
        tier.insert(
            identity=ID_A,
            tokens=BASE[:8],
            alignment=8,
            layout={},
            parts=[("kv", b"x")],
            logits_witnessed=False,
        )


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"identity": "abc"}, "identity"),
        ({"identity": b""}, "identity"),
        ({"tokens": []}, "tokens"),
        ({"tokens": [1, 2.5]}, "tokens"),
        ({"tokens": [1, -2]}, "tokens"),
        ({"tokens": "abc"}, "tokens"),
        ({"alignment": 0}, "alignment"),
        ({"layout": [1]}, "layout"),
        ({"parts": []}, "parts"),
        ({"parts": [("kv", "text")]}, "parts"),
        ({"parts": [("", b"x")]}, "parts"),
        ({"parts": [b"x"]}, "parts"),
        ({"logits_witnessed": 1}, "logits_witnessed"),
    ],
)
def test_bad_insert_raises_typed_error_naming_the_argument(change, what):
    """Branch: each malformed insert argument raises ResidentInputError naming it."""
    args = dict(
        identity=ID_A,
        tokens=BASE[:4],
        alignment=A,
        layout={},
        parts=[("kv", b"x")],
        logits_witnessed=False,
    )
    args.update(change)
    with pytest.raises(ResidentInputError) as e:
        ResidentTier().insert(**args)
    assert e.value.what == what


def test_bad_cap_depth_raises():
    """Branch: a negative or non-int cap_depth is refused rather than read as 'no cap'."""
    tier = ResidentTier()
    for cap in (-1, 2.0, True):
        with pytest.raises(ResidentInputError) as e:
            get(tier, BASE[:4], cap=cap)
        assert e.value.what == "cap_depth"


def test_layout_is_copied_and_read_only():
    """Branch: the cut keeps its own layout; the caller mutating theirs changes nothing."""
    tier = ResidentTier()
    layout = {"depth": 8, "planes": [1, 2]}
    cut = put(tier, BASE[:8], layout=layout)
    layout["planes"].append(3)
    assert cut.layout["planes"] == [1, 2]
    with pytest.raises(TypeError):
        cut.layout["depth"] = 9


def test_radix_matches_a_brute_force_model_through_inserts_and_discards():
    """Branch: edge splits on insert and prunes/folds on discard keep every lookup equal to
    a brute-force scan of the live cuts (random branching histories, small alphabet)."""
    rng = random.Random(7)
    tier = ResidentTier()
    live = {}  # tokens -> cut
    for step in range(600):
        if live and rng.random() < 0.35:
            tokens = rng.choice(list(live))
            assert tier.discard(live.pop(tokens))
        else:
            n = rng.randint(1, 14)
            tokens = tuple(rng.choice((1, 2, 3)) for _ in range(n))
            cut = put(tier, tokens, witnessed=rng.random() < 0.5)
            live[tokens] = cut
        for _ in range(4):
            request = tuple(rng.choice((1, 2, 3)) for _ in range(rng.randint(0, 16)))
            cap = rng.choice((None, 0, 4, 8, 12))
            want = None
            for tokens, cut in live.items():
                usable = request[: len(tokens)] == tokens and (
                    (len(tokens) < len(request) and cut.aligned)
                    or (len(tokens) == len(request) and cut.logits_witnessed)
                )
                usable = usable and (cap is None or len(tokens) <= cap)
                if usable and (want is None or len(tokens) > want.depth):
                    want = cut
            assert get(tier, request, cap=cap) is want, (step, request, cap)
    for cut in list(live.values()):
        assert tier.discard(cut)
    assert len(tier) == 0 and tier.identities() == [] and tier.resident_bytes == 0
    assert tier._scopes == {}


# -- chunk pool ---------------------------------------------------------------------


def test_pool_interns_equal_content_once():
    """Branch: interning equal bytes returns the same Block while it is alive."""
    pool = ChunkPool()
    a = pool.intern(b"x" * 100)
    b = pool.intern(bytearray(b"x" * 100))
    c = pool.intern(b"y" * 100)
    assert a is b and a is not c
    assert pool.live_blocks() == 2 and pool.live_bytes() == 200


def test_pool_never_keeps_bytes_alive_on_its_own():
    """Branch: with no strong holder left, a block is collected and leaves the pool."""
    pool = ChunkPool()
    block = pool.intern(b"z" * 100)
    ref = weakref.ref(block)
    del block
    gc.collect()
    assert ref() is None
    assert pool.live_blocks() == 0


def test_shared_blocks_are_one_object_and_counted_once():
    """Branch: two cuts sharing a prefix share block objects; the budget counts them once."""
    tier = ResidentTier()
    short = put(tier, BASE[:8])
    long = put(tier, BASE[:16])
    assert short.blocks[0][1] is long.blocks[0][1]
    assert short.blocks[1][1] is long.blocks[1][1]
    assert tier.resident_bytes == 4 * BLOCK  # blocks 0..3, not 6
    assert tier.estimated_bytes(short) + tier.estimated_bytes(long) == 6 * BLOCK


def test_a_block_repeated_inside_one_cut_counts_once():
    """Branch: equal payloads within one cut (say, two all-zero planes) are one block and
    are accounted once on insert and released exactly on discard."""
    tier = ResidentTier()
    zeros = bytes(BLOCK)
    cut = tier.insert(
        identity=ID_A,
        tokens=BASE[:4],
        alignment=A,
        layout={},
        parts=[("k", zeros), ("v", zeros), ("logits", b"L" * 10)],
        logits_witnessed=True,
    )
    assert cut.blocks[0][1] is cut.blocks[1][1]
    assert tier.resident_bytes == BLOCK + 10
    other = put(tier, BASE[:8])
    assert tier.discard(cut)
    assert tier.resident_bytes == unique_bytes(other)


def test_bytes_freed_when_the_last_cut_holding_them_is_evicted():
    """Branch: a shared block survives the first holder's eviction and is freed (weakref
    dead, gone from the pool) once the last resident holder is evicted."""
    tier = ResidentTier(budget_bytes=1 << 20)
    put(tier, BASE[:8])
    put(tier, BASE[:16])
    first = weakref.ref(get(tier, BASE[:9]).blocks[0][1])
    only_long = weakref.ref(get(tier, BASE[:17]).blocks[3][1])
    gc.collect()
    assert tier.discard(get(tier, BASE[:9]))
    gc.collect()
    assert first() is not None and only_long() is not None
    assert tier.resident_bytes == 4 * BLOCK
    tier.set_budget(0)  # evicts the long cut
    gc.collect()
    assert first() is None and only_long() is None
    assert tier.pool.live_blocks() == 0 and tier.resident_bytes == 0


def test_cut_held_by_a_caller_keeps_its_bytes_after_eviction():
    """Branch: a cut handed out for a restore stays readable after the tier evicts it,
    and its bytes stop being accounted to the tier."""
    tier = ResidentTier()
    cut = put(tier, BASE[:8])
    want = parts_for(BASE[:8])
    tier.clear()
    gc.collect()
    assert not tier.contains(cut) and tier.resident_bytes == 0
    assert cut.parts == want
    assert tier.pool.live_blocks() == 2


def test_payload_is_copied_at_insert():
    """Branch: a caller's mutable buffer changing after insert does not change the cut."""
    tier = ResidentTier()
    buf = bytearray(b"a" * 64)
    cut = tier.insert(
        identity=ID_A,
        tokens=BASE[:4],
        alignment=A,
        layout={},
        parts=[("kv", buf)],
        logits_witnessed=False,
    )
    buf[:] = b"b" * 64
    assert cut.parts == [("kv", b"a" * 64)]


# -- LRU byte budget ------------------------------------------------------------------


def disjoint(k):
    """Token lists with nothing in common, so their blocks are disjoint."""
    return [1000 * (k + 1) + i for i in range(8)]  # two blocks each


def test_lru_evicts_least_recently_used_first():
    """Branch: past the budget the least recently used cut goes; a lookup refreshes it."""
    tier = ResidentTier(budget_bytes=6 * BLOCK)  # three 2-block cuts
    a, b, c = (put(tier, disjoint(k)) for k in range(3))
    assert get(tier, disjoint(0) + [1]) is a  # a is now most recent: b is oldest
    d = put(tier, disjoint(3))
    assert [tier.contains(x) for x in (a, b, c, d)] == [True, False, True, True]
    e = put(tier, disjoint(4))
    assert [tier.contains(x) for x in (a, c, d, e)] == [True, False, True, True]
    assert tier.evictions == 2
    assert tier.resident_bytes == 6 * BLOCK


def test_shared_bytes_let_more_cuts_fit():
    """Branch: the budget counts unique bytes, so cuts sharing blocks fit where copies
    would not (8 blocks of payload in a 4-block budget)."""
    tier = ResidentTier(budget_bytes=4 * BLOCK)
    cuts = [put(tier, BASE[:d]) for d in (4, 8, 12, 16)]
    assert all(tier.contains(c) for c in cuts)
    assert sum(tier.estimated_bytes(c) for c in cuts) == 10 * BLOCK
    assert tier.evictions == 0


def test_cut_larger_than_budget_is_refused():
    """Branch: a cut whose unique bytes exceed the whole budget raises CutTooLarge and
    evicts nothing."""
    tier = ResidentTier(budget_bytes=3 * BLOCK)
    small = put(tier, BASE[:4])
    with pytest.raises(CutTooLarge) as e:
        put(tier, BASE[:16])
    assert (e.value.needed, e.value.budget) == (4 * BLOCK, 3 * BLOCK)
    assert tier.contains(small) and len(tier) == 1


def test_shrinking_the_budget_evicts_oldest_first():
    """Branch: set_budget below the held bytes evicts in LRU order until it fits."""
    tier = ResidentTier()
    a, b, c = (put(tier, disjoint(k)) for k in range(3))
    tier.set_budget(4 * BLOCK)
    assert [tier.contains(x) for x in (a, b, c)] == [False, True, True]
    assert tier.stats()["resident_bytes"] == 4 * BLOCK


def test_default_budget_is_8_gib():
    """Branch: the default budget is 8 GiB."""
    assert ResidentTier().budget_bytes == 8 * 1024**3


def test_concurrent_inserts_and_lookups_keep_accounting_consistent():
    """Branch: the lock serialises writers; after concurrent traffic the accounted bytes
    equal the unique bytes of the cuts actually resident."""
    tier = ResidentTier(budget_bytes=20 * BLOCK)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(150):
                tokens = tuple(rng.choice((5, 6)) for _ in range(rng.randint(1, 12)))
                if rng.random() < 0.5:
                    put(tier, tokens, identity=rng.choice((ID_A, ID_B)))
                else:
                    get(tier, tokens, identity=rng.choice((ID_A, ID_B)))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    resident = list(tier._lru)
    assert tier.resident_bytes == unique_bytes(*resident) <= 20 * BLOCK
