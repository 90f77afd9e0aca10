"""The resident tier: cuts held in this process, found by a per-scope token radix.

Words (see docs/architecture.md, and kvpack/tiers/radix.py for the two structures):
- resident cut: one cut (the state after exactly `depth` tokens) kept in the form the
  engine installs from: a Snapshot of verified, evaluated MLX arrays, each part interned
  by its part digest. A hit is `Slot.restore(snapshot)` — the gate and the shadow build
  — and neither decodes nor hashes anything.
- holding: Planes (the encoder's output, or bytes a tier verified) are interned by the
  digest each frame already carries; only the parts not interned yet are decoded, once,
  in the background that calls hold. A Snapshot's parts that carry their digest (a
  decoded cut, or the one a durable reader was installed as) are interned by it; the
  arrays of a part not interned yet are copied into buffers of their own, so a held cut
  never keeps a slot's cache buffer alive (an intake's or an export's blocks are views
  of the whole capacity buffer a full layer's cache is) and the budget counts exactly
  what the tier keeps. A Snapshot of a live slot (no digests) is encoded once to name
  its parts. Holding trusts the frames it is given: the encoder's own or verified ones.
- scope: every cut of one identity (kvpack's Scope). Each scope has its own radix and a
  lookup names the scope first, so a cut of another identity is structurally unreachable
  (invariant 1) and swapping identity re-scopes every lookup.
- usable cut: an aligned cut whose tokens are a prefix of the request (an ancestor), or
  a cut equal to the request (exact) — an exact one only with witnessed logits
  (invariant 3). A non-aligned cut is exact-hit-only.
- cap: the ladder bounds every resident answer by the deepest durable-authenticated cut
  (invariant 2); here that is the ask's `at_most`.
- budget: one global byte budget over the tier's *unique* interned bytes (a part shared
  by ten cuts counts once), enforced by evicting least-recently-used cuts.

The resident tier has no manifest to bill from: a hit's bytes are an estimate (the sum
of its parts' lengths) and labelled so (invariant 7).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import mlx.core as mx

from catalog.scope import Scope
from engine.format import decode, encode
from engine.state import Part, Planes, Snapshot
from kvpack.tiers.base import Ask, Candidate, Loaded, TierName
from kvpack.tiers.radix import InternedPart, PartPool, Radix

DEFAULT_BUDGET_BYTES = 8 << 30  # 8 GiB


class ResidentError(Exception):
    """Base of every error the resident tier raises."""


class ResidentInputError(ResidentError, ValueError):
    """A caller passed something the tier cannot hold; `what` names the argument."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"resident tier: bad {what}: {reason}")
        self.what, self.reason = what, reason


@dataclass(frozen=True, eq=False)
class ResidentCut:
    """One resident cut. Holding it keeps its parts alive, even after eviction."""

    scope: Scope
    tokens: tuple[int, ...]
    snapshot: Snapshot = field(repr=False)  # what a hit installs
    parts: tuple[tuple[str, InternedPart], ...] = field(repr=False)

    @property
    def depth(self) -> int:
        return len(self.tokens)

    @property
    def layout(self) -> Mapping[str, Any]:
        return self.snapshot.layout

    @property
    def logits_witnessed(self) -> bool:
        return self.snapshot.logits_witnessed

    @property
    def aligned(self) -> bool:
        return self.depth % self.scope.alignment == 0

    @property
    def unique_parts(self) -> dict[bytes, InternedPart]:
        return {part.digest: part for _, part in self.parts}

    @property
    def estimated_bytes(self) -> int:
        """An ESTIMATE of the bytes a restore of this cut serves: its parts' lengths."""
        return sum(len(part) for _, part in self.parts)


def _detached(part: Part) -> Part:
    """`part` with its arrays copied into buffers of their own (evaluated), so holding it
    keeps no larger buffer alive (MLX arrays are values: the copy is the only way)."""
    arrays = tuple(mx.array(a) for a in part.arrays)
    mx.eval(arrays)
    return dataclasses.replace(part, arrays=arrays)


def _check_tokens(tokens: object) -> tuple[int, ...]:
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise ResidentInputError("tokens", f"must be a sequence of token ids, got {type(tokens)}")
    try:
        out = tuple(operator.index(t) for t in tokens)
    except TypeError as e:
        raise ResidentInputError("tokens", "every token id must be an int") from e
    if not out:
        raise ResidentInputError("tokens", "a cut covers at least one token")
    if any(t < 0 for t in out):
        raise ResidentInputError("tokens", "token ids are non-negative")
    return out


def _check_budget(budget_bytes: object) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ResidentInputError("budget_bytes", f"must be an int >= 0, got {budget_bytes!r}")
    return budget_bytes


class ResidentTier:
    """Per-scope token radix of cuts under one global LRU byte budget. Thread-safe."""

    name: TierName = "resident"

    def __init__(
        self, budget_bytes: int = DEFAULT_BUDGET_BYTES, *, pool: PartPool | None = None
    ) -> None:
        self._budget = _check_budget(budget_bytes)
        self.pool = pool if pool is not None else PartPool()
        self._lock = threading.RLock()
        self._radixes: dict[Scope, Radix[ResidentCut]] = {}
        self._lru: OrderedDict[ResidentCut, None] = OrderedDict()  # oldest first
        self._held: dict[bytes, tuple[InternedPart, int]] = {}  # digest -> (part, holders)
        self._bytes = 0  # unique interned bytes held by resident cuts
        self.evictions = 0

    # -- the tier protocol ------------------------------------------------------------

    def find(self, ask: Ask) -> Candidate | None:
        """The deepest usable cut with depth in (deeper_than, at_most]; no LRU effect."""
        limit = ask.depth if ask.at_most is None else min(ask.at_most, ask.depth)
        with self._lock:
            radix = self._radixes.get(ask.scope)
            if radix is None:
                return None
            best: ResidentCut | None = None
            for cut in radix.path_cuts(ask.tokens):
                if cut.depth > limit:
                    break  # path_cuts goes shallow to deep
                exact = cut.depth == ask.depth
                if cut.depth <= ask.deeper_than or (exact and not cut.logits_witnessed):
                    continue
                if exact or cut.aligned:
                    best = cut
        return None if best is None else Candidate(self.name, best.depth, best)

    def load(self, candidate: Candidate, ask: Ask) -> Loaded:
        cut: ResidentCut = candidate.handle
        return Loaded(cut=cut.snapshot, estimated_bytes=cut.estimated_bytes)

    def served(self, candidate: Candidate, ask: Ask) -> None:
        with self._lock:  # at once: the next find must see the new LRU order
            if candidate.handle in self._lru:
                self._lru.move_to_end(candidate.handle)

    def refused(self, candidate: Candidate, error: BaseException) -> None:
        self.discard(candidate.handle)  # e.g. it failed the engine's gate: never again

    # -- holding cuts -----------------------------------------------------------------

    def hold(
        self, scope: Scope, tokens: Sequence[int], cut: Snapshot | Planes
    ) -> ResidentCut | None:
        """Hold a cut; returns the cut now resident for (scope, tokens), or None when the
        cut alone exceeds the whole budget (it stays durable only, by design).

        Holding the same tokens again replaces the old cut, except that a cut with
        witnessed logits is never replaced by one without (that would silently lose exact
        hits).
        """
        toks = _check_tokens(tokens)
        if cut.depth != len(toks):
            raise ResidentInputError("tokens", f"{len(toks)} tokens for a cut of {cut.depth}")
        if isinstance(cut, Snapshot) and self._too_big(cut):
            return None  # known before copying a cut only to let it go
        snap, interned = self._intern(cut)
        layout = MappingProxyType(copy.deepcopy(dict(snap.layout)))
        held = ResidentCut(
            scope=scope,
            tokens=toks,
            snapshot=dataclasses.replace(
                snap, layout=layout, parts=tuple(i.part for i in interned)
            ),
            parts=tuple((p.role, i) for p, i in zip(snap.parts, interned, strict=True)),
        )
        needed = sum(len(p) for p in held.unique_parts.values())
        with self._lock:
            if needed > self._budget:
                return None
            radix = self._radixes.setdefault(scope, Radix())
            old = radix.get(toks)
            if old is not None and old.logits_witnessed and not held.logits_witnessed:
                self._lru.move_to_end(old)
                return old
            radix.put(toks, held)
            self._lru[held] = None
            self._count(held)
            if old is not None:  # replaced in place: same node, so the radix keeps its shape
                del self._lru[old]
                self._uncount(old)
            self._evict_to(self._budget)
            return held

    def _too_big(self, snap: Snapshot) -> bool:
        """Whether a Snapshot whose parts all carry their digest exceeds the whole budget
        (its unique parts' bytes, as the check after interning counts them)."""
        if any(p.digest is None for p in snap.parts):
            return False
        return sum({p.digest: p.nbytes for p in snap.parts}.values()) > self._budget

    def _intern(self, cut: Snapshot | Planes) -> tuple[Snapshot, list[InternedPart]]:
        """The cut as a Snapshot and its parts interned (see the module words)."""
        if isinstance(cut, Planes):
            alive: dict[bytes, InternedPart] = {}  # held strongly until interned below

            def reuse(role: str, digest: bytes) -> Part | None:
                found = self.pool.get(digest)
                if found is None:
                    return None
                alive[digest] = found
                return found.part

            snap = decode(dataclasses.replace(cut, verified=True), reuse=reuse)
            interned = []
            for part in snap.parts:
                kept = alive.get(part.digest) if part.digest is not None else None
                interned.append(kept if kept is not None else self._intern_part(part, own=True))
            return snap, interned
        if any(p.digest is None for p in cut.parts):
            return self._intern(encode(cut))  # a live slot's cut: name its parts once
        return cut, [self._intern_part(p, own=False) for p in cut.parts]

    def _intern_part(self, part: Part, *, own: bool) -> InternedPart:
        """`part` interned by its digest; `own`: its arrays are its own already (decoded),
        else they are copied into buffers of their own first."""
        assert part.digest is not None
        return self.pool.intern(part.digest, (lambda: part) if own else (lambda: _detached(part)))

    def discard(self, cut: ResidentCut) -> bool:
        """Drop one cut. False if it is not resident."""
        with self._lock:
            radix = self._radixes.get(cut.scope)
            if radix is None or cut not in radix.nodes:
                return False
            self._drop(radix, cut)
            return True

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            self._budget = _check_budget(budget_bytes)
            self._evict_to(self._budget)

    def clear(self) -> None:
        with self._lock:
            self._evict_to(0)

    def contains(self, cut: ResidentCut) -> bool:
        with self._lock:
            radix = self._radixes.get(cut.scope)
            return radix is not None and cut in radix.nodes

    # -- reading ----------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def resident_bytes(self) -> int:
        """Unique interned bytes held by resident cuts (a shared part counts once)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def scopes(self) -> list[Scope]:
        with self._lock:
            return list(self._radixes)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "cuts": len(self._lru),
                "scopes": len(self._radixes),
                "parts": len(self._held),
                "resident_bytes": self._bytes,
                "budget_bytes": self._budget,
                "evictions": self.evictions,
            }

    # -- bookkeeping (under the lock) -------------------------------------------------

    def _count(self, cut: ResidentCut) -> None:
        for digest, part in cut.unique_parts.items():
            held = self._held.get(digest)
            if held is None:
                self._bytes += len(part)
                self._held[digest] = (part, 1)
            else:
                self._held[digest] = (held[0], held[1] + 1)

    def _uncount(self, cut: ResidentCut) -> None:
        for digest in cut.unique_parts:
            part, holders = self._held[digest]
            if holders == 1:
                del self._held[digest]
                self._bytes -= len(part)
            else:
                self._held[digest] = (part, holders - 1)

    def _drop(self, radix: Radix[ResidentCut], cut: ResidentCut) -> None:
        radix.remove(cut)
        del self._lru[cut]
        self._uncount(cut)
        if not radix.nodes:
            del self._radixes[cut.scope]

    def _evict_to(self, budget: int) -> None:
        while self._bytes > budget and self._lru:
            oldest = next(iter(self._lru))
            self._drop(self._radixes[oldest.scope], oldest)
            self.evictions += 1
