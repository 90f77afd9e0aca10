"""engine/unfilled.py: MLX arrays made without a zero fill, their rows past the filled
ones still zeros, over memory that freed arrays left dirty; and the crossover from which
they are worth it, measured."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import unfilled as unfilled_module
from engine.unfilled import calibrate, crossover, packed, unfilled, worth_it

# Different heads per array, so a tensor's tail rows lie at different offsets.
SHAPES = [(1, 2, 96, 16), (1, 3, 96, 16), (1, 2, 96, 16)]


def dirty(shapes, dtype) -> None:
    """Leave freed buffers of these sizes full of ones for the allocator to hand out."""
    ones = [mx.ones(s, dtype=dtype) for s in shapes]
    mx.eval(ones)
    del ones


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("filled_rows", [0, 40, 96])
def test_rows_past_the_filled_ones_are_zeros_and_the_rest_writable(name, filled_rows):
    dtype = getattr(mx, name)
    for _ in range(3):
        dirty(SHAPES, dtype)
        arrays = unfilled(SHAPES, name, filled_rows=filled_rows)
        assert [tuple(a.shape) for a in arrays] == SHAPES and {a.dtype for a in arrays} == {dtype}
        for a in arrays:
            tail = np.array(a[..., filled_rows:, :].astype(mx.float32))
            assert not tail.any(), "a row past the filled ones is not zero"
    # The rows before are the caller's: written through the buffer, read back as values.
    a = arrays[1]
    flat, row = memoryview(a).cast("B"), 16 * a.itemsize
    for h in range(3):
        flat[h * 96 * row : (h * 96 + filled_rows) * row] = b"\x3c" * (filled_rows * row)
    head = np.array(a[..., :filled_rows, :].astype(mx.float32))
    assert head.size == 0 or (head != 0).all()


def test_the_memory_is_not_filled():
    """What makes it worth having: the rows before `filled_rows` keep the freed bytes
    (ones) rather than being zeroed — at least one array of several came from them."""
    shapes = [(1, 4, 256, 64)] * 4
    dirty(shapes, mx.float32)
    arrays = unfilled(shapes, "float32", filled_rows=200)
    assert any(np.array(a[..., :200, :]).any() for a in arrays)


def test_packed_arrays_are_views_of_few_unfilled_buffers(monkeypatch):
    """Each run of equal shapes comes out of one unfilled buffer (a new one past
    GROUP_BYTES), each array is its own bytes (written through its buffer, read back as
    its values, no other array changed), and the buffers hold the arrays end to end."""
    asked: list[list[tuple[int, ...]]] = []
    real = unfilled_module.unfilled

    def recorded(shapes, *args, **kwargs):
        asked.append(shapes)
        return real(shapes, *args, **kwargs)

    monkeypatch.setattr(unfilled_module, "unfilled", recorded)
    small, large = (1, 2, 96, 16), (1, 3, 96, 16)
    monkeypatch.setattr(unfilled_module, "GROUP_BYTES", 2 * 2 * 96 * 16 * 4)  # two small
    shapes = [small] * 3 + [large] * 2 + [small]
    arrays, buffers = packed(shapes, "float32")
    assert [tuple(a.shape) for a in arrays] == shapes and {a.dtype for a in arrays} == {mx.float32}
    # small x2 | small | large (too large to share) | large | small
    assert asked == [[(2, 2, 96, 16), small, large, large, small]]
    for i, a in enumerate(arrays):
        memoryview(a).cast("B")[:] = np.full(a.size, i + 1, dtype=np.float32).tobytes()
    for i, a in enumerate(arrays):
        assert (np.array(a) == i + 1).all()
    assert len(buffers) == 5
    joined = np.concatenate([np.array(b).reshape(-1) for b in buffers])
    assert (joined == np.concatenate([np.array(a).reshape(-1) for a in arrays])).all()


def test_packed_memory_is_not_filled():
    shapes = [(1, 4, 256, 64)] * 4
    dirty([(4, 4, 256, 64)], mx.float32)
    assert any(np.array(a).any() for a in packed(shapes, "float32").arrays)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="filled_rows"):
        unfilled(SHAPES, "float32", filled_rows=97)
    with pytest.raises(ValueError, match="dtype"):
        unfilled(SHAPES, "int8", filled_rows=0)
    assert unfilled([], "float32", filled_rows=0) == []
    with pytest.raises(ValueError, match="dtype"):
        packed(SHAPES, "int8")
    with pytest.raises(ValueError, match="filled_rows"):
        packed([(16,)], "float32")
    assert packed([], "float32") == ([], [])


def test_the_crossover_is_where_the_zero_fill_costs_what_unfilled_does():
    # 96 MB zero-filled in 8 ms, unfilled in 10 ms: the fill of 120 MB would cost 10 ms.
    assert crossover(96_000_000, zeros_s=0.008, unfilled_s=0.010) == 120_000_000
    assert crossover(96_000_000, zeros_s=0.012, unfilled_s=0.003) == 24_000_000
    with pytest.raises(ValueError, match="crossover"):
        crossover(96_000_000, zeros_s=0.0, unfilled_s=0.003)


def test_calibrate_sets_what_worth_it_answers(monkeypatch):
    monkeypatch.setattr(unfilled_module, "_crossover", unfilled_module.MIN_BYTES)
    assert worth_it(unfilled_module.MIN_BYTES) and not worth_it(unfilled_module.MIN_BYTES - 1)
    measured = calibrate([(1, 4, 1024, 64)] * 4, "float32", tries=2)
    assert measured > 0
    assert worth_it(measured) and not worth_it(measured - 1)
    with pytest.raises(ValueError, match="shapes"):
        calibrate([], "float32")
    with pytest.raises(ValueError, match="dtype"):
        calibrate(SHAPES, "int8")
