"""Intake: a cut's frames written straight into the shadow they become — bit-identical to
the cut restored from memory, no copy after the bytes land, and every part checked
against the frame the engine expects before the swap."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from cas.buffers import scatter
from engine import unfilled
from engine.errors import PlanesInvalid, RestoreRefused, ShapeMismatch
from engine.format import encode
from engine.slots import SlotPool
from engine.state import Planes
from tests.engine.slotkit import (
    PROMPT,
    TINY_A,
    cold,
    continue_greedy,
    drop_logits,
    physical,
    prompt,
    tiny,
    tiny_pool,
)


def fill(intake, planes: Planes, data_of=None) -> None:
    """What a reader does: each part's bytes, in order, across its segments."""
    parts = [(role, data_of(role) if data_of else data) for role, data in planes.parts]
    dests = intake.destinations([(role, len(data)) for role, data in parts])
    for (_, data), segments in zip(parts, dests, strict=True):
        scatter(data, segments)


@pytest.mark.parametrize("decode_first", [0, 5], ids=["after-prefill", "rotated-ring"])
def test_exact_intake_is_bit_identical(decode_first):
    """An exact cut (blocks, wrapped rings, logits) written into an intake restores to the
    same cache bytes, rotation and capacity, and the same continuation, as the cut itself."""
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    a.generate(max_tokens=decode_first, stop=())
    planes = encode(a.export())
    b = pool.slot(1)
    b.prefill(prompt(40, seed=5))
    intake = b.intake(planes.layout)
    fill(intake, planes)
    snap = b.restore(intake, prompt=a.tokens)
    assert snap.depth == a.depth and b.tokens == a.tokens
    assert physical(b) == physical(a)
    assert continue_greedy(b) == continue_greedy(a)


def test_an_intake_without_a_zero_fill_is_bit_identical(monkeypatch):
    """The full layers' buffers made without their zero fill (forced here at any size),
    over memory that freed caches full of ones left behind: the restored cut is still the
    cut, the capacity rows past its depth zeros, and so is its continuation."""
    monkeypatch.setattr(unfilled, "_crossover", 0)
    made = calls(monkeypatch, unfilled, "unfilled")
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    planes = encode(a.export())
    assert planes.layout["capacity"] > a.depth  # rows past the depth exist
    for _ in range(3):
        b = restored_over_ones(pool, a, planes)
        assert physical(b) == physical(a)
    assert continue_greedy(b) == continue_greedy(a)
    assert len(made) == 3  # each restore's full layers came from unfilled


@pytest.mark.parametrize("alignment", [TINY_A, KVCache.step], ids=["four-blocks", "one-block"])
def test_an_intake_that_fills_its_capacity_is_packed_and_bit_identical(monkeypatch, alignment):
    """A cut as deep as its capacity (an aligned cut of the demo model always is) has its
    full layers' buffers made as views of a few unfilled buffers, over memory freed
    caches full of ones left behind: it restores to the cut, and the cache grows from it
    (its next tokens, more prompt) exactly as the cut's own would. A cut of one block
    lands in those buffers whole: its destination is the frame head, then one buffer."""
    monkeypatch.setattr(unfilled, "_crossover", 1 << 60)  # below it: packed all the same
    made = calls(monkeypatch, unfilled, "packed")
    pool = SlotPool(tiny("default", alignment), num_slots=2)
    tokens = prompt(KVCache.step + 40, seed=4)
    a = cold(pool, tokens[: KVCache.step], 0)
    planes = encode(a.export())
    assert planes.layout["capacity"] == a.depth
    roles = [role for role, _ in planes.parts]
    intake = pool.slot(1).intake(planes.layout)
    block = intake.destinations([(role, len(data)) for role, data in planes.parts])[0]
    assert roles[0] == "block/0" and (len(block) == 2) == (alignment == KVCache.step)
    for _ in range(2):
        b = restored_over_ones(pool, a, planes)
        assert physical(b) == physical(a)
    assert len(made) == 3
    assert continue_greedy(b) == continue_greedy(a)
    b = restored_over_ones(pool, a, planes)
    b.prefill(tokens[KVCache.step :])
    assert physical(b) == physical(cold(pool, tokens, 0))


def restored_over_ones(pool, a, planes: Planes):
    """Slot 1 restored from `planes` (slot `a`'s cut) through an intake, once caches of
    `a`'s shapes full of ones were freed for the allocator to hand out."""
    ones = [mx.ones(c.keys.shape) for c in a.state.cache for _ in "KV"]
    mx.eval(ones)
    del ones
    b = pool.slot(1)
    b.reset()
    intake = b.intake(planes.layout)
    fill(intake, planes)
    b.restore(intake, prompt=a.tokens)
    return b


def test_an_intake_below_the_crossover_keeps_the_zero_fill(monkeypatch):
    monkeypatch.setattr(unfilled, "_crossover", 1 << 60)
    made = calls(monkeypatch, unfilled, "unfilled")
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    planes = encode(a.export())
    b = pool.slot(1)
    intake = b.intake(planes.layout)
    fill(intake, planes)
    b.restore(intake, prompt=a.tokens)
    assert physical(b) == physical(a) and made == []


def calls(monkeypatch, module, name) -> list[object]:
    """Record each call of module.name (still made)."""
    made: list[object] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: made.append(a) or real(*a, **k))
    return made


@pytest.mark.parametrize("logits", [True, False], ids=["with-logits", "logit-less"])
def test_ancestor_intake_then_prefill_matches_cold(logits):
    """An aligned cut through an intake (with its logits or without), then the rest of the
    prompt prefilled, computes exactly what a cold run of the whole prompt does."""
    pool = tiny_pool(2)
    tokens = prompt(5 * TINY_A + 17, seed=3)
    cuts = {}
    a = pool.slot(0)
    a.reset()
    a.prefill(tokens, on_boundary=lambda d: cuts.setdefault(d, a.export()))
    cut = cuts[3 * TINY_A]
    planes = encode(cut if logits else drop_logits(cut))
    b = pool.slot(1)
    intake = b.intake(planes.layout)
    fill(intake, planes)
    b.restore(intake, prompt=tokens)
    b.prefill(tokens[3 * TINY_A :])
    assert physical(b) == physical(a)
    assert continue_greedy(b) == continue_greedy(a)


def test_intake_holds_the_bytes_where_they_landed():
    """No copy after the bytes land: a byte written into a block's segment after the restore
    is in the slot's cache (the segments are the cache's own memory)."""
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    planes = encode(a.export())
    b = pool.slot(1)
    intake = b.intake(planes.layout)
    sizes = [(role, len(data)) for role, data in planes.parts]
    segments = intake.destinations(sizes)[[r for r, _ in sizes].index("block/0")]
    fill(intake, planes)
    b.restore(intake, prompt=a.tokens)
    layer = next(i for i, c in enumerate(b.state.cache) if type(c).__name__ == "KVCache")
    before = bytes(memoryview(b.state.cache[layer].keys))
    segments[1][:4] = bytes(4) if segments[1][:4] != bytes(4) else b"\1\1\1\1"
    assert bytes(memoryview(b.state.cache[layer].keys)) != before


def test_a_part_of_another_place_is_refused_and_the_slot_untouched():
    """Block 1's bytes where block 0 belongs (same size, another header): PlanesInvalid at
    restore, and the slot keeps what it had."""
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    planes = encode(a.export())
    b = cold(pool, prompt(90, seed=6), 1)
    before, expected = b.state, continue_greedy(cold(pool, prompt(90, seed=6), 0), 8)
    parts = dict(planes.parts)
    intake = b.intake(planes.layout)
    fill(intake, planes, lambda role: parts["block/1"] if role == "block/0" else parts[role])
    with pytest.raises(PlanesInvalid) as e:
        b.restore(intake, prompt=a.tokens)
    assert e.value.role == "block/0"
    assert b.state is before and continue_greedy(b, 8) == expected


def test_layouts_that_do_not_fit_are_refused_before_allocating():
    """A layout of another identity, an impossible capacity or ring size, another depth, a
    malformed entry, blocks out of order, overlapping or past the capacity (rows of
    other lengths from the split), or a non-aligned cut without logits (it could
    serve nothing): RestoreRefused from Slot.intake itself."""
    pool = tiny_pool(1)
    snap = cold(pool, PROMPT, 0).export()

    def edited(edit):
        layout = copy.deepcopy(dict(snap.layout))
        edit(layout)
        return layout

    def ring_size(layout):
        layout["ring"]["layers"][0]["size"] = 10**9

    def blocks(edit):
        def edited_blocks(layout):
            layout["blocks"] = edit([dict(b) for b in layout["blocks"]])

        return edited(edited_blocks)

    def longer_first(entries):
        entries[0]["length"] += 1
        return entries

    def last_past_capacity(entries):
        entries[-1]["index"] += 5
        return entries

    broken = [
        edited(lambda layout: layout.update(identity="00" * 32)),
        edited(lambda layout: layout.update(capacity=10**9)),
        edited(lambda layout: layout.update(capacity=-1)),
        edited(ring_size),
        edited(lambda layout: layout.update(depth=snap.depth + TINY_A)),
        edited(lambda layout: layout.update(blocks="nope")),
        blocks(lambda entries: entries[::-1]),
        blocks(longer_first),
        blocks(last_past_capacity),
        dict(drop_logits(snap).layout),
    ]
    for layout in broken:
        with pytest.raises(RestoreRefused):
            pool.slot(0).intake(layout)


def test_destinations_check_roles_and_sizes_and_an_intake_is_used_once():
    """destinations refuses missing or extra roles and wrong sizes; a restored intake
    cannot be restored again, nor into another pool."""
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    planes = encode(a.export())
    intake = pool.slot(1).intake(planes.layout)
    sizes = [(role, len(data)) for role, data in planes.parts]
    with pytest.raises(PlanesInvalid):
        intake.destinations(sizes[1:])
    with pytest.raises(PlanesInvalid):
        intake.destinations([*sizes, ("block/99", 10)])
    with pytest.raises(PlanesInvalid):
        intake.destinations([(sizes[0][0], sizes[0][1] + 1), *sizes[1:]])
    fill(intake, planes)
    with pytest.raises(RestoreRefused):
        tiny_pool(1).slot(0).restore(intake, prompt=a.tokens)
    pool.slot(1).restore(intake, prompt=a.tokens)
    with pytest.raises(RestoreRefused):
        pool.slot(0).restore(intake, prompt=a.tokens)
    with pytest.raises(ShapeMismatch):
        fresh = pool.slot(0).intake(planes.layout)
        fill(fresh, planes)
        pool.slot(0).restore(fresh, prompt=a.tokens[:-1])


def test_an_intake_never_filled_is_refused_without_allocating_its_shadow():
    """Restoring an intake whose destinations were never made is refused, names why, and
    allocates nothing for it (there is nothing to check its heads against); the slot keeps
    what it held."""
    pool = tiny_pool(2)
    a = cold(pool, PROMPT, 0)
    planes = encode(a.export())
    b = pool.slot(1)
    b.prefill(prompt(40, seed=5))
    before = physical(b)
    intake = b.intake(planes.layout)
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    with pytest.raises(PlanesInvalid, match="never filled"):
        b.restore(intake, prompt=a.tokens)
    assert mx.get_peak_memory() - start < sum(len(data) for _, data in planes.parts) // 2
    assert physical(b) == before
    with pytest.raises(RestoreRefused, match="already restored"):
        b.restore(intake, prompt=a.tokens)
