"""Slots: a fixed number of sessions over one loaded model.

- SlotPool: one LoadedModel and `num_slots` slots; its alignment A is the identity's.
- Slot: one session — its mlx-lm cache (one cache object per layer), its token history
  (every token that went through the model, in order) and its last logits (the row of the
  final position after the last forward). The logits are *witnessed*: they came from a
  forward over exactly this history; a slot without them (fresh, or restored from a
  logit-less ancestor) must prefill before it can decode.
- SlotState: the three together. A slot holds one SlotState reference; restore swaps in a
  new one with a single assignment, so no reader ever sees a half-installed state.
- cut: `Slot.export()` gives the slot's state as a Snapshot; `Slot.restore(cut, prompt=)`
  installs a Snapshot or Planes (engine/state.py), an Intake a reader has filled in
  place (engine/intake.py, from `Slot.intake(layout)`), or a Source (which fills an
  intake made for it), for the request `prompt`.
- aligned prefill: tokens go through the model in steps that end on absolute multiples of
  A (first up to the next multiple, then whole A-sized steps, then the remainder), so an
  aligned cut restored and prefilled to the end computes exactly what a cold run computes.
- generation: decoding from the witnessed logits with a Sampling (engine/sampling.py).
- step-wise: `prefill_steps` (one aligned step per iteration) and `decoding` (one token
  per `Decoding.step`) do the same work as `prefill` and `generate` one step at a time,
  so a caller can interleave several slots' work on one thread; the slot's lock is held
  for each step, never between steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx

from engine import codec, restore
from engine.errors import EmptySlot, InvalidRequest, LogitsMissing, ShapeMismatch
from engine.intake import Intake, Source, read
from engine.layout import KVLayout, dtype_name
from engine.sampling import GREEDY, Drawn, Sampler, Sampling
from engine.state import Planes, SlotState, Snapshot

if TYPE_CHECKING:
    from engine.identity import Identity
    from engine.models import LoadedModel

FinishReason = Literal["stop", "length", "cancelled"]
# Buffers SlotPool.calibrate times: past the CPU's caches, so the zero fill runs at the
# memory's rate, as a deep cut's does.
CALIBRATION_BYTES = 64 << 20
Cancel = threading.Event | Callable[[], bool] | None


@dataclass
class Generation:
    """What one generate call produced. `stop_token` is the stop token drawn, if any
    (reported, not fed through the model, so it is not part of the slot's history)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    stop_token: int | None = None


def aligned_steps(start: int, end: int, alignment: int) -> Iterator[tuple[int, int]]:
    """(lo, hi) steps from `start` to `end` whose ends fall on absolute multiples of A."""
    lo = start
    while lo < end:
        hi = min(end, (lo // alignment + 1) * alignment)
        yield lo, hi
        lo = hi


def cache_arrays(cache: Sequence[Any]) -> list[mx.array]:
    return [a for c in cache if c.keys is not None for a in (c.keys, c.values)]


class Slot:
    """One session of a SlotPool. Operations hold the slot's lock, so a restore never
    interleaves with a decode step of the same slot."""

    def __init__(self, pool: SlotPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.lock = threading.RLock()
        self._state = pool.fresh_state()

    # -- reading -------------------------------------------------------------------------
    @property
    def state(self) -> SlotState:
        return self._state

    @property
    def depth(self) -> int:
        return len(self._state.tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._state.tokens)

    @property
    def logits(self) -> mx.array | None:
        return self._state.logits

    @property
    def logits_witnessed(self) -> bool:
        return self._state.logits is not None

    @property
    def cold(self) -> bool:
        return self._state.cold

    # -- cuts ----------------------------------------------------------------------------
    def export(self) -> Snapshot:
        """The slot's current cut (evaluated views of its cache); EmptySlot on a fresh slot."""
        with self.lock:
            if not self._state.tokens:
                raise EmptySlot(self.index, "export")
            return codec.export(self.pool, self._state)

    def intake(self, layout: Mapping[str, Any]) -> Intake:
        """A shadow for the cut `layout` describes, to be filled in place by a reader and
        then restored (engine/intake.py). Allocates: call it on the thread running MLX.
        RestoreRefused when the layout does not fit this slot's pool."""
        return Intake(self.pool, layout)

    def restore(
        self, cut: Snapshot | Planes | Intake | Source, *, prompt: Sequence[int]
    ) -> Snapshot:
        """Install `cut` as the first cut.depth tokens of the request `prompt` (which the
        caller has matched to the cut's token chain): "exact" when it covers the whole
        prompt, else "ancestor" (then prefill the rest). Planes are decoded first; a
        filled Intake is checked and taken as it is; a Source fills an intake made here
        (whatever it raises propagates). Returns the installed Snapshot; raises a
        RestoreRefused with the slot unchanged when the cut does not decode or fit — a
        cut deeper than the prompt is a ShapeMismatch."""
        shadow = None
        if not isinstance(cut, Snapshot | Planes | Intake):
            if cut.depth > len(prompt):  # before reading a byte
                raise ShapeMismatch("depth (prompt tokens)", f"<= {len(prompt)}", cut.depth)
            snapshot, shadow = read(self.pool, cut)
        elif isinstance(cut, Intake):
            snapshot, shadow = cut.take(self.pool)
        else:
            snapshot = codec.decode(cut) if isinstance(cut, Planes) else cut
        if snapshot.depth > len(prompt):
            raise ShapeMismatch("depth (prompt tokens)", f"<= {len(prompt)}", snapshot.depth)
        mode: restore.Mode = "exact" if snapshot.depth == len(prompt) else "ancestor"
        tokens = prompt[: snapshot.depth]
        restore.restore(self, snapshot, tokens=tokens, mode=mode, shadow=shadow)
        return snapshot

    # -- the swap ------------------------------------------------------------------------
    def commit(self, state: SlotState) -> None:
        """Install a fully prepared state: one reference assignment, which cannot fail."""
        self._state = state

    def reset(self) -> None:
        with self.lock:
            self._state = self.pool.fresh_state()

    # -- compute -------------------------------------------------------------------------
    def prefill(
        self,
        tokens: Sequence[int],
        *,
        on_boundary: Callable[[int], None] | None = None,
        cancel: Cancel = None,
    ) -> int:
        """Append `tokens` to the history in absolute A-aligned steps; returns the depth.

        `on_boundary(depth)` runs after every step that ends on a multiple of A, with the
        slot consistent at that depth (the moment to export an aligned cut). `cancel`
        is checked between steps."""
        steps = self.prefill_steps(tokens, on_boundary=on_boundary)
        while not _cancelled(cancel) and next(steps, None) is not None:
            pass
        return self.depth

    def prefill_steps(
        self, tokens: Sequence[int], *, on_boundary: Callable[[int], None] | None = None
    ) -> Generator[int, None, None]:
        """`prefill` one aligned step per iteration: each yields the depth after its step
        (on_boundary, when due, has run). The tokens are checked before the first step."""
        ids = self.pool.check_tokens(tokens)
        alignment = self.pool.alignment

        def steps() -> Generator[int, None, None]:
            start = self.depth
            for lo, hi in aligned_steps(start, start + len(ids), alignment):
                with self.lock:
                    if lo % alignment:
                        self._state.cold = False
                    self._forward(ids[lo - start : hi - start])
                    if on_boundary is not None and hi % alignment == 0:
                        on_boundary(hi)
                yield hi

        return steps()

    def generate(
        self,
        *,
        max_tokens: int,
        sampling: Sampling = GREEDY,
        stop: Iterable[int] = (),
        on_token: Callable[[int], None] | None = None,
        cancel: Cancel = None,
    ) -> Generation:
        """Decode up to `max_tokens` tokens from the witnessed logits.

        A drawn stop token (eos or one of `stop`) ends the generation and is not fed;
        every other token is fed, then streamed to `on_token`, so afterwards the history
        holds it and the logits stay witnessed. `cancel` is checked before each token."""
        decoding = self.decoding(max_tokens=max_tokens, sampling=sampling, stop=stop)
        while not decoding.done:
            if _cancelled(cancel):
                decoding.cancel()
                break
            drawn = decoding.step()
            if drawn is not None and on_token is not None:
                on_token(drawn.token)
        return decoding.generation

    def decoding(
        self,
        *,
        max_tokens: int,
        sampling: Sampling = GREEDY,
        stop: Iterable[int] = (),
        top_logprobs: int | None = None,
    ) -> Decoding:
        """`generate` one token per Decoding.step; `top_logprobs` (None: no logprobs) asks
        each drawn token for its logprob and that many alternatives."""
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidRequest("max_tokens", f"must be an int >= 0, got {max_tokens!r}")
        stops = frozenset(self.pool.stop_tokens) | frozenset(self.pool.check_tokens(stop))
        with self.lock:
            if self._state.logits is None:
                if not self._state.tokens:
                    raise EmptySlot(self.index, "decode")
                raise LogitsMissing(self.depth)
            sampler = Sampler(
                sampling,
                prompt=self._state.tokens,
                vocab_size=self.pool.vocab_size,
                top_logprobs=top_logprobs,
            )
        return Decoding(self, sampler, max_tokens=max_tokens, stops=stops)

    def _forward(self, tokens: list[int]) -> None:  # mx.array refuses a range or an array
        """One forward over `tokens`; on any failure mid-way the slot is reset, because
        some layers' caches may already hold the step (never leave a partial state)."""
        state = self._state
        try:
            out = self.pool.model(mx.array(tokens, dtype=mx.int32)[None], cache=state.cache)
            logits = out[0, -1]
            mx.eval(logits, cache_arrays(state.cache))
        except BaseException:
            self._state = self.pool.fresh_state()
            raise
        state.tokens.extend(tokens)
        state.logits = logits


def _cancelled(cancel: Cancel) -> bool:
    if cancel is None:
        return False
    if isinstance(cancel, threading.Event):
        return cancel.is_set()
    return bool(cancel())


class Decoding:
    """One generation on a slot, a token at a time (Slot.decoding). `draw()` samples the
    next token from the witnessed logits and returns it (None once done); `feed()` then
    runs it through the model, so the history holds it and the logits stay witnessed.
    A caller that streams draws, sends the token, then feeds: the token leaves before
    its forward, and a hit's first token costs no forward at all. `step()` is both."""

    def __init__(
        self, slot: Slot, sampler: Sampler, *, max_tokens: int, stops: frozenset[int]
    ) -> None:
        self.slot, self.sampler = slot, sampler
        self.max_tokens, self.stops = max_tokens, stops
        self.generation = Generation()
        self.done = max_tokens == 0
        self._unfed: int | None = None  # drawn, not fed yet

    def draw(self) -> Drawn | None:
        """The next token (fed first, should the last draw not have been); None when the
        generation is over: at max_tokens, cancelled, or on a stop token (never fed)."""
        self.feed()
        if self.done:
            return None
        slot, out = self.slot, self.generation
        with slot.lock:
            logits = slot._state.logits
            assert logits is not None  # Slot.decoding refuses a slot without logits
            drawn = self.sampler.draw(logits)
            if drawn.token in self.stops:
                out.finish_reason, out.stop_token = "stop", drawn.token
                self.done = True
                return None
            out.tokens.append(drawn.token)
            slot._state.cold = False
        self._unfed = drawn.token
        self.done = len(out.tokens) >= self.max_tokens  # finish_reason stays "length"
        return drawn

    def feed(self) -> None:
        """Run the drawn token through the model (nothing when it is fed already)."""
        token, self._unfed = self._unfed, None
        if token is not None:
            with self.slot.lock:
                self.slot._forward([token])

    def step(self) -> Drawn | None:
        drawn = self.draw()
        self.feed()
        return drawn

    def cancel(self) -> None:
        """End the generation; a drawn token not fed stays out of the history."""
        self._unfed = None
        if not self.done:
            self.generation.finish_reason = "cancelled"
            self.done = True


class SlotPool:
    """One model and a fixed number of slots; alignment A and identity are the model's.

    At start one probe forward learns what the layout cannot say: the vocabulary size and
    dtype of the logits, and that the caches hold the layout's dtype."""

    def __init__(self, loaded: LoadedModel, *, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise InvalidRequest("num_slots", f"must be an int >= 1, got {num_slots!r}")
        self.loaded = loaded
        self.model = loaded.model
        self.layout: KVLayout = loaded.layout
        self.identity: Identity = loaded.identity
        self.vocab_size, self.logits_dtype = self._probe()
        self.stop_tokens = frozenset(loaded.tokenizer.eos_token_ids)
        self.slots = tuple(Slot(self, i) for i in range(num_slots))

    @property
    def alignment(self) -> int:
        return self.identity.alignment

    def slot(self, index: int) -> Slot:
        if not 0 <= index < len(self.slots):
            raise InvalidRequest("slot", f"no slot {index} (pool has {len(self.slots)})")
        return self.slots[index]

    def fresh_state(self) -> SlotState:
        return SlotState(cache=self.loaded.make_cache(), tokens=[], logits=None)

    def calibrate(self, nbytes: int = CALIBRATION_BYTES) -> int | None:
        """Measure, on this model's buffers of about `nbytes`, from what size a restore's
        shadow is cheaper made without a zero fill on this machine (engine/unfilled.py),
        and make restores follow it; the crossover in bytes (None: no full layers).
        A warm start's step: it allocates and frees `nbytes` a few times."""
        return codec.calibrate(self, nbytes)

    def check_tokens(self, tokens: Iterable[int]) -> list[int]:
        out = [int(t) for t in tokens]
        bad = [t for t in out if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("tokens", f"ids outside [0, {self.vocab_size}): {bad[:5]}")
        return out

    def _probe(self) -> tuple[int, mx.Dtype]:
        cache = self.loaded.make_cache()
        if len(cache) != self.layout.num_layers:
            raise InvalidRequest(
                "model", f"{len(cache)} caches for {self.layout.num_layers} layout layers"
            )
        logits = self.model(mx.array([[0]], dtype=mx.int32), cache=cache)[0, -1]
        mx.eval(logits, cache_arrays(cache))
        for i, c in enumerate(cache):
            if dtype_name(c.keys.dtype) != self.layout.dtype:
                raise InvalidRequest(
                    "model", f"layer {i} caches {c.keys.dtype}, layout says {self.layout.dtype}"
                )
        return int(logits.shape[-1]), logits.dtype
