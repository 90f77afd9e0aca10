"""Shared helpers for the slot, snapshot, planes and restore tests (not a conftest, so the
models tests in this folder keep their own)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from engine.models import load_model
from engine.slots import Engine, Slot

TINY_A = 64  # small alignment so a few hundred tokens make several blocks
WINDOW = 32  # tiny's sliding window


@lru_cache(maxsize=4)
def tiny(namespace: str = "default", alignment: int = TINY_A):
    return load_model("tiny", alignment=alignment, namespace=namespace)


def tiny_engine(num_slots: int = 2, *, namespace: str = "default") -> Engine:
    return Engine(tiny(namespace), num_slots=num_slots, alignment=TINY_A)


def prompt(n: int, *, seed: int = 1, vocab: int = 256) -> list[int]:
    """Deterministic token ids (bytes for tiny), `n` long."""
    return [int(t) for t in mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()]


@dataclass(frozen=True)
class Continuation:
    """What a slot does next: the bytes of its logits now and after every greedy token
    (so a difference in the last bit of any step shows), and the tokens themselves."""

    logits: tuple[bytes, ...]
    tokens: tuple[int, ...]
    finish: str


def logits_bytes(slot: Slot) -> bytes:
    assert slot.logits is not None
    return bytes(memoryview(slot.logits))


def continue_greedy(slot: Slot, n: int = 32) -> Continuation:
    logits, tokens, finish = [logits_bytes(slot)], [], "length"
    for _ in range(n):
        gen = slot.generate(max_tokens=1)
        if gen.finish_reason == "stop":
            tokens.append(gen.stop_token)
            finish = "stop"
            break
        tokens += gen.tokens
        logits.append(logits_bytes(slot))
    return Continuation(tuple(logits), tuple(tokens), finish)


def physical(slot: Slot) -> list[tuple]:
    """Every layer's cache as it lies in memory: class, buffer shapes and bytes, offset,
    write index. Two slots with equal `physical` compute the same bits from here on."""
    out = []
    for c in slot.state.cache:
        out.append(
            (
                type(c).__name__,
                tuple(c.keys.shape),
                bytes(memoryview(c.keys)),
                bytes(memoryview(c.values)),
                c.offset,
                getattr(c, "_idx", None),
            )
        )
    return out


def cold(engine: Engine, tokens: list[int], slot: int = 0) -> Slot:
    s = engine.slot(slot)
    s.reset()
    s.prefill(tokens)
    return s
