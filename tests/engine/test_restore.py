"""Snapshot and restore on `tiny`: bit-identical continuation (exact and aligned-ancestor),
invariant 3 (no exact hit without witnessed logits), identity refusal before building,
and injected faults that must leave the slot exactly as it was (invariant 5)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

import engine.restore as restore_mod
from engine import planes
from engine.errors import (
    IdentityMismatch,
    InstallFailed,
    LogitsMissing,
    PlaneCorrupt,
    PlanesInvalid,
    RestoreRefused,
    ShapeMismatch,
)
from engine.restore import restore
from engine.snapshot import Snapshot, snapshot
from tests.engine.slotkit import (
    TINY_A,
    WINDOW,
    cold,
    continue_greedy,
    physical,
    prompt,
    tiny_engine,
)

PROMPT = prompt(300)  # more than nine windows: every ring has wrapped


def roundtrip(snap: Snapshot) -> Snapshot:
    layout, parts = planes.encode(snap)
    return planes.decode(layout, parts)


@pytest.mark.parametrize("decoded", [False, True], ids=["in-memory", "planes"])
@pytest.mark.parametrize("decode_first", [0, 7], ids=["after-prefill", "rotated-ring"])
def test_exact_restore_is_bit_identical(decoded, decode_first):
    """restore mode=exact: after a prompt of several windows (and, for rotated-ring, a few
    decoded tokens so the ring buffers are out of temporal order), a snapshot restored into
    another engine gives the same next-token logits bytes and the same 32 greedy tokens."""
    src = tiny_engine(1)
    a = cold(src, PROMPT)
    a.generate(max_tokens=decode_first, stop=())
    snap = snapshot(a)
    ring = snap.rings[0]
    assert ring.offset > 2 * WINDOW
    if decode_first:
        assert ring.idx < ring.size == WINDOW  # really rotated: the test needs it
    if decoded:
        snap = roundtrip(snap)
    dst = tiny_engine(2).slot(1)
    dst.prefill(prompt(50, seed=9))  # holds something else first
    restore(dst, snap, tokens=a.tokens, mode="exact")
    assert dst.tokens == a.tokens
    assert physical(dst) == physical(a)  # same rotation, same capacity, same bytes
    assert continue_greedy(dst) == continue_greedy(a)


@pytest.mark.parametrize("decoded", [False, True], ids=["in-memory", "planes"])
@pytest.mark.parametrize("cut", [TINY_A, 3 * TINY_A])
def test_aligned_ancestor_then_prefill_is_bit_identical_to_cold(decoded, cut):
    """restore mode=ancestor + aligned prefill: a cut taken at k*A during a prefill of a
    different, longer prompt sharing the prefix, restored and prefilled to the end, equals a
    cold run of the whole prompt bit for bit (logits and 32 greedy tokens)."""
    whole = PROMPT
    other = PROMPT[:cut] + prompt(150, seed=5)
    src = tiny_engine(1)
    cuts: dict[int, Snapshot] = {}
    src.slot(0).prefill(other, on_boundary=lambda d: cuts.setdefault(d, snapshot(src.slot(0))))
    snap = roundtrip(cuts[cut]) if decoded else cuts[cut]
    engine = tiny_engine(2)
    b = engine.slot(1)
    restore(b, snap, tokens=whole[:cut], mode="ancestor")
    b.prefill(whole[cut:])
    c = cold(engine, whole, 0)
    assert physical(b) == physical(c)
    assert continue_greedy(b) == continue_greedy(c)


def test_logitless_cut_refuses_exact_but_serves_as_ancestor():
    """Invariant 3: a full-depth restore of a cut without witnessed logits raises
    LogitsMissing (the slot untouched); the same aligned cut restores as an ancestor, must
    prefill before decoding, and then matches a cold run."""
    engine = tiny_engine(3)
    cut = 2 * TINY_A
    full = snapshot(cold(engine, PROMPT[:cut], 0))
    bare = dataclasses.replace(full, logits=None)
    layout, parts = planes.encode(bare)
    assert layout["logits"] is None and [r for r, _ in parts if r == "logits"] == []
    bare = planes.decode(layout, parts)
    victim = cold(engine, prompt(40, seed=4), 1)
    before = victim.state
    with pytest.raises(LogitsMissing) as e:
        restore(victim, bare, tokens=PROMPT[:cut], mode="exact")
    assert e.value.depth == cut and victim.state is before
    restore(victim, bare, tokens=PROMPT[:cut], mode="ancestor")
    assert not victim.logits_witnessed
    with pytest.raises(LogitsMissing):
        victim.generate(max_tokens=1)
    victim.prefill(PROMPT[cut:])
    assert continue_greedy(victim) == continue_greedy(cold(engine, PROMPT, 2))


def test_unaligned_cut_is_not_an_ancestor():
    """restore mode=ancestor: a cut whose depth is not a multiple of A is exact-hit-only."""
    engine = tiny_engine(2)
    snap = snapshot(cold(engine, PROMPT[:100], 0))
    with pytest.raises(RestoreRefused, match="not aligned"):
        restore(engine.slot(1), snap, tokens=PROMPT[:100], mode="ancestor")


def test_other_identity_is_refused_before_anything_is_built(monkeypatch):
    """gate identity: planes made under another identity (another namespace salt) raise
    IdentityMismatch before a shadow is built."""
    foreign = tiny_engine(1, namespace="other-tenant")
    snap = snapshot(cold(foreign, PROMPT[:128], 0))
    engine = tiny_engine(1)
    assert snap.identity != engine.identity.digest
    built: list[str] = []
    monkeypatch.setattr(restore_mod, "build_shadow", lambda *a: built.append("shadow"))
    slot = engine.slot(0)
    before = slot.state
    with pytest.raises(IdentityMismatch) as e:
        restore(slot, roundtrip(snap), tokens=PROMPT[:128], mode="exact")
    assert (e.value.expected, e.value.got) == (engine.identity.digest, snap.identity)
    assert built == [] and slot.state is before


def test_snapshot_into_another_slot_both_continue_identically():
    """snapshot -> restore into a different slot of the same engine: both slots continue
    identically, and the snapshot's arrays are not disturbed by either slot decoding (so it
    restores again into a third slot with the same result)."""
    engine = tiny_engine(3)
    a = cold(engine, PROMPT, 0)
    a.generate(max_tokens=5, stop=())
    snap, history = snapshot(a), a.tokens
    frozen = [bytes(memoryview(x)) for x in snap.arrays()]
    b = engine.slot(1)
    restore(b, snap, tokens=history, mode="exact")
    first, second = continue_greedy(a, 40), continue_greedy(b, 40)
    assert first == second
    assert [bytes(memoryview(x)) for x in snap.arrays()] == frozen
    c = engine.slot(2)
    restore(c, snap, tokens=history, mode="exact")
    assert continue_greedy(c, 40) == first


def test_blocks_serialize_deterministically():
    """planes.encode: the same prefix gives byte-identical block parts — from a deeper cut
    of the same session and from a cold run in another engine — so blocks dedup."""
    e1, e2 = tiny_engine(1), tiny_engine(1)
    short = dict(planes.encode(snapshot(cold(e1, PROMPT[:150], 0)))[1])
    deep = dict(planes.encode(snapshot(cold(e2, PROMPT, 0)))[1])
    assert short["block/0"] == deep["block/0"] and short["block/1"] == deep["block/1"]
    assert short["block/2"] != deep["block/2"]  # partial block of 22 vs a whole one
    layout, _ = planes.encode(snapshot(cold(e2, PROMPT, 0)))
    assert [b["length"] for b in layout["blocks"]] == [64, 64, 64, 64, 44]


# -- faults: each must leave the slot exactly as it was ------------------------------------
@pytest.fixture
def victim():
    """An engine whose slot 1 holds another prompt, plus what that slot would do next
    (computed on a twin slot), and a good snapshot of PROMPT to corrupt."""
    engine = tiny_engine(3)
    twin = cold(engine, prompt(90, seed=6), 2)
    expected = continue_greedy(twin, 12)
    slot = cold(engine, prompt(90, seed=6), 1)
    a = cold(engine, PROMPT, 0)
    a.generate(max_tokens=3, stop=())
    return engine, slot, snapshot(a), a.tokens, expected


def assert_untouched(slot, before, expected):
    assert slot.state is before
    assert continue_greedy(slot, 12) == expected


def flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("where", ["payload", "header", "digest"])
def test_flipped_byte_in_a_plane_is_caught_by_the_decoder(victim, where):
    """planes.decode_part: one flipped bit anywhere in a part (float payload, JSON header,
    stored digest) raises PlaneCorrupt; nothing reaches the slot."""
    engine, slot, snap, tokens, expected = victim
    layout, parts = planes.encode(snap)
    role, data = parts[1]
    hlen = int.from_bytes(data[6:10], "little")
    at = {"payload": len(data) - 100, "header": 12, "digest": 10 + hlen + 3}[where]
    parts[1] = (role, flip(data, at))
    before = slot.state
    with pytest.raises(PlaneCorrupt) as e:
        restore(slot, planes.decode(layout, parts), tokens=tokens, mode="exact")
    assert e.value.role == role
    assert_untouched(slot, before, expected)


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "bad-magic",
        "format",
        "missing-part",
        "extra-part",
        "unknown-kind",
        "layout-format",
        "swapped-blocks",
    ],
)
def test_malformed_planes_are_refused(victim, damage):
    """planes.decode: truncation, a foreign magic, an unknown format version (part or
    layout), a missing / extra part, an unregistered part kind, or parts relabelled to the
    wrong block raise PlanesInvalid (never pick code by the data's say-so)."""
    engine, slot, snap, tokens, expected = victim
    layout, parts = planes.encode(snap)
    role, data = parts[0]
    if damage == "truncated":
        parts[0] = (role, data[:-8])
    elif damage == "bad-magic":
        parts[0] = (role, b"XXXX" + data[4:])
    elif damage == "format":
        parts[0] = (role, data[:4] + (planes.FORMAT + 1).to_bytes(2, "little") + data[6:])
    elif damage == "missing-part":
        del parts[0]
    elif damage == "extra-part":
        parts.append(("block/99", data))
    elif damage == "unknown-kind":
        parts[0] = ("globals/Block", data)
        layout["blocks"][0]["role"] = "globals/Block"
    elif damage == "layout-format":
        layout = {**layout, "format": planes.FORMAT + 1}
    elif damage == "swapped-blocks":
        parts[0], parts[1] = (parts[0][0], parts[1][1]), (parts[1][0], parts[0][1])
    before = slot.state
    with pytest.raises(PlanesInvalid):
        restore(slot, planes.decode(layout, parts), tokens=tokens, mode="exact")
    assert_untouched(slot, before, expected)


def _wrong(snap: Snapshot, fault: str) -> Snapshot:
    r0 = snap.rings[0]
    b0 = snap.blocks[0]
    if fault == "block-shape":
        bad = dataclasses.replace(b0, keys=(b0.keys[0][:, :-1, :], *b0.keys[1:]))
        return dataclasses.replace(snap, blocks=(bad, *snap.blocks[1:]))
    if fault == "block-dtype":
        bad = dataclasses.replace(b0, values=tuple(v.astype(mx.float16) for v in b0.values))
        return dataclasses.replace(snap, blocks=(bad, *snap.blocks[1:]))
    if fault == "heads":
        bad = dataclasses.replace(b0, keys=tuple(k[:1] for k in b0.keys))
        return dataclasses.replace(snap, blocks=(bad, *snap.blocks[1:]))
    if fault == "missing-block":
        return dataclasses.replace(snap, blocks=snap.blocks[:-1])
    if fault == "capacity":
        return dataclasses.replace(snap, capacity=snap.depth - 1)
    if fault == "ring-offset":
        return dataclasses.replace(
            snap, rings=(dataclasses.replace(r0, offset=r0.offset + 1), *snap.rings[1:])
        )
    if fault == "ring-idx":
        return dataclasses.replace(
            snap, rings=(dataclasses.replace(r0, idx=r0.size + 1), *snap.rings[1:])
        )
    if fault == "ring-window":
        return dataclasses.replace(
            snap, rings=(dataclasses.replace(r0, window=r0.window * 2), *snap.rings[1:])
        )
    if fault == "ring-size":
        small = dataclasses.replace(r0, keys=r0.keys[:, :8], values=r0.values[:, :8])
        return dataclasses.replace(snap, rings=(small, *snap.rings[1:]))
    if fault == "logits-shape":
        return dataclasses.replace(snap, logits=snap.logits[:-1])
    if fault == "alignment":
        return dataclasses.replace(snap, alignment=TINY_A * 2)
    raise AssertionError(fault)


FAULTS = [
    "block-shape",
    "block-dtype",
    "heads",
    "missing-block",
    "capacity",
    "ring-offset",
    "ring-idx",
    "ring-window",
    "ring-size",
    "logits-shape",
    "alignment",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_shape_gate_refuses_before_building(victim, fault, monkeypatch):
    """gate: a wrong block shape / dtype / head count, a missing block, an impossible
    capacity, a wrong ring offset / write index / window / size, wrong logits, or another
    alignment raise ShapeMismatch before any shadow is built; the slot is unchanged."""
    engine, slot, snap, tokens, expected = victim
    built: list[int] = []
    monkeypatch.setattr(restore_mod, "build_shadow", lambda *a: built.append(1))
    before = slot.state
    with pytest.raises(ShapeMismatch):
        restore(slot, _wrong(snap, fault), tokens=tokens, mode="exact")
    assert built == []
    assert_untouched(slot, before, expected)


def test_wrong_ring_offset_through_the_layout_is_refused(victim):
    """gate ring offset via planes: an offset edited in the layout (the manifest's ring
    metadata) decodes fine but is refused by the gate; the slot is unchanged."""
    engine, slot, snap, tokens, expected = victim
    layout, parts = planes.encode(snap)
    layout["ring"]["layers"][1]["offset"] -= 1
    before = slot.state
    with pytest.raises(ShapeMismatch, match="offset"):
        restore(slot, planes.decode(layout, parts), tokens=tokens, mode="exact")
    assert_untouched(slot, before, expected)


def test_depth_must_match_the_tokens(victim):
    """gate depth: the history handed to restore must be exactly the cut's depth."""
    engine, slot, snap, tokens, expected = victim
    before = slot.state
    with pytest.raises(ShapeMismatch, match="depth"):
        restore(slot, snap, tokens=tokens[:-1], mode="exact")
    assert_untouched(slot, before, expected)


def test_exception_half_way_through_install_leaves_slot_unchanged(victim, monkeypatch):
    """build_shadow failure: an exception raised after some layers are already installed
    (in the shadow) surfaces as InstallFailed; the slot keeps its old state and output, and
    a later clean restore of the same snapshot still works."""
    engine, slot, snap, tokens, expected = victim
    real = restore_mod.install_layer
    installed: list[int] = []

    def failing(cache, layer, **kw):
        if layer == 2:
            raise RuntimeError("injected install failure")
        real(cache, layer, **kw)
        installed.append(layer)

    monkeypatch.setattr(restore_mod, "install_layer", failing)
    before = slot.state
    with pytest.raises(InstallFailed) as e:
        restore(slot, snap, tokens=tokens, mode="exact")
    assert installed == [0, 1] and isinstance(e.value.cause, RuntimeError)
    assert_untouched(slot, before, expected)
    monkeypatch.setattr(restore_mod, "install_layer", real)
    restore(slot, snap, tokens=tokens, mode="exact")
    reference = engine.slot(2)
    restore(reference, snap, tokens=tokens, mode="exact")
    assert continue_greedy(slot) == continue_greedy(reference)
