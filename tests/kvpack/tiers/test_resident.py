"""The resident tier: token radix, scopes, part pool, LRU byte budget.

Cuts here are synthetic Snapshots (a minimal layout, one uint8 array of random bytes per
part, each with its part digest): holding one with digests neither decodes nor encodes,
so no model is needed. tests/kvpack/tiers/test_resident_form.py holds real cuts."""

from __future__ import annotations

import gc
import random
import threading
import weakref

import blake3
import mlx.core as mx
import numpy as np
import pytest

from catalog.ids import IdentityDigest
from catalog.scope import Scope
from engine.state import Part, Snapshot
from kvpack.tiers import resident
from kvpack.tiers.base import Ask
from kvpack.tiers.radix import PartPool
from kvpack.tiers.resident import ResidentInputError, ResidentTier

A = 4  # a small alignment keeps token lists short
BLOCK = 1024
ID_A = Scope(IdentityDigest(bytes(32 * [0xA1])), "a", A)
ID_B = Scope(IdentityDigest(bytes(32 * [0xB2])), "b", A)


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


def part(role: str, payload: bytes) -> Part:
    """A part of `payload` bytes, named (as a frame would name it) by their digest."""
    array = mx.array(np.frombuffer(payload, dtype=np.uint8))
    return Part(role, (array,), {}, digest=blake3.blake3(payload).digest())


def snapshot(scope, tokens, parts, *, witnessed=False, **extra) -> Snapshot:
    layout = {
        "format": 1,
        "identity": scope.identity.hex,
        "depth": len(tokens),
        "alignment": scope.alignment,
        "logits": {"role": "logits", "vocab": 1} if witnessed else None,
        **extra,
    }
    held = tuple(part(role, data) for role, data in parts)
    return Snapshot(scope.identity.raw, len(tokens), scope.alignment, layout, held)


def put(tier, tokens, *, identity=ID_A, witnessed=False, tag=b"", **extra):
    parts = parts_for(tokens, witnessed=witnessed, tag=tag)
    return tier.hold(
        identity, tokens, snapshot(identity, tokens, parts, witnessed=witnessed, **extra)
    )


def get(tier, tokens, *, identity=ID_A, cap=None):
    ask = Ask.of(identity, tokens)
    found = tier.find(ask if cap is None else ask.bounded(at_most=cap))
    return None if found is None else found.handle


def parts_of(cut):
    return [(role, bytes(memoryview(p.part.arrays[0]))) for role, p in cut.parts]


BASE = list(range(100, 120))  # 20 tokens


# -- radix ------------------------------------------------------------------------


def test_aligned_cut_serves_as_ancestor_of_longer_request():
    """Branch: an aligned cut whose tokens prefix the request is served for a longer one."""
    tier = ResidentTier()
    cut = put(tier, BASE[:8])
    got = get(tier, BASE[:13])
    assert got is cut and got.depth == 8 and got.aligned
    assert parts_of(got) == parts_for(BASE[:8])


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
        assert get(tier, tokens, identity=Scope(IdentityDigest(bytes(32)), "a", A)) is None


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
    parts = {}
    for cut in cuts:
        parts.update(cut.unique_parts)
    return sum(len(p) for p in parts.values())


def test_another_alignment_is_another_scope():
    """Branch: the alignment is part of the scope: the same identity and tokens under
    another alignment reach nothing held under the first."""
    tier = ResidentTier()
    put(tier, BASE[:8])
    other = Scope(ID_A.identity, ID_A.namespace, 8)
    assert get(tier, BASE[:9]) is not None and get(tier, BASE[:9], identity=other) is None


@pytest.mark.parametrize(
    "tokens", [[], [1, 2.5], [1, -2], "abc", BASE[:3]], ids=["empty", "float", "neg", "str", "3"]
)
def test_bad_tokens_raise_a_typed_error_naming_them(tokens):
    """Branch: tokens that are not a non-empty list of ids, or not the cut's depth (4),
    raise ResidentInputError naming them; nothing is held."""
    tier = ResidentTier()
    with pytest.raises(ResidentInputError) as e:
        tier.hold(ID_A, tokens, snapshot(ID_A, BASE[:4], [("kv", b"x")]))
    assert e.value.what == "tokens" and len(tier) == 0


def test_layout_is_copied_and_read_only():
    """Branch: the cut keeps its own layout; the caller mutating theirs changes nothing."""
    tier = ResidentTier()
    given = snapshot(ID_A, BASE[:8], parts_for(BASE[:8]), extra=[1, 2])
    cut = tier.hold(ID_A, BASE[:8], given)
    given.layout["extra"].append(3)
    assert cut.layout["extra"] == [1, 2]
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
    assert len(tier) == 0 and tier.scopes() == [] and tier.resident_bytes == 0
    assert tier._radixes == {}


# -- part pool ----------------------------------------------------------------------


def test_pool_interns_a_digest_once_and_builds_it_once():
    """Branch: interning a digest returns the same part while it is alive, and builds it
    (decodes or copies, in the tier) only the first time."""
    pool = PartPool()
    built = []

    def make(payload):
        built.append(payload)
        return part("kv", payload)

    a = pool.intern(b"1", lambda: make(b"x" * 100))
    b = pool.intern(b"1", lambda: make(b"x" * 100))
    c = pool.intern(b"2", lambda: make(b"y" * 100))
    assert a is b and a is not c and built == [b"x" * 100, b"y" * 100]
    assert pool.live_parts() == 2 and pool.live_bytes() == 200


def test_pool_never_keeps_parts_alive_on_its_own():
    """Branch: with no strong holder left, a part is collected and leaves the pool."""
    pool = PartPool()
    held = pool.intern(b"z", lambda: part("kv", b"z" * 100))
    ref = weakref.ref(held)
    del held
    gc.collect()
    assert ref() is None
    assert pool.live_parts() == 0


def test_shared_parts_are_one_object_and_counted_once():
    """Branch: two cuts sharing a prefix share part objects; the budget counts them once."""
    tier = ResidentTier()
    short = put(tier, BASE[:8])
    long = put(tier, BASE[:16])
    assert short.parts[0][1] is long.parts[0][1]
    assert short.parts[1][1] is long.parts[1][1]
    assert tier.resident_bytes == 4 * BLOCK  # blocks 0..3, not 6
    assert short.estimated_bytes + long.estimated_bytes == 6 * BLOCK


def test_a_part_repeated_inside_one_cut_counts_once():
    """Branch: equal payloads within one cut (say, two all-zero planes) are one part and
    are accounted once on hold and released exactly on discard."""
    tier = ResidentTier()
    zeros = bytes(BLOCK)
    parts = [("k", zeros), ("v", zeros), ("logits", b"L" * 10)]
    cut = tier.hold(ID_A, BASE[:4], snapshot(ID_A, BASE[:4], parts, witnessed=True))
    assert cut.parts[0][1] is cut.parts[1][1]
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
    first = weakref.ref(get(tier, BASE[:9]).parts[0][1])
    only_long = weakref.ref(get(tier, BASE[:17]).parts[3][1])
    gc.collect()
    assert tier.discard(get(tier, BASE[:9]))
    gc.collect()
    assert first() is not None and only_long() is not None
    assert tier.resident_bytes == 4 * BLOCK
    tier.set_budget(0)  # evicts the long cut
    gc.collect()
    assert first() is None and only_long() is None
    assert tier.pool.live_parts() == 0 and tier.resident_bytes == 0


def test_cut_held_by_a_caller_keeps_its_bytes_after_eviction():
    """Branch: a cut handed out for a restore stays readable after the tier evicts it,
    and its bytes stop being accounted to the tier."""
    tier = ResidentTier()
    cut = put(tier, BASE[:8])
    want = parts_for(BASE[:8])
    tier.clear()
    gc.collect()
    assert not tier.contains(cut) and tier.resident_bytes == 0
    assert parts_of(cut) == want
    assert tier.pool.live_parts() == 2


def viewed_part(views, payload):
    """One part over `views`, whose bytes laid end to end are `payload`."""
    return Part("kv", tuple(views), {}, digest=blake3.blake3(payload).digest())


def hold_part(tier, part):
    """`part` held as the whole cut of BASE[:4]."""
    layout = snapshot(ID_A, BASE[:4], []).layout
    return tier.hold(ID_A, BASE[:4], Snapshot(ID_A.identity.raw, 4, A, layout, (part,)))


def test_a_view_of_a_larger_buffer_is_held_as_its_own_bytes():
    """Branch: a part whose array is a view of a larger buffer (an intake's block is a
    slice of the whole KV capacity) is copied into a buffer of its own at hold, so the
    tier keeps and counts exactly its bytes, not the buffer behind it."""
    tier = ResidentTier()
    big = mx.array(np.frombuffer(random.Random(3).randbytes(4 * BLOCK), dtype=np.uint8))
    view = big[BLOCK : 2 * BLOCK]
    mx.eval(view)
    payload = bytes(memoryview(view))
    cut = hold_part(tier, viewed_part((view,), payload))
    (held,) = cut.snapshot.parts[0].arrays
    assert bytes(memoryview(held)) == payload
    assert np.asarray(held).ctypes.data != np.asarray(view).ctypes.data
    assert tier.resident_bytes == BLOCK


def test_a_view_whose_buffer_has_no_other_owner_is_held_as_its_own_bytes():
    """Branch: the slot let go of the buffer behind a part's view before the hold (a
    request replaced its state): the tier still keeps only the view's bytes, so once the
    given part is let go the buffer behind it is freed."""
    tier = ResidentTier()
    size = 1024 * BLOCK  # 1 MiB: other threads' allocations stay well inside the margin
    big = mx.array(np.frombuffer(random.Random(4).randbytes(16 * size), dtype=np.uint8))
    view = big[size : 2 * size]
    mx.eval(view)
    payload = bytes(memoryview(view))
    viewed = viewed_part((view,), payload)
    del big, view
    gc.collect()
    before = mx.get_active_memory()  # the view's buffer: 16 * size
    cut = hold_part(tier, viewed)
    del viewed
    gc.collect()
    (held,) = cut.snapshot.parts[0].arrays
    assert bytes(memoryview(held)) == payload
    assert mx.get_active_memory() - before <= -12 * size  # 15 of the 16 went: not held


def test_a_snapshot_over_the_budget_is_let_go_before_any_copy(monkeypatch):
    """Branch: a Snapshot whose parts carry their digest (a durable hit's) and exceed the
    whole budget is refused before its arrays are copied; one that fits is copied once."""
    copied, detached = [], resident._detached

    def counted(part):
        copied.append(part.role)
        return detached(part)

    monkeypatch.setattr(resident, "_detached", counted)
    big = mx.array(np.frombuffer(random.Random(6).randbytes(4 * BLOCK), dtype=np.uint8))
    view = big[BLOCK : 2 * BLOCK]
    mx.eval(view)
    viewed = viewed_part((view,), bytes(memoryview(view)))
    assert hold_part(ResidentTier(budget_bytes=BLOCK - 1), viewed) is None
    assert copied == []
    assert hold_part(ResidentTier(budget_bytes=BLOCK), viewed) is not None
    assert copied == ["kv"]


def test_a_strided_view_is_held_as_its_own_bytes():
    """Branch: a block's arrays are strided views (its rows of each head inside a layer's
    buffer at the full capacity); each is copied out at hold, and once the given part is
    let go the buffer behind it is freed."""
    tier = ResidentTier()
    rows = 1024  # 3 heads x 1024 rows x 64 float32: 768 KiB per layer buffer, 16 of them
    data = np.frombuffer(random.Random(5).randbytes(3 * 4 * rows * 64 * 4), dtype=np.float32)
    buffers = [mx.array(data.reshape(1, 3, 4 * rows, 64)) for _ in range(16)]
    views = [b[0, :, rows : 2 * rows, :] for b in buffers]  # a quarter of each, strided
    mx.eval(views)
    payload = b"".join(np.asarray(v).tobytes() for v in views)
    viewed = viewed_part(views, payload)
    del buffers, views
    gc.collect()
    before = mx.get_active_memory()
    cut = hold_part(tier, viewed)
    del viewed
    gc.collect()
    held = cut.snapshot.parts[0].arrays
    assert b"".join(np.asarray(h).tobytes() for h in held) == payload
    whole = 16 * 3 * 4 * rows * 64 * 4
    assert mx.get_active_memory() - before <= -whole // 2  # three quarters went


# -- LRU byte budget ------------------------------------------------------------------


def disjoint(k):
    """Token lists with nothing in common, so their blocks are disjoint."""
    return [1000 * (k + 1) + i for i in range(8)]  # two blocks each


def test_lru_evicts_least_recently_used_first():
    """Branch: past the budget the least recently used cut goes; a served hit refreshes
    it (finding alone does not: find has no side effects)."""
    tier = ResidentTier(budget_bytes=6 * BLOCK)  # three 2-block cuts
    a, b, c = (put(tier, disjoint(k)) for k in range(3))
    ask = Ask.of(ID_A, disjoint(1) + [1])
    assert tier.find(ask).handle is b  # found, not served: b stays the oldest but one
    ask = Ask.of(ID_A, disjoint(0) + [1])
    found = tier.find(ask)
    assert found.handle is a
    tier.served(found, ask)  # a is now most recent: b is oldest
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
    assert sum(c.estimated_bytes for c in cuts) == 10 * BLOCK
    assert tier.evictions == 0


def test_cut_larger_than_budget_is_let_go():
    """Branch: a cut whose unique bytes exceed the whole budget is not held (None) and
    evicts nothing."""
    tier = ResidentTier(budget_bytes=3 * BLOCK)
    small = put(tier, BASE[:4])
    assert put(tier, BASE[:16]) is None
    assert tier.contains(small) and len(tier) == 1 and tier.evictions == 0


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
