"""Shared helpers for the slot, codec and restore tests (not a conftest, so the models
tests in this folder keep their own)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx

from engine.format import encode
from engine.models import load_model
from engine.slots import Slot, SlotPool
from engine.state import Snapshot

TINY_A = 64  # small alignment so a few hundred tokens make several blocks
WINDOW = 32  # tiny's sliding window


@lru_cache(maxsize=4)
def tiny(namespace: str = "default", alignment: int = TINY_A):
    return load_model("tiny", alignment=alignment, namespace=namespace)


def tiny_pool(num_slots: int = 2, *, namespace: str = "default") -> SlotPool:
    return SlotPool(tiny(namespace), num_slots=num_slots)


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


def cold(pool: SlotPool, tokens: list[int], slot: int = 0) -> Slot:
    s = pool.slot(slot)
    s.reset()
    s.prefill(tokens)
    return s


# -- cuts made wrong on purpose ------------------------------------------------------------
def replace_part(snap: Snapshot, role: str, **changes: Any) -> Snapshot:
    """`snap` with part `role` changed (its arrays or fields), the layout left as it was."""
    assert role in [p.role for p in snap.parts], role
    parts = tuple(dataclasses.replace(p, **changes) if p.role == role else p for p in snap.parts)
    return dataclasses.replace(snap, parts=parts)


def edit_layout(snap: Snapshot, edit: Callable[[dict], None]) -> Snapshot:
    """`snap` with `edit` applied to a deep copy of its layout."""
    layout = copy.deepcopy(dict(snap.layout))
    edit(layout)
    return dataclasses.replace(snap, layout=layout)


def drop_logits(snap: Snapshot) -> Snapshot:
    """The same cut as if its logits had never been witnessed."""
    bare = edit_layout(snap, lambda layout: layout.update(logits=None))
    return dataclasses.replace(bare, parts=tuple(p for p in snap.parts if p.kind != "logits"))


def flip(data: bytes | memoryview, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


@dataclass
class Victim:
    """A pool whose slot 1 holds another prompt, what that slot would do next (computed on
    a twin slot, 2), and a good cut of PROMPT (decoded a little, so its ring is rotated)."""

    pool: SlotPool
    slot: Slot
    snap: Snapshot
    tokens: tuple[int, ...]
    expected: Continuation

    def assert_untouched(self, before: Any) -> None:
        assert self.slot.state is before
        assert continue_greedy(self.slot, 12) == self.expected


PROMPT = prompt(300)  # more than nine windows: every ring has wrapped


def victim() -> Victim:
    pool = tiny_pool(3)
    expected = continue_greedy(cold(pool, prompt(90, seed=6), 2), 12)
    slot = cold(pool, prompt(90, seed=6), 1)
    a = cold(pool, PROMPT, 0)
    a.generate(max_tokens=3, stop=())
    return Victim(pool, slot, a.export(), a.tokens, expected)


def assert_reuse_is_bit_identical(pool: SlotPool, tokens: list[int], *, ancestor: int, steps: int):
    """Cold prefill of `tokens` in slot 0, exporting the aligned cut at `ancestor` as it
    passes; then, in slot 1, the exact cut and the ancestor (+ prefill of the rest), each
    through its planes: both leave the cold run's cache bytes and continue like it for
    `steps` greedy tokens (logits bytes after each). Returns the exact cut's planes."""
    assert ancestor % pool.alignment == 0 and 0 < ancestor < len(tokens)
    cuts: dict[int, Snapshot] = {}
    a = pool.slot(0)
    a.reset()
    a.prefill(tokens, on_boundary=lambda d: cuts.setdefault(d, a.export()))
    exact = encode(a.export())
    state = physical(a)
    reference = continue_greedy(a, steps)
    b = pool.slot(1)
    b.reset()
    b.restore(exact, prompt=tokens)
    assert physical(b) == state
    assert continue_greedy(b, steps) == reference
    b.reset()
    b.restore(encode(cuts[ancestor]), prompt=tokens)
    assert b.depth == ancestor
    b.prefill(tokens[ancestor:])
    assert physical(b) == state
    assert continue_greedy(b, steps) == reference
    return exact
