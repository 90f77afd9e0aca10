"""Export and restore on `tiny`: bit-identical continuation (exact and aligned-ancestor),
invariant 3 (no exact hit without witnessed logits), identity refusal before building,
Slot.restore's choice of mode, and injected faults that must leave the slot exactly as it
was (invariant 5)."""

from __future__ import annotations

import pytest

import engine.restore as restore_mod
from engine.codec import rings
from engine.errors import (
    EmptySlot,
    EngineError,
    IdentityMismatch,
    InstallFailed,
    InvalidRequest,
    LogitsMissing,
    PlaneCorrupt,
    RestoreRefused,
    ShapeMismatch,
)
from engine.format import encode
from engine.restore import restore
from engine.state import Planes, Snapshot
from tests.engine.slotkit import (
    PROMPT,
    TINY_A,
    WINDOW,
    cold,
    continue_greedy,
    drop_logits,
    flip,
    physical,
    prompt,
    tiny_pool,
    victim,
)


@pytest.mark.parametrize("decoded", [False, True], ids=["in-memory", "planes"])
@pytest.mark.parametrize("decode_first", [0, 7], ids=["after-prefill", "rotated-ring"])
def test_exact_restore_is_bit_identical(decoded, decode_first):
    """Slot.restore of a cut covering the whole prompt (exact): after a prompt of several
    windows (and, for rotated-ring, a few decoded tokens so the ring buffers are out of
    temporal order), the cut restored into another pool gives the same cache bytes, the
    same next-token logits bytes and the same 32 greedy tokens."""
    src = tiny_pool(1)
    a = cold(src, PROMPT)
    a.generate(max_tokens=decode_first, stop=())
    snap = a.export()
    ring = snap.layout["ring"]["layers"][0]
    assert ring["offset"] > 2 * WINDOW
    if decode_first:
        assert ring["idx"] < ring["size"] == WINDOW  # really rotated: the test needs it
    dst = tiny_pool(2).slot(1)
    dst.prefill(prompt(50, seed=9))  # holds something else first
    dst.restore(encode(snap) if decoded else snap, prompt=a.tokens)
    assert dst.tokens == a.tokens
    assert physical(dst) == physical(a)  # same rotation, same capacity, same bytes
    assert continue_greedy(dst) == continue_greedy(a)


@pytest.mark.parametrize("decoded", [False, True], ids=["in-memory", "planes"])
@pytest.mark.parametrize("cut", [TINY_A, 3 * TINY_A])
def test_aligned_ancestor_then_prefill_is_bit_identical_to_cold(decoded, cut):
    """Slot.restore of a cut shorter than the prompt (ancestor) + aligned prefill: a cut
    taken at k*A during a prefill of a different, longer prompt sharing the prefix,
    restored and prefilled to the end, equals a cold run of the whole prompt bit for bit
    (cache bytes, logits and 32 greedy tokens)."""
    whole = PROMPT
    other = PROMPT[:cut] + prompt(150, seed=5)
    src = tiny_pool(1).slot(0)
    cuts: dict[int, Snapshot] = {}
    src.prefill(other, on_boundary=lambda d: cuts.setdefault(d, src.export()))
    pool = tiny_pool(2)
    b = pool.slot(1)
    b.restore(encode(cuts[cut]) if decoded else cuts[cut], prompt=whole)
    assert b.depth == cut
    b.prefill(whole[cut:])
    c = cold(pool, whole, 0)
    assert physical(b) == physical(c)
    assert continue_greedy(b) == continue_greedy(c)


def test_planes_and_snapshot_restore_the_same_bits_and_return_the_installed_cut():
    """Slot.restore(Snapshot) and Slot.restore(Planes) of one cut leave two slots with the
    same cache bytes and continuation; each returns the Snapshot it installed — the one
    given, or the decoded one, which encodes back to the same bytes."""
    pool = tiny_pool(3)
    a = cold(pool, PROMPT, 0)
    snap = a.export()
    planes = encode(snap)
    assert pool.slot(1).restore(snap, prompt=a.tokens) is snap
    installed = pool.slot(2).restore(planes, prompt=a.tokens)
    assert encode(installed) == planes
    assert physical(pool.slot(1)) == physical(pool.slot(2)) == physical(a)
    assert continue_greedy(pool.slot(1)) == continue_greedy(pool.slot(2))


def test_logitless_cut_refuses_exact_but_serves_as_ancestor():
    """Invariant 3: a cut without witnessed logits offered for its whole prompt raises
    LogitsMissing (the slot untouched); for a longer prompt the same aligned cut restores
    as an ancestor, must prefill before decoding, and then matches a cold run."""
    pool = tiny_pool(3)
    cut = 2 * TINY_A
    planes = encode(drop_logits(cold(pool, PROMPT[:cut], 0).export()))
    assert planes.layout["logits"] is None and not planes.logits_witnessed
    assert [r for r, _ in planes.parts if r == "logits"] == []
    slot = cold(pool, prompt(40, seed=4), 1)
    before = slot.state
    with pytest.raises(LogitsMissing) as e:
        slot.restore(planes, prompt=PROMPT[:cut])
    assert e.value.depth == cut and slot.state is before
    slot.restore(planes, prompt=PROMPT)
    assert not slot.logits_witnessed
    with pytest.raises(LogitsMissing):
        slot.generate(max_tokens=1)
    slot.prefill(PROMPT[cut:])
    assert continue_greedy(slot) == continue_greedy(cold(pool, PROMPT, 2))


def test_unaligned_cut_is_not_an_ancestor():
    """restore mode=ancestor: a cut whose depth is not a multiple of A is exact-hit-only;
    offered for a longer prompt it is refused."""
    pool = tiny_pool(2)
    snap = cold(pool, PROMPT[:100], 0).export()
    with pytest.raises(RestoreRefused, match="not aligned"):
        pool.slot(1).restore(snap, prompt=PROMPT)


def test_cut_deeper_than_the_prompt_is_refused():
    """Slot.restore: a cut deeper than the request cannot be its prefix — ShapeMismatch on
    the depth, before anything is built; the slot is unchanged."""
    v = victim()
    before = v.slot.state
    with pytest.raises(ShapeMismatch) as e:
        v.slot.restore(v.snap, prompt=v.tokens[:-1])
    assert e.value.what.startswith("depth") and e.value.got == v.snap.depth
    v.assert_untouched(before)


def test_other_identity_is_refused_before_anything_is_built(monkeypatch):
    """gate identity: planes made under another identity (another namespace salt) raise
    IdentityMismatch before a shadow is built."""
    foreign = tiny_pool(1, namespace="other-tenant")
    planes = encode(cold(foreign, PROMPT[:128], 0).export())
    pool = tiny_pool(1)
    assert planes.identity == foreign.identity.digest != pool.identity.digest
    built: list[str] = []
    monkeypatch.setattr(restore_mod, "build_shadow", lambda *a: built.append("shadow"))
    slot = pool.slot(0)
    before = slot.state
    with pytest.raises(IdentityMismatch) as e:
        slot.restore(planes, prompt=PROMPT[:128])
    assert (e.value.expected, e.value.got) == (pool.identity.digest, planes.identity)
    assert built == [] and slot.state is before


def test_cut_into_another_slot_both_continue_identically():
    """export -> restore into a different slot of the same pool: both slots continue
    identically, and the cut's arrays are not disturbed by either slot decoding (so it
    restores again into a third slot with the same result)."""
    pool = tiny_pool(3)
    a = cold(pool, PROMPT, 0)
    a.generate(max_tokens=5, stop=())
    snap, history = a.export(), a.tokens
    frozen = [bytes(memoryview(x)) for x in snap.arrays()]
    b = pool.slot(1)
    b.restore(snap, prompt=history)
    first, second = continue_greedy(a, 40), continue_greedy(b, 40)
    assert first == second
    assert [bytes(memoryview(x)) for x in snap.arrays()] == frozen
    c = pool.slot(2)
    c.restore(snap, prompt=history)
    assert continue_greedy(c, 40) == first


def test_export_refuses_an_empty_or_inconsistent_slot():
    """Slot.export: a fresh slot has no cut (EmptySlot naming the slot); a slot whose
    layers disagree on the depth is a bug, never a cut (EngineError)."""
    pool = tiny_pool(2)
    with pytest.raises(EmptySlot) as e:
        pool.slot(1).export()
    assert (e.value.slot, e.value.operation) == (1, "export")
    slot = cold(pool, PROMPT[:70], 0)
    slot.state.cache[1].offset += 1
    with pytest.raises(EngineError, match="depths"):
        slot.export()


def test_module_restore_checks_mode_and_depth():
    """restore(): the mode must be 'exact' or 'ancestor' (InvalidRequest), and the history
    handed in must be exactly the cut's depth (ShapeMismatch); the slot is unchanged."""
    v = victim()
    before = v.slot.state
    with pytest.raises(InvalidRequest) as e:
        restore(v.slot, v.snap, tokens=v.tokens, mode="partial")
    assert e.value.field == "mode"
    with pytest.raises(ShapeMismatch, match="depth"):
        restore(v.slot, v.snap, tokens=v.tokens[:-1], mode="exact")
    v.assert_untouched(before)


# -- faults: each must leave the slot exactly as it was ------------------------------------
@pytest.mark.parametrize("where", ["payload", "header", "digest"])
def test_flipped_byte_in_a_plane_is_refused(where):
    """Slot.restore(Planes): one flipped bit anywhere in a part (float payload, JSON header,
    stored digest) raises PlaneCorrupt naming the part; nothing reaches the slot."""
    v = victim()
    planes = encode(v.snap)
    parts = list(planes.parts)
    role, data = parts[1]
    hlen = int.from_bytes(data[6:10], "little")
    at = {"payload": len(data) - 100, "header": 12, "digest": 10 + hlen + 3}[where]
    parts[1] = (role, flip(data, at))
    before = v.slot.state
    with pytest.raises(PlaneCorrupt) as e:
        v.slot.restore(Planes(planes.layout, tuple(parts)), prompt=v.tokens)
    assert e.value.role == role
    v.assert_untouched(before)


def test_exception_half_way_through_install_leaves_slot_unchanged(monkeypatch):
    """build_shadow failure: an exception raised once some layers are already installed
    (in the shadow: every full layer and the rings) surfaces as InstallFailed; the slot
    keeps its old state and output, and a later clean restore of the same cut still
    works."""
    v = victim()
    real = rings.install
    seen: list[list[int]] = []

    def failing(pool, snap, parts, shadow):
        real(pool, snap, parts, shadow)
        seen.append([c.offset for c in shadow.cache])
        raise RuntimeError("injected install failure")

    monkeypatch.setattr(rings, "install", failing)
    before = v.slot.state
    with pytest.raises(InstallFailed) as e:
        v.slot.restore(v.snap, prompt=v.tokens)
    assert seen == [[v.snap.depth] * 4] and isinstance(e.value.cause, RuntimeError)
    v.assert_untouched(before)
    monkeypatch.setattr(rings, "install", real)
    v.slot.restore(v.snap, prompt=v.tokens)
    reference = v.pool.slot(2)
    reference.restore(v.snap, prompt=v.tokens)
    assert continue_greedy(v.slot) == continue_greedy(reference)
