"""engine/codec and engine/state: Snapshot and Planes, strict decoding, the registry of
cache kinds, and each kind's gate refusing a cut that does not fit the model (before any
shadow is built, the slot unchanged)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

import engine.restore as restore_mod
from engine import codec
from engine.codec import frame
from engine.errors import PlanesInvalid, ShapeMismatch
from engine.format import decode, encode
from engine.state import Part, Planes
from tests.engine.slotkit import (
    PROMPT,
    TINY_A,
    cold,
    edit_layout,
    replace_part,
    tiny_pool,
    victim,
)


def test_snapshot_parts_and_sizes():
    """Slot.export: parts in encode order (blocks, ring, logits), each kind's role and
    fields; nbytes and arrays() cover every part; the logits are the slot's."""
    slot = cold(tiny_pool(1), PROMPT)
    snap = slot.export()
    assert [p.role for p in snap.parts] == [*(f"block/{i}" for i in range(5)), "ring", "logits"]
    assert [p.kind for p in snap.parts] == ["block"] * 5 + ["ring", "logits"]
    assert snap.parts[4].fields == {"index": 4, "length": 300 - 4 * TINY_A}
    assert snap.parts[5].fields == {"layers": [0, 2]}
    assert snap.nbytes == sum(a.nbytes for a in snap.arrays()) == sum(p.nbytes for p in snap.parts)
    assert len(snap.arrays()) == 5 * 4 + 4 + 1
    assert snap.logits is slot.logits and snap.logits_witnessed
    assert not snap.aligned and cold(tiny_pool(1), PROMPT[: 2 * TINY_A]).export().aligned


def test_planes_read_their_layout():
    """Planes: identity, depth and logits_witnessed come from the layout, nbytes is the sum
    of the parts' lengths; a layout of another format or with a malformed identity is
    PlanesInvalid on first read."""
    pool = tiny_pool(1)
    planes = encode(cold(pool, PROMPT[:70]).export())
    assert (planes.identity, planes.depth, planes.logits_witnessed) == (
        pool.identity.digest,
        70,
        True,
    )
    assert planes.nbytes == sum(len(data) for _, data in planes.parts)
    for broken in ({**planes.layout, "format": 2}, {**planes.layout, "identity": "zz"}):
        with pytest.raises(PlanesInvalid):
            _ = Planes(broken, planes.parts).identity
    with pytest.raises(PlanesInvalid):
        _ = Planes({"format": 1}, planes.parts).logits_witnessed


def test_snapshot_layout_must_agree_with_its_scalars():
    """Snapshot: identity, depth and alignment are also in the layout; a Snapshot whose
    two say different things cannot be built (PlanesInvalid)."""
    snap = cold(tiny_pool(1), PROMPT[:70]).export()
    with pytest.raises(PlanesInvalid, match="layout says"):
        dataclasses.replace(snap, depth=snap.depth - 1)


def test_blocks_serialize_deterministically():
    """Snapshot.planes: the same prefix gives byte-identical block parts — from a deeper cut
    of the same session and from a cold run in another pool — so blocks dedup."""
    p1, p2 = tiny_pool(1), tiny_pool(1)
    short = dict(encode(cold(p1, PROMPT[:150], 0).export()).parts)
    deep = encode(cold(p2, PROMPT, 0).export())
    assert short["block/0"] == dict(deep.parts)["block/0"]
    assert short["block/1"] == dict(deep.parts)["block/1"]
    assert short["block/2"] != dict(deep.parts)["block/2"]  # partial block of 22 vs a whole one
    assert [b["length"] for b in deep.layout["blocks"]] == [64, 64, 64, 64, 44]


def test_decode_orders_parts_by_the_layout():
    """Planes.decode: parts given in any order come back in the layout's (encode) order and
    re-encode to the same bytes."""
    planes = encode(cold(tiny_pool(1), PROMPT).export())
    shuffled = Planes(planes.layout, tuple(reversed(planes.parts)))
    assert encode(decode(shuffled)) == planes


def _damaged(planes: Planes, damage: str) -> Planes:
    layout, parts = dict(planes.layout), list(planes.parts)
    role, data = parts[0]
    blocks = [dict(b) for b in layout["blocks"]]
    if damage == "truncated":
        parts[0] = (role, data[:-8])
    elif damage == "bad-magic":
        parts[0] = (role, b"XXXX" + data[4:])
    elif damage == "format":
        parts[0] = (role, data[:4] + (frame.FORMAT + 1).to_bytes(2, "little") + data[6:])
    elif damage == "missing-part":
        del parts[0]
    elif damage == "extra-part":
        parts.append(("block/99", data))
    elif damage == "duplicate-part":
        parts.append(parts[0])
    elif damage == "layout-format":
        layout["format"] = frame.FORMAT + 1
    elif damage == "swapped-blocks":
        parts[0], parts[1] = (parts[0][0], parts[1][1]), (parts[1][0], parts[0][1])
    elif damage == "listed-twice":
        blocks.append(blocks[0])
    elif damage == "bool-depth":
        layout["depth"] = True
    elif damage == "ring-entry-without-offset":
        ring = dict(layout["ring"])
        ring["layers"] = [{k: v for k, v in r.items() if k != "offset"} for r in ring["layers"]]
        layout["ring"] = ring
    elif damage == "logits-listed-as-a-block":
        blocks[0]["role"] = "logits/0"
        parts[0] = ("logits/0", data)
    elif damage == "block-entry-not-a-mapping":
        blocks[0] = "block/0"
    elif damage == "logits-without-vocab":
        layout["logits"] = {"role": "logits"}
    else:
        raise AssertionError(damage)
    layout["blocks"] = blocks
    return Planes(layout, tuple(parts))


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "bad-magic",
        "format",
        "missing-part",
        "extra-part",
        "duplicate-part",
        "layout-format",
        "swapped-blocks",
        "listed-twice",
        "bool-depth",
        "ring-entry-without-offset",
        "logits-listed-as-a-block",
        "block-entry-not-a-mapping",
        "logits-without-vocab",
    ],
)
def test_malformed_planes_are_refused(damage):
    """Planes.decode via Slot.restore: truncation, a foreign magic, an unknown format
    version (part or layout), a missing / extra / repeated part, parts relabelled to the
    wrong block, a role listed twice or under the wrong kind, a layout entry missing a
    field or of the wrong type raise PlanesInvalid; the slot is unchanged."""
    v = victim()
    before = v.slot.state
    with pytest.raises(PlanesInvalid):
        v.slot.restore(_damaged(encode(v.snap), damage), prompt=v.tokens)
    v.assert_untouched(before)


def test_registry_refuses_an_unknown_part_kind(monkeypatch):
    """KINDS: a part whose role names no registered kind is refused — by decode, even when
    the layout lists it and its bytes are a valid frame of that kind (PlanesInvalid), and by
    the gate for a Snapshot in memory (ShapeMismatch, before any shadow is built)."""
    v = victim()
    planes = encode(v.snap)
    ssm = frame.encode_part("ssm", [mx.zeros((2, 4))])
    layout = {**planes.layout, "blocks": [{**planes.layout["blocks"][0], "role": "ssm/0"}]}
    layout["blocks"] += planes.layout["blocks"][1:]
    parts = (("ssm/0", ssm), *planes.parts[1:])
    with pytest.raises(PlanesInvalid, match="unknown part kind 'ssm'") as e:
        v.slot.restore(Planes(layout, parts), prompt=v.tokens)
    assert e.value.role == "ssm/0"
    built: list[int] = []
    monkeypatch.setattr(restore_mod, "build_shadow", lambda *a: built.append(1))
    extra = Part("ssm/0", (mx.zeros((2, 4)),), {})
    before = v.slot.state
    with pytest.raises(ShapeMismatch, match="ssm/0 kind"):
        v.slot.restore(dataclasses.replace(v.snap, parts=(*v.snap.parts, extra)), prompt=v.tokens)
    assert built == [] and "ssm" not in codec.KINDS
    v.assert_untouched(before)


def _ring_layer0(**changes):
    def edit(layout):
        layout["ring"]["layers"][0].update(changes)

    return edit


def _wrong(snap, fault):
    b0 = snap.parts[0]
    ring = next(p for p in snap.parts if p.kind == "ring")
    logits = snap.logits
    r0 = snap.layout["ring"]["layers"][0]
    if fault == "block-shape":
        return replace_part(snap, "block/0", arrays=(b0.arrays[0][:, :-1, :], *b0.arrays[1:]))
    if fault == "block-dtype":
        return replace_part(snap, "block/0", arrays=tuple(a.astype(mx.float16) for a in b0.arrays))
    if fault == "heads":
        return replace_part(snap, "block/0", arrays=tuple(a[:1] for a in b0.arrays))
    if fault == "block-arrays":
        return replace_part(snap, "block/0", arrays=b0.arrays[:2])
    if fault == "block-index":
        return replace_part(snap, "block/0", fields={**b0.fields, "index": 1})
    if fault == "missing-block":
        return dataclasses.replace(snap, parts=snap.parts[1:])
    if fault == "capacity":
        return edit_layout(snap, lambda layout: layout.update(capacity=snap.depth - 1))
    if fault == "ring-offset":
        return edit_layout(snap, _ring_layer0(offset=r0["offset"] + 1))
    if fault == "ring-idx":
        return edit_layout(snap, _ring_layer0(idx=r0["size"] + 1))
    if fault == "ring-window":
        return edit_layout(snap, _ring_layer0(window=r0["window"] * 2))
    if fault == "ring-keep":
        return edit_layout(snap, _ring_layer0(keep=4))
    if fault == "ring-size":  # consistent, but no RotatingKVCache is ever that short
        small = edit_layout(snap, _ring_layer0(size=8))
        arrays = (ring.arrays[0][:, :8], ring.arrays[1][:, :8], *ring.arrays[2:])
        return replace_part(small, "ring", arrays=arrays)
    if fault == "ring-size-layout":  # the layout's size is not the buffers'
        return edit_layout(snap, _ring_layer0(size=r0["size"] - 1))
    if fault == "ring-layers":
        return edit_layout(snap, lambda layout: layout["ring"]["layers"].pop())
    if fault == "no-ring":
        bare = edit_layout(snap, lambda layout: layout.update(ring=None))
        return dataclasses.replace(bare, parts=tuple(p for p in snap.parts if p.kind != "ring"))
    if fault == "logits-shape":
        return replace_part(snap, "logits", arrays=(logits[:-1],))
    if fault == "logits-dtype":
        return replace_part(snap, "logits", arrays=(logits.astype(mx.float16),))
    if fault == "logits-vocab":
        return edit_layout(snap, lambda layout: layout["logits"].update(vocab=7))
    if fault == "alignment":
        layout = {**snap.layout, "alignment": TINY_A * 2}
        return dataclasses.replace(snap, alignment=TINY_A * 2, layout=layout)
    raise AssertionError(fault)


# fault -> what the ShapeMismatch names: the kind whose gate refused it.
FAULTS = {
    "block-shape": "block 0 full layer #0 K shape",
    "block-dtype": "block 0 full layer #0 K dtype",
    "heads": "block 0 full layer #0 K shape",
    "block-arrays": "block 0 arrays",
    "block-index": "block 0 index",
    "missing-block": "block count",
    "capacity": "capacity",
    "ring-offset": "ring of layer 0 offset",
    "ring-idx": "ring of layer 0 write index",
    "ring-window": "ring of layer 0 window",
    "ring-keep": "ring of layer 0 keep",
    "ring-size": "ring of layer 0 size",
    "ring-size-layout": "ring of layer 0 K shape",
    "ring-layers": "ring layers",
    "no-ring": "ring layers",
    "logits-shape": "logits shape",
    "logits-dtype": "logits dtype",
    "logits-vocab": "logits vocab",
    "alignment": "alignment",
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_kind_gate_refuses_a_wrong_shape(fault, monkeypatch):
    """gate: blocks (shape, dtype, heads, arrays per block, index, count, capacity), rings
    (offset, write index, window, keep, an impossible size, a layout size that is not the
    buffers', missing ring layers) and logits (shape, dtype, vocab), and another alignment,
    each raise ShapeMismatch naming what is wrong, before any shadow is built; the slot is
    unchanged."""
    v = victim()
    built: list[int] = []
    monkeypatch.setattr(restore_mod, "build_shadow", lambda *a: built.append(1))
    before = v.slot.state
    with pytest.raises(ShapeMismatch) as e:
        v.slot.restore(_wrong(v.snap, fault), prompt=v.tokens)
    assert e.value.what.startswith(FAULTS[fault]), e.value.what
    assert built == []
    v.assert_untouched(before)


def test_wrong_ring_offset_through_the_layout_is_refused():
    """gate ring offset via planes: an offset edited in the layout (the manifest's ring
    metadata) decodes fine but is refused by the rings' gate; the slot is unchanged."""
    v = victim()
    planes = encode(v.snap)
    layout = edit_layout(v.snap, lambda layout: layout["ring"]["layers"][1].update(offset=1))
    before = v.slot.state
    with pytest.raises(ShapeMismatch, match="ring of layer 2 offset"):
        v.slot.restore(Planes(layout.layout, planes.parts), prompt=v.tokens)
    v.assert_untouched(before)
