"""interop: the engine's cuts as mlx-lm's own cache objects, and mlx-lm's caches as cuts.

- prompt cache: what mlx-lm's `make_prompt_cache(model)` returns — one cache object per
  layer (KVCache for full attention, RotatingKVCache for a sliding window) — and what
  `mlx_lm.generate` / `stream_generate` / `generate_step` continue from
  (`prompt_cache=`), updating it in place.
- PromptCache: such a list (`caches`) with the depth it holds and the cut's witnessed
  final logits (None when the cut had none).
- to_mlx_lm(pool, cut): a Snapshot, Planes or Source of the pool's identity as a fresh
  PromptCache, through the restore gate and the install (or the intake) a slot restore
  uses.
- from_mlx_lm(pool, caches, tokens=, logits=): caches holding `tokens` as a Snapshot of
  the pool's identity, through the same gate: refused (a RestoreRefused) unless they fit
  the model, the depth and the alignment. The Snapshot's arrays are views of the caches;
  mlx-lm's later writes into them replace their buffers, never the Snapshot's.
- prefill_aligned(model, caches, tokens, alignment=): run tokens through an mlx-lm model
  in the engine's absolute aligned steps; returns the final logits (witnessed).

When mlx-lm's own generation from a restored cache is bit-identical to a cold run.
mlx-lm prefills a prompt in chunks of `prefill_step_size` counted from the first token
it is given, and holds the last token back for its first decode step. A cold run over a
prompt of n tokens therefore computes its state at any depth d < n in steps that end on
multiples of the step size (and at n - 1). The engine's cut at d was computed in steps
that end on multiples of A (and at d). The two agree, and
`generate(model, tokenizer, prompt[d:], prompt_cache=to_mlx_lm(pool, cut).caches,
prefill_step_size=A)` yields exactly the tokens and log-probabilities of
`generate(model, tokenizer, prompt, prefill_step_size=A)`, when:
  1. prefill_step_size == A (the identity's alignment) in both runs;
  2. 0 < d < n and either d % A == 0 or d == n - 1 (`resumes`): an aligned cut, or the
     exact cut of `prompt[:-1]`; asking the vault for `prompt[:-1]` gives one of them.
     The exact cut of the whole prompt (d == n) is for the engine's own decoding, which
     starts from the witnessed logits; mlx-lm needs at least one token to start from;
  3. the cut was computed cold: by the engine's aligned prefill (every cut a vault
     publishes) or by prefill_aligned — not after decoded tokens, nor by mlx-lm's
     generate (which ends its prefill on n - 1, then decodes);
  4. same weights, code and compute: what the identity pins.
mlx-lm's default prefill_step_size is 2048; with A = 256 (the default) pass 256.
A cut published from mlx-lm's caches must have been computed by prefill_aligned (from an
empty cache or an aligned one) to be what a cold engine run computes; the gate checks
shapes, dtype, depth and ring layout, not how the values were computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from engine import codec
from engine.errors import EngineError, InvalidRequest, RestoreRefused, ShapeMismatch
from engine.intake import Source, read
from engine.restore import build_shadow, gate
from engine.slots import aligned_steps, cache_arrays
from engine.state import Planes, SlotState, Snapshot

if TYPE_CHECKING:
    from engine.slots import SlotPool


@dataclass
class PromptCache:
    """mlx-lm caches (one per layer, as make_prompt_cache returns) holding `depth` tokens,
    and the cut's witnessed final logits ([vocab]) or None."""

    caches: list[Any]
    depth: int
    logits: mx.array | None


def resumes(depth: int, *, prompt_len: int, alignment: int) -> bool:
    """Whether mlx-lm's generation over `prompt[depth:]` from a cold cut at `depth`, with
    prefill_step_size == alignment, computes exactly what its cold run over the prompt
    does (condition 2 above)."""
    return 0 < depth < prompt_len and (depth % alignment == 0 or depth == prompt_len - 1)


def to_mlx_lm(pool: SlotPool, cut: Snapshot | Planes | Source) -> PromptCache:
    """`cut` (decoded first when Planes, read into an intake when a Source) as fresh
    mlx-lm caches of the pool's model. Gated as a restore is: an aligned cut as an
    ancestor, any other as an exact cut (so it needs witnessed logits); a RestoreRefused
    when it does not fit."""
    shadow = None
    if isinstance(cut, Planes):
        snap = codec.decode(cut)
    elif isinstance(cut, Snapshot):
        snap = cut
    else:
        snap, shadow = read(pool, cut)  # the intake's shadow is a fresh set of caches
    gate(pool, snap, depth=snap.depth, mode="ancestor" if snap.aligned else "exact")
    if shadow is None:
        shadow = build_shadow(pool, snap, [])  # the caches hold no token ids
    return PromptCache(shadow.cache, snap.depth, shadow.logits)


def from_mlx_lm(
    pool: SlotPool,
    caches: Sequence[Any],
    *,
    tokens: Sequence[int],
    logits: mx.array | None = None,
) -> Snapshot:
    """The cut that mlx-lm `caches` holding `tokens` make under the pool's identity.

    `logits`: the final position's logits ([vocab], e.g. what prefill_aligned returns),
    when witnessed; without them the cut must be aligned (an ancestor, never an exact hit).
    Raises a RestoreRefused (ShapeMismatch, LogitsMissing...) when the caches are not the
    model's cache types, hold another depth or batch, or do not fit its layout. The gate
    sees shapes, not values: the caches must come from the pool's own weights, filled by
    prefill_aligned, for the cut to be what a cold engine run computes."""
    history = pool.check_tokens(tokens)
    if not history:
        raise ShapeMismatch("depth (tokens given)", "> 0", 0)
    if logits is not None and logits.ndim != 1:
        raise ShapeMismatch("logits shape", (pool.vocab_size,), tuple(logits.shape))
    fresh = pool.loaded.make_cache()
    if len(caches) != len(fresh):
        raise ShapeMismatch("caches (one per layer)", len(fresh), len(caches))
    for i, (cache, want) in enumerate(zip(caches, fresh, strict=True)):
        # Exact types: a quantized or batched KV cache subclasses nothing we can export.
        if type(cache) is not type(want):
            raise ShapeMismatch(f"layer {i} cache", type(want).__name__, type(cache).__name__)
        if cache.keys is None or int(cache.offset) != len(history):
            raise ShapeMismatch(f"layer {i} depth (tokens given)", len(history), cache.offset)
        if cache.keys.shape[0] != 1:
            raise ShapeMismatch(f"layer {i} batch", 1, cache.keys.shape[0])
    state = SlotState(cache=list(caches), tokens=history, logits=logits)
    try:
        snap = codec.export(pool, state)
    except EngineError as e:  # layers that disagree are not a cut of this model
        raise RestoreRefused(f"the caches do not form a cut: {e}") from e
    gate(pool, snap, depth=len(history), mode="exact" if logits is not None else "ancestor")
    return snap


def prefill_aligned(
    model: nn.Module, caches: Sequence[Any], tokens: Sequence[int], *, alignment: int
) -> mx.array:
    """Append `tokens` to mlx-lm `caches` through `model` in steps that end on absolute
    multiples of `alignment` (as a slot prefills); returns the final logits ([vocab]).
    From an empty or aligned cache this computes exactly the engine's cold state."""
    if not tokens:
        raise InvalidRequest("tokens", "nothing to prefill")
    if not isinstance(alignment, int) or alignment <= 0:
        raise InvalidRequest("alignment", f"must be a positive int, got {alignment!r}")
    offsets = {int(c.offset) for c in caches}
    if len(offsets) != 1:
        raise InvalidRequest("caches", f"layers at different depths {sorted(offsets)}")
    start, caches, ids = offsets.pop(), list(caches), list(tokens)
    logits = None
    for lo, hi in aligned_steps(start, start + len(ids), alignment):
        step = mx.array(ids[lo - start : hi - start], dtype=mx.int32)[None]
        logits = model(step, cache=caches)[0, -1]
        mx.eval(logits, cache_arrays(caches))
    assert logits is not None  # tokens is not empty
    return logits
