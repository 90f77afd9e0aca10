"""Sampling: how a slot draws the next token from its witnessed logits.

- Sampling: the settings of one request. First mlx-lm's logits processors
  (mlx_lm.sample_utils), in mlx-lm's order: `logit_bias` (added to the logits), then
  `repetition_penalty` (multiplicative and sign-aware, over the prompt and the completion
  so far; 1 is off), `presence_penalty` (subtracted once from every token the completion
  holds) and `frequency_penalty` (subtracted once per occurrence); 0 is off. Then
  temperature 0 is greedy: the argmax of the processed logits. Otherwise mlx-lm's
  filters on the log-probabilities (`top_p`, `min_p`, `top_k`; 1, 0 and 0 are off) and a
  categorical draw at that temperature, keyed by `seed`.
- key chain: a seeded request starts from `mx.random.key(seed)` and splits it once per
  token, so the same seed from the same state draws the same tokens. (mlx-lm's own
  categorical_sampling reads the global random state, so the draw itself is ours.)
- logprobs: the log-softmax of the processed logits, before temperature and filters:
  the drawn token's, and the `top_logprobs` most likely tokens' when asked.
- Sampler: one request's draws: the processors built once, the history they read, the
  key chain.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_logits_processors,
    make_presence_penalty,
    make_repetition_penalty,
)

from engine.errors import InvalidRequest

WHOLE_HISTORY = 2**31 - 1  # mlx-lm's penalties read the last N tokens (an int32 slice)


def _finite(
    name: str,
    value: float,
    *,
    lo: float = -math.inf,
    hi: float = math.inf,
    lo_open: bool = False,
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (lo < value if lo_open else lo <= value) or value > hi:
        raise InvalidRequest(name, f"must be a finite number in range, got {value!r}")


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise filtered sampling keyed by `seed` (same seed,
    same draw). The defaults change nothing: no processor, no filter."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self) -> None:
        _finite("temperature", self.temperature, lo=0.0)
        _finite("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _finite("min_p", self.min_p, lo=0.0, hi=1.0)
        _finite("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _finite("presence_penalty", self.presence_penalty)
        _finite("frequency_penalty", self.frequency_penalty)
        for name, value in (("top_k", self.top_k), ("seed", self.seed)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
                raise InvalidRequest(name, f"must be an int in [0, 2**64), got {value!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidRequest("logit_bias", f"token ids must be ints >= 0, got {token!r}")
            _finite("logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


@dataclass(frozen=True)
class Drawn:
    """One drawn token; its log-probability and the top alternatives when asked for."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


Processor = Callable[[mx.array, mx.array], mx.array]


class Sampler:
    """Draws for one request: `prompt` is the history before the first draw."""

    def __init__(
        self,
        sampling: Sampling,
        *,
        prompt: Sequence[int],
        vocab_size: int,
        top_logprobs: int | None = None,
    ) -> None:
        bad = [t for t, _ in sampling.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequest("logit_bias", f"token ids outside [0, {vocab_size}): {bad[:5]}")
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.top_logprobs = top_logprobs
        self.history = list(prompt)
        self.completion: list[int] = []
        self.key = None if sampling.greedy else mx.random.key(sampling.seed)
        s = sampling
        bias = make_logits_processors(logit_bias=dict(s.logit_bias)) if s.logit_bias else []
        # (processor, reads the whole history (True) or the completion only)
        self.processors: list[tuple[Processor, bool]] = [(p, False) for p in bias]
        if s.repetition_penalty != 1.0:
            penalty = make_repetition_penalty(s.repetition_penalty, WHOLE_HISTORY)
            self.processors.append((penalty, True))
        if s.presence_penalty:
            penalty = make_presence_penalty(s.presence_penalty, WHOLE_HISTORY)
            self.processors.append((penalty, False))
        if s.frequency_penalty:
            penalty = make_frequency_penalty(s.frequency_penalty, WHOLE_HISTORY)
            self.processors.append((penalty, False))

    def draw(self, logits: mx.array) -> Drawn:
        """The next token from the slot's `logits` (never modified), then remember it."""
        s = self.sampling
        x = logits[None]  # a new array: mlx-lm's processors assign into theirs
        for processor, whole in self.processors:
            seen = self.history if whole else self.completion
            x = processor(mx.array(seen, dtype=mx.int32), x)
        if self.key is None:
            token = int(mx.argmax(x, axis=-1)[0])
            logprobs = None
        else:
            logprobs = _log_softmax(x)
            filtered = logprobs
            if 0.0 < s.top_p < 1.0:
                filtered = apply_top_p(filtered, s.top_p)
            if s.min_p > 0.0:
                filtered = apply_min_p(filtered, s.min_p)
            if 0 < s.top_k < self.vocab_size:
                filtered = apply_top_k(filtered, s.top_k)
            self.key, sub = mx.random.split(self.key)
            token = int(mx.random.categorical(filtered * (1.0 / s.temperature), key=sub)[0])
        self.history.append(token)
        self.completion.append(token)
        if self.top_logprobs is None:
            return Drawn(token)
        if logprobs is None:
            logprobs = _log_softmax(x)
        return Drawn(token, float(logprobs[0, token]), self._top(logprobs))

    def _top(self, logprobs: mx.array) -> tuple[tuple[int, float], ...]:
        n = min(self.top_logprobs or 0, logprobs.shape[-1])
        if n == 0:
            return ()
        ids = mx.argpartition(-logprobs[0], kth=n - 1)[:n]
        values = logprobs[0, ids]
        listed = cast(list[int], ids.tolist()), cast(list[float], values.tolist())
        pairs = zip(*listed, strict=True)
        return tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))


def _log_softmax(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)
