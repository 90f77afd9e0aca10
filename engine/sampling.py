"""Sampling: how a slot draws the next token from its witnessed logits.

- Sampling: the settings of one request — temperature 0 is greedy (argmax); otherwise
  top-p (nucleus) sampling at that temperature, keyed by `seed`.
- key chain: a seeded request starts from `mx.random.key(seed)` and splits it once per
  token, so the same seed from the same state draws the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.errors import InvalidRequest


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise top-p sampling keyed by `seed` (same seed, same draw)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise InvalidRequest("seed", f"must be an int in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def draw(logits: mx.array, sampling: Sampling, key: mx.array) -> int:
    """One non-greedy token from `logits` with `key` (a fresh split of the request's chain)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if sampling.top_p < 1.0:
        # Nucleus: keep the most likely tokens whose mass reaches top_p (as mlx-lm does).
        ordered = mx.sort(logprobs, axis=-1)
        probs = mx.exp(ordered)
        above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
        dropped = (above >= sampling.top_p).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(ordered, dropped, axis=-1)
        logprobs = mx.where(logprobs < threshold, -mx.inf, logprobs)
    token = mx.random.categorical(logprobs * (1.0 / sampling.temperature), key=key)
    return int(token)
