"""The resident tier: cuts held in this process, found by a per-identity token radix.

Words (see DESIGN.md):
- resident cut: one cut (the state after exactly `depth` tokens) kept in memory as its
  plane parts — an ordered list of (role, payload bytes) — plus the engine's `layout`
  dict and whether its final logits were witnessed.
- scope: every cut of one identity. Each identity digest has its own radix; a lookup
  names the identity first, so a cut of another identity is structurally unreachable
  (invariant 1) and swapping identity re-scopes every lookup.
- aligned cut: `depth % alignment == 0`; it may serve as the ancestor of a longer
  request. A non-aligned cut is exact-hit-only.
- exact hit: a cut whose depth equals the request's length. It needs witnessed logits
  (invariant 3); a full-depth cut without logits can still be an ancestor of a longer one.
- cap depth: the deepest durable-authenticated cut for the identity. When a durable
  tier is configured no resident cut deeper than it is ever served (invariant 2).
- block: one payload, interned by its BLAKE3 content digest in the chunk pool. The pool
  holds blocks through weak references only: the cuts' strong references keep bytes
  alive, so cuts that share blocks share memory and an evicted block is freed as soon
  as nothing else holds it.
- budget: one global byte budget over the tier's *unique* interned bytes (a block shared
  by ten cuts counts once), enforced by evicting least-recently-used cuts.
"""

from __future__ import annotations

import copy
import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import blake3

DEFAULT_BUDGET_BYTES = 8 << 30  # 8 GiB


class ResidentError(Exception):
    """Base of every error the resident tier raises."""


class ResidentInputError(ResidentError, ValueError):
    """A caller passed something the tier cannot hold; `what` names the argument."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"resident tier: bad {what}: {reason}")
        self.what, self.reason = what, reason


class AlignmentMismatch(ResidentError, ValueError):
    """An identity's cuts were stored under one alignment and this call names another."""

    def __init__(self, identity: bytes, expected: int, got: int) -> None:
        super().__init__(
            f"identity {identity[:6].hex()} uses alignment {expected}, call passed {got}"
        )
        self.identity, self.expected, self.got = identity, expected, got


class CutTooLarge(ResidentError):
    """One cut's unique bytes exceed the whole budget, so it can never be resident."""

    def __init__(self, needed: int, budget: int) -> None:
        super().__init__(f"cut needs {needed} unique bytes, resident budget is {budget}")
        self.needed, self.budget = needed, budget


class Block:
    """One interned payload. `bytes` cannot be weakly referenced, so the pool holds these."""

    __slots__ = ("digest", "data", "__weakref__")

    def __init__(self, digest: bytes, data: bytes) -> None:
        self.digest = digest
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"Block({self.digest[:6].hex()}, {len(self.data)} bytes)"


class ChunkPool:
    """Content-addressed payloads held through weak references only.

    Interning the same content twice returns the same Block while anyone still holds it;
    the pool never keeps bytes alive on its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: weakref.WeakValueDictionary[bytes, Block] = weakref.WeakValueDictionary()

    @staticmethod
    def digest(data: bytes) -> bytes:
        return blake3.blake3(data).digest()

    def intern(self, data: bytes | bytearray | memoryview) -> Block:
        payload = bytes(data)  # own an immutable copy; a caller's buffer may change later
        digest = self.digest(payload)  # hashed outside the lock: the slow part
        with self._lock:
            block = self._blocks.get(digest)
            if block is None:
                block = Block(digest, payload)
                self._blocks[digest] = block
            return block

    def get(self, digest: bytes) -> Block | None:
        with self._lock:
            return self._blocks.get(digest)

    def live_blocks(self) -> int:
        with self._lock:
            return len(self._blocks)

    def live_bytes(self) -> int:
        """Bytes of every block still alive, whoever holds it (the tier or a caller)."""
        with self._lock:
            return sum(len(b) for b in self._blocks.values())


@dataclass(frozen=True, eq=False)
class ResidentCut:
    """One resident cut. Holding it keeps its blocks alive, even after eviction."""

    identity: bytes
    tokens: tuple[int, ...]
    alignment: int
    layout: Mapping[str, Any]
    logits_witnessed: bool
    blocks: tuple[tuple[str, Block], ...] = field(repr=False)

    @property
    def depth(self) -> int:
        return len(self.tokens)

    @property
    def aligned(self) -> bool:
        return self.depth % self.alignment == 0

    @property
    def parts(self) -> list[tuple[str, bytes]]:
        """The plane parts in order, as (role, payload) — what engine/planes decodes."""
        return [(role, block.data) for role, block in self.blocks]

    @property
    def unique_blocks(self) -> dict[bytes, Block]:
        return {block.digest: block for _, block in self.blocks}


class _Node:
    """A radix node: the edge from its parent is a run of tokens."""

    __slots__ = ("edge", "children", "cut", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.cut: ResidentCut | None = None


class _Scope:
    """The radix of one identity."""

    __slots__ = ("alignment", "root", "nodes")

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.root = _Node((), None)
        self.nodes: dict[ResidentCut, _Node] = {}  # cut -> the node that holds it

    def find_node(self, tokens: tuple[int, ...]) -> _Node | None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tokens[i : i + len(child.edge)] != child.edge:
                return None
            node, i = child, i + len(child.edge)
        return node

    def ensure_node(self, tokens: tuple[int, ...]) -> _Node:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:], node)
                node.children[tokens[i]] = leaf
                return leaf
            common = _common_prefix(child.edge, tokens, i)
            if common < len(child.edge):
                # Split the edge: a new middle node takes the shared run.
                mid = _Node(child.edge[:common], node)
                node.children[tokens[i]] = mid
                child.edge = child.edge[common:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + common
        return node

    def path_cuts(self, tokens: tuple[int, ...]) -> Iterable[ResidentCut]:
        """Every cut whose tokens are a prefix of `tokens`, shallow to deep."""
        node, i = self.root, 0
        while True:
            if node.cut is not None:
                yield node.cut
            if i >= len(tokens):
                return
            child = node.children.get(tokens[i])
            if child is None or tokens[i : i + len(child.edge)] != child.edge:
                return
            node, i = child, i + len(child.edge)

    def remove(self, cut: ResidentCut) -> None:
        node = self.nodes.pop(cut)
        node.cut = None
        # Prune empty leaves, then fold a cut-less single-child node into its child.
        while node.parent is not None and node.cut is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
        if node.parent is not None and node.cut is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[child.edge[0]] = child

    def __len__(self) -> int:
        return len(self.nodes)


def _common_prefix(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    for k in range(n):
        if edge[k] != tokens[start + k]:
            return k
    return n


def _check_identity(identity: object) -> bytes:
    if not isinstance(identity, bytes) or not identity:
        raise ResidentInputError("identity", "must be the non-empty identity digest bytes")
    return identity


def _check_tokens(tokens: object, *, allow_empty: bool) -> tuple[int, ...]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ResidentInputError("tokens", f"must be a sequence of token ids, got {type(tokens)}")
    try:
        out = tuple(operator.index(t) for t in tokens)
    except TypeError as e:
        raise ResidentInputError("tokens", "every token id must be an int") from e
    if not allow_empty and not out:
        raise ResidentInputError("tokens", "a cut covers at least one token")
    if any(t < 0 for t in out):
        raise ResidentInputError("tokens", "token ids are non-negative")
    return out


def _check_alignment(alignment: object) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ResidentInputError("alignment", f"must be a positive int, got {alignment!r}")
    return alignment


def _check_parts(parts: object) -> list[tuple[str, bytes | bytearray | memoryview]]:
    if not isinstance(parts, Sequence) or isinstance(parts, (str, bytes)):
        raise ResidentInputError("parts", "must be a sequence of (role, payload) pairs")
    checked = []
    for k, part in enumerate(parts):
        if not isinstance(part, tuple) or len(part) != 2:
            raise ResidentInputError("parts", f"part {k} is not a (role, payload) pair")
        role, payload = part
        if not isinstance(role, str) or not role:
            raise ResidentInputError("parts", f"part {k} has no role name")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ResidentInputError("parts", f"part {k} ({role}) payload is not bytes")
        checked.append((role, payload))
    if not checked:
        raise ResidentInputError("parts", "a cut has at least one plane part")
    return checked


class ResidentTier:
    """Per-identity token radix of cuts under one global LRU byte budget. Thread-safe."""

    def __init__(
        self, budget_bytes: int = DEFAULT_BUDGET_BYTES, *, pool: ChunkPool | None = None
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ResidentInputError("budget_bytes", f"must be an int >= 0, got {budget_bytes!r}")
        self._budget = budget_bytes
        self.pool = pool if pool is not None else ChunkPool()
        self._lock = threading.RLock()
        self._scopes: dict[bytes, _Scope] = {}
        self._lru: OrderedDict[ResidentCut, None] = OrderedDict()  # oldest first
        self._held: dict[bytes, tuple[Block, int]] = {}  # digest -> (block, cuts holding it)
        self._bytes = 0  # unique interned bytes held by resident cuts
        self.evictions = 0

    # -- writes ---------------------------------------------------------------

    def insert(
        self,
        *,
        identity: bytes,
        tokens: Sequence[int],
        alignment: int,
        layout: Mapping[str, Any],
        parts: Sequence[tuple[str, bytes | bytearray | memoryview]],
        logits_witnessed: bool,
    ) -> ResidentCut:
        """Hold a cut; returns the cut now resident for (identity, tokens).

        Re-inserting the same tokens replaces the old cut, except that a cut with witnessed
        logits is never replaced by one without (that would silently lose exact hits).
        """
        identity = _check_identity(identity)
        toks = _check_tokens(tokens, allow_empty=False)
        alignment = _check_alignment(alignment)
        if not isinstance(layout, Mapping):
            raise ResidentInputError("layout", "must be a mapping (the engine's layout dict)")
        if not isinstance(logits_witnessed, bool):
            raise ResidentInputError("logits_witnessed", "must be a bool")
        checked = _check_parts(parts)
        blocks = tuple((role, self.pool.intern(payload)) for role, payload in checked)
        cut = ResidentCut(
            identity=identity,
            tokens=toks,
            alignment=alignment,
            layout=MappingProxyType(copy.deepcopy(dict(layout))),
            logits_witnessed=logits_witnessed,
            blocks=blocks,
        )
        needed = sum(len(b) for b in cut.unique_blocks.values())
        with self._lock:
            if needed > self._budget:
                raise CutTooLarge(needed, self._budget)
            scope = self._scopes.get(identity)
            if scope is not None and scope.alignment != alignment:
                raise AlignmentMismatch(identity, scope.alignment, alignment)
            if scope is None:
                scope = self._scopes[identity] = _Scope(alignment)
            node = scope.ensure_node(toks)
            old = node.cut
            if old is not None and old.logits_witnessed and not logits_witnessed:
                self._lru.move_to_end(old)
                return old
            node.cut = cut
            scope.nodes[cut] = node
            self._lru[cut] = None
            self._hold(cut)
            if old is not None:  # replaced in place: same node, so the radix keeps its shape
                del scope.nodes[old]
                del self._lru[old]
                self._release(old)
            self._evict_to(self._budget)
            return cut

    def discard(self, cut: ResidentCut) -> bool:
        """Drop one cut (say, it failed the engine's shape gate). False if not resident."""
        with self._lock:
            scope = self._scopes.get(cut.identity)
            if scope is None or cut not in scope.nodes:
                return False
            self._drop(scope, cut)
            return True

    def set_budget(self, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ResidentInputError("budget_bytes", f"must be an int >= 0, got {budget_bytes!r}")
        with self._lock:
            self._budget = budget_bytes
            self._evict_to(budget_bytes)

    def clear(self) -> None:
        with self._lock:
            self._evict_to(0)

    def _hold(self, cut: ResidentCut) -> None:
        for digest, block in cut.unique_blocks.items():
            held = self._held.get(digest)
            if held is None:
                self._bytes += len(block)
                self._held[digest] = (block, 1)
            else:
                self._held[digest] = (held[0], held[1] + 1)

    def _release(self, cut: ResidentCut) -> None:
        for digest in cut.unique_blocks:
            block, holders = self._held[digest]
            if holders == 1:
                del self._held[digest]
                self._bytes -= len(block)
            else:
                self._held[digest] = (block, holders - 1)

    def _drop(self, scope: _Scope, cut: ResidentCut) -> None:
        scope.remove(cut)
        del self._lru[cut]
        self._release(cut)
        if not scope.nodes:
            del self._scopes[cut.identity]

    def _evict_to(self, budget: int) -> None:
        while self._bytes > budget and self._lru:
            oldest = next(iter(self._lru))
            self._drop(self._scopes[oldest.identity], oldest)
            self.evictions += 1

    # -- reads ----------------------------------------------------------------

    def lookup(
        self,
        *,
        identity: bytes,
        tokens: Sequence[int],
        alignment: int,
        cap_depth: int | None,
    ) -> ResidentCut | None:
        """The deepest cut that may serve `tokens` under `identity`, or None.

        Usable: an aligned cut whose tokens are a prefix of the request, or any cut equal to
        the request; an exact (full-depth) cut only with witnessed logits. `cap_depth` is the
        deepest durable-authenticated cut for this identity (0 when there is none) or None
        when no durable tier is configured; nothing deeper than it is served.
        """
        identity = _check_identity(identity)
        toks = _check_tokens(tokens, allow_empty=True)
        alignment = _check_alignment(alignment)
        if cap_depth is not None and (
            isinstance(cap_depth, bool) or not isinstance(cap_depth, int) or cap_depth < 0
        ):
            raise ResidentInputError("cap_depth", f"must be None or an int >= 0, got {cap_depth!r}")
        limit = len(toks) if cap_depth is None else min(cap_depth, len(toks))
        with self._lock:
            scope = self._scopes.get(identity)
            if scope is None:
                return None
            if scope.alignment != alignment:
                raise AlignmentMismatch(identity, scope.alignment, alignment)
            best: ResidentCut | None = None
            for cut in scope.path_cuts(toks):
                if cut.depth > limit:
                    break  # path_cuts goes shallow to deep
                exact = cut.depth == len(toks)
                if exact and not cut.logits_witnessed:
                    continue  # invariant 3: an exact hit needs witnessed logits
                if exact or cut.aligned:
                    best = cut
            if best is not None:
                self._lru.move_to_end(best)
            return best

    def estimated_bytes(self, cut: ResidentCut) -> int:
        """An ESTIMATE of the bytes a restore of `cut` serves: the sum of its payload lengths.

        The resident tier has no manifest to bill from (invariant 7), so this counts what
        the engine copies out, not stored or transferred bytes.
        """
        return sum(len(block) for _, block in cut.blocks)

    def contains(self, cut: ResidentCut) -> bool:
        with self._lock:
            scope = self._scopes.get(cut.identity)
            return scope is not None and cut in scope.nodes

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def resident_bytes(self) -> int:
        """Unique interned bytes held by resident cuts (a shared block counts once)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def identities(self) -> list[bytes]:
        with self._lock:
            return list(self._scopes)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "cuts": len(self._lru),
                "identities": len(self._scopes),
                "blocks": len(self._held),
                "resident_bytes": self._bytes,
                "budget_bytes": self._budget,
                "evictions": self.evictions,
            }
