"""One shape for every tier (docs/architecture.md: step 3).

Words:
- ask: what a request asks every tier: the scope, the whole prompt and its token chain,
  and the depth bounds (deeper_than, at_most] of an acceptable answer.
- candidate: a tier's answer to `find`: the deepest cut it could serve within the
  bounds, as depth plus whatever that tier's `load` needs (its handle). Finding has no
  side effects, so the ladder can ask every tier before it loads anything.
- loaded: a candidate's verified state, in a form the engine installs, with what the hit
  bills: bytes from a manifest (durable, remote) or an estimate (resident; invariant 7).
  The forms: a Snapshot (evaluated arrays: the resident tier's), Planes (bytes), or a
  reader — an engine Source (engine/intake.py) whose layout is verified and whose bytes
  the install reads straight into the slot's own buffers (the durable tier's). kvpack
  never decodes any of them; every installer (a slot's restore, mlx-lm caches) takes all
  three. A reader tells after the install what it became (`installed`), which is what a
  cache holds, and is closed after it (a read no install took stops fetching).
- verification failure: the state was refused by a check (a seal, a digest, a MAC, a
  signature, the engine's gate): counted, and the ladder falls through (invariant 9).
- outage: the tier could not answer (store or catalog unreachable, a timeout): the
  ladder falls through without counting a failure; slower, never failed.

A tier implements `Tier`. The ladder (kvpack/tiers/ladder.py) decides which tiers to ask
and in what order; a tier only answers for itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from sqlalchemy.exc import SQLAlchemyError

from cas.errors import ChunkCorrupt, ChunkMissing, ObjectCorrupt, StoreUnavailable, UnknownKey
from catalog.chain import TokenChain
from catalog.errors import ManifestInvalid, StaleGeneration
from catalog.scope import Scope
from engine.errors import RestoreRefused
from engine.intake import Source
from engine.state import Planes, Snapshot

TierName = Literal["resident", "durable", "remote"]


class Refused(Exception):
    """A tier refused state it was about to serve (e.g. a peer's import failed a check);
    `reason` is what was wrong. A verification failure like the typed ones below."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


VERIFICATION_FAILURES: tuple[type[BaseException], ...] = (
    ChunkCorrupt,
    ChunkMissing,
    ObjectCorrupt,
    UnknownKey,
    ManifestInvalid,  # also ManifestMissing: a row whose manifest object is gone
    StaleGeneration,
    RestoreRefused,  # engine: identity, shape, logits, corrupt parts, shadow build
    Refused,
)
OUTAGES: tuple[type[BaseException], ...] = (StoreUnavailable, SQLAlchemyError, TimeoutError)


@dataclass(frozen=True)
class Ask:
    scope: Scope
    tokens: tuple[int, ...]  # the whole prompt
    chain: TokenChain
    deeper_than: int = 0
    at_most: int | None = None

    @classmethod
    def of(cls, scope: Scope, tokens: Sequence[int]) -> Ask:
        tokens = tuple(tokens)
        return cls(scope, tokens, scope.chain(tokens))

    @property
    def depth(self) -> int:
        return len(self.tokens)

    def bounded(self, *, deeper_than: int | None = None, at_most: int | None = None) -> Ask:
        """The same ask with narrower bounds."""
        if deeper_than is not None:
            deeper_than = max(self.deeper_than, deeper_than)
        if at_most is not None and self.at_most is not None:
            at_most = min(self.at_most, at_most)
        return dataclasses.replace(
            self,
            deeper_than=self.deeper_than if deeper_than is None else deeper_than,
            at_most=self.at_most if at_most is None else at_most,
        )


@dataclass(frozen=True)
class Candidate:
    tier: TierName
    depth: int
    handle: Any  # the tier's own: a resident cut, a catalog Cut, a peer's answer


@runtime_checkable
class Reader(Source, Protocol):
    """A loaded cut still to be read by its install (see the words)."""

    @property
    def installed(self) -> Snapshot | None:
        """The Snapshot an install restored this reader as; None before one did."""
        ...

    def close(self) -> None:
        """Let go of a read no install took (its fetch under way); a no-op after one."""
        ...


Cut = Snapshot | Planes | Reader


@dataclass(frozen=True)
class Loaded:
    cut: Cut
    manifest_bytes: int | None = None  # durable and remote: billed from the manifest
    estimated_bytes: int | None = None  # resident: an estimate, labelled so

    def holdable(self) -> Snapshot | Planes | None:
        """What a cache may hold once the cut was installed: the cut itself, or the
        Snapshot a reader was restored as (None when it never was)."""
        return self.cut.installed if isinstance(self.cut, Reader) else self.cut

    def close(self) -> None:
        """After the install, taken or not: a reader lets go of what it still holds."""
        if isinstance(self.cut, Reader):
            self.cut.close()


class Tier(Protocol):
    name: TierName

    def find(self, ask: Ask) -> Candidate | None:
        """The deepest cut this tier can serve within the ask's bounds; no side effects.
        Raises an OUTAGE when the tier cannot answer."""
        ...

    def load(self, candidate: Candidate, ask: Ask) -> Loaded:
        """The candidate's verified state. Raises a VERIFICATION_FAILURE or an OUTAGE."""
        ...

    def served(self, candidate: Candidate, ask: Ask) -> Callable[[], object] | None:
        """After the candidate's state was committed into a slot (a hit): what must follow
        at once is done here; what may wait (a catalog write) is returned, for the ladder
        to run in the background with the hit's other work."""
        ...

    def refused(self, candidate: Candidate, error: BaseException) -> None:
        """After the candidate's state failed verification (it was not served)."""
        ...


class Cache(Tier, Protocol):
    """A tier that holds cuts other tiers served (the resident tier)."""

    def hold(self, scope: Scope, tokens: Sequence[int], cut: Snapshot | Planes) -> object:
        """Hold `cut` (the state after `tokens`); a cut too large to hold is let go."""
        ...
