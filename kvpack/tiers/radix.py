"""The resident tier's two data structures: a token radix and a pool of interned parts.

- radix: the cuts of one scope, found by their tokens. Each node's edge is a run of
  tokens; a node holds at most one cut (the state after exactly its path's tokens).
  `path_cuts(tokens)` walks the request's path and yields every cut on it, shallow to
  deep: the cuts whose tokens are a prefix of the request.
- interned part: one part of a cut as the engine installs it (engine.state's Part: its
  evaluated MLX arrays), named by its part digest — the digest its frame carries, read
  and not computed again. The pool holds parts through weak references only: the
  resident cuts' strong references keep them alive, so cuts that share a part share its
  memory and a part nothing holds any more is freed at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from engine.state import Part

C = TypeVar("C")


class InternedPart:
    """One interned part: its digest and the engine's Part (which holds the arrays)."""

    __slots__ = ("digest", "part", "nbytes", "__weakref__")

    def __init__(self, digest: bytes, part: Part) -> None:
        self.digest = digest
        self.part = part
        self.nbytes = part.nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"InternedPart({self.part.role}, {self.digest[:6].hex()}, {self.nbytes} bytes)"


class PartPool:
    """Parts by digest, held through weak references only.

    Interning a digest twice returns the same InternedPart while anyone still holds it;
    the pool never keeps arrays alive on its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: weakref.WeakValueDictionary[bytes, InternedPart] = (
            weakref.WeakValueDictionary()
        )

    def intern(self, digest: bytes, make: Callable[[], Part]) -> InternedPart:
        """The live part named `digest`, or the one `make()` builds (called only when
        none is alive, outside the lock: building is the slow part)."""
        with self._lock:
            part = self._parts.get(digest)
        if part is not None:
            return part
        made = make()
        with self._lock:
            part = self._parts.get(digest)  # another thread may have won meanwhile
            if part is None:
                part = InternedPart(digest, made)
                self._parts[digest] = part
            return part

    def get(self, digest: bytes) -> InternedPart | None:
        with self._lock:
            return self._parts.get(digest)

    def live_parts(self) -> int:
        with self._lock:
            return len(self._parts)

    def live_bytes(self) -> int:
        """Bytes of every part still alive, whoever holds it (the tier or a caller)."""
        with self._lock:
            return sum(len(p) for p in self._parts.values())


class _Node(Generic[C]):
    """A radix node: the edge from its parent is a run of tokens."""

    __slots__ = ("edge", "children", "cut", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node[C] | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[int, _Node[C]] = {}
        self.cut: C | None = None


class Radix(Generic[C]):
    """The cuts of one scope, by token path. Not thread-safe: the tier holds its lock."""

    def __init__(self) -> None:
        self.root: _Node[C] = _Node((), None)
        self.nodes: dict[C, _Node[C]] = {}  # cut -> the node that holds it

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, tokens: tuple[int, ...]) -> C | None:
        node = self._ensure(tokens, create=False)
        return None if node is None else node.cut

    def put(self, tokens: tuple[int, ...], cut: C) -> C | None:
        """Hold `cut` at `tokens`; returns the cut it replaced there, if any."""
        node = self._ensure(tokens, create=True)
        assert node is not None
        old, node.cut = node.cut, cut
        if old is not None:
            del self.nodes[old]
        self.nodes[cut] = node
        return old

    def path_cuts(self, tokens: tuple[int, ...]) -> Iterable[C]:
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

    def remove(self, cut: C) -> None:
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

    def _ensure(self, tokens: tuple[int, ...], *, create: bool) -> _Node[C] | None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                if not create:
                    return None
                leaf: _Node[C] = _Node(tokens[i:], node)
                node.children[tokens[i]] = leaf
                return leaf
            common = _common_prefix(child.edge, tokens, i)
            if common < len(child.edge):
                if not create:
                    return None
                # Split the edge: a new middle node takes the shared run.
                mid: _Node[C] = _Node(child.edge[:common], node)
                node.children[tokens[i]] = mid
                child.edge = child.edge[common:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + common
        return node


def _common_prefix(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    for k in range(n):
        if edge[k] != tokens[start + k]:
            return k
    return n
