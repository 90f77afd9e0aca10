"""Typed errors of the engine's slots, planes and restore.

- EngineError: the root; everything the engine raises on purpose is one of these.
- InvalidRequest: the caller passed something unusable (a token outside the vocabulary,
  a bad sampling setting); names the field.
- EmptySlot: an operation needs state the slot does not have yet.
- RestoreRefused: a cut cannot be installed; the slot is left exactly as it was and the
  caller falls through to recompute. Its subclasses say why:
  IdentityMismatch (planes of another identity), ShapeMismatch (planes that do not fit the
  model, the depth or the ring layout), LogitsMissing (a full-depth restore, or a decode,
  without witnessed final logits), PlanesInvalid / PlaneCorrupt (encoded planes that do not
  decode, or whose digest does not match), InstallFailed (building the shadow failed).
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of the engine's typed errors."""


class InvalidRequest(EngineError, ValueError):
    """`field` of a request is unusable; `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class EmptySlot(EngineError):
    """Slot `slot` holds no tokens, so there is nothing to `operation`."""

    def __init__(self, slot: int, operation: str) -> None:
        super().__init__(f"slot {slot} is empty: nothing to {operation}")
        self.slot = slot
        self.operation = operation


class RestoreRefused(EngineError):
    """A cut was not installed; the slot is unchanged. `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class IdentityMismatch(RestoreRefused):
    """Planes made under identity `got` offered to an engine of identity `expected`."""

    def __init__(self, expected: bytes, got: bytes) -> None:
        super().__init__(
            f"identity mismatch: engine {expected.hex()[:12]}, planes {got.hex()[:12]}"
        )
        self.expected = expected
        self.got = got


class ShapeMismatch(RestoreRefused):
    """`what` of the planes is `got` where the model and depth require `expected`."""

    def __init__(self, what: str, expected: object, got: object) -> None:
        super().__init__(f"{what}: expected {expected!r}, got {got!r}")
        self.what = what
        self.expected = expected
        self.got = got


class LogitsMissing(RestoreRefused):
    """Full-depth state at `depth` has no witnessed final logits (invariant 3)."""

    def __init__(self, depth: int) -> None:
        super().__init__(f"no witnessed logits at depth {depth}: not usable as an exact hit")
        self.depth = depth


class PlanesInvalid(RestoreRefused):
    """Encoded planes do not decode: `role` (or the layout when None) is malformed."""

    def __init__(self, role: str | None, reason: str) -> None:
        super().__init__(f"{role or 'layout'}: {reason}")
        self.role = role
        self.detail = reason


class PlaneCorrupt(PlanesInvalid):
    """The bytes of part `role` do not match the digest they carry."""


class InstallFailed(RestoreRefused):
    """Building or evaluating the shadow state failed at `stage`; nothing was swapped."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"install failed at {stage}: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause
