"""Derived economics of restores: what a hit saved, and on what evidence (invariant 8).

Words (see docs/architecture.md):
- paired timing: one restore of a cut and the identical local prefill of the same cut,
  both timed in the same process (catalog.ledger.PairedTiming; kvpack/accounting/pairing.py
  makes them). Only paired timings yield speedup or seconds saved; nothing is
  extrapolated from one leg.
- basis: every derived value says where it came from — `measured` (from paired timings
  or counted tokens and parameters) or `mock` (an assumption, never a measurement).
- FLOPs avoided: the floor 2 × params × restored tokens (the weight matmuls alone;
  attention work is left out), so it never overclaims. Its inputs are counted, so its
  basis is `measured`, and its note says it is a floor.
- joules saved: seconds saved × an ASSUMED power draw. With no measured power source it
  is always `mock`.
- economics ledger: the catalog table where paired timings persist (catalog/ledger.py).

Everything here is a pure function of its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from catalog.ledger import PairedTiming

Basis = Literal["measured", "mock"]
MOCK_WATTS = 40.0  # an assumed accelerator draw; placeholder until power is measured


class EconomicsInputError(ValueError):
    """A bad argument; `what` names it."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"economics: bad {what}: {reason}")
        self.what, self.reason = what, reason


@dataclass(frozen=True)
class Derived:
    """One derived figure and the evidence behind it."""

    value: float | None  # None: nothing to derive from (say, no paired timings yet)
    unit: str
    basis: Basis
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "unit": self.unit, "basis": self.basis, "note": self.note}


def _count(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EconomicsInputError(what, f"must be an int >= 0, got {value!r}")
    return value


def restore_speedup(pair: PairedTiming) -> Derived:
    return Derived(
        pair.prefill_seconds / pair.restore_seconds,
        "x",
        "measured",
        "paired: local prefill seconds / restore seconds of the same cut",
    )


def seconds_saved(pair: PairedTiming) -> Derived:
    # Not clamped: a restore slower than prefill is reported as a negative saving.
    return Derived(
        pair.prefill_seconds - pair.restore_seconds,
        "s",
        "measured",
        "paired: local prefill seconds - restore seconds of the same cut",
    )


def flops_avoided(*, num_params: int, restored_tokens: int) -> Derived:
    """The floor 2 × params × restored tokens (weight matmuls only; attention left out)."""
    if _count("num_params", num_params) == 0:
        raise EconomicsInputError("num_params", "a model has at least one parameter")
    _count("restored_tokens", restored_tokens)
    return Derived(
        float(2 * num_params * restored_tokens),
        "FLOP",
        "measured",
        "floor: 2 x params x restored tokens; attention FLOPs not counted",
    )


def joules_saved(saved: Derived, *, watts: float = MOCK_WATTS) -> Derived:
    """Seconds saved × an assumed power draw. Always `mock`: no power source is measured."""
    if isinstance(watts, bool) or not isinstance(watts, (int, float)) or not watts > 0:
        raise EconomicsInputError("watts", f"must be > 0, got {watts!r}")
    if saved.unit != "s":
        raise EconomicsInputError("saved", f"must be seconds saved, got unit {saved.unit!r}")
    value = None if saved.value is None else saved.value * float(watts)
    return Derived(value, "J", "mock", f"mock: seconds saved x an assumed {watts:g} W")


def summarize(
    pairs: Sequence[PairedTiming],
    *,
    num_params: int,
    restored_tokens: int | None = None,
    watts: float = MOCK_WATTS,
) -> dict[str, Any]:
    """The JSON-able economics summary (GET /v1/economics, `kvpack` CLI).

    Speedup and seconds saved aggregate the paired timings (sum of prefill seconds over
    sum of restore seconds). FLOPs avoided counts `restored_tokens` when given (say, the
    tokens restored by every committed hit) and the paired tokens otherwise.
    """
    pairs = list(pairs)
    for k, pair in enumerate(pairs):
        if not isinstance(pair, PairedTiming):
            raise EconomicsInputError("pairs", f"item {k} is not a PairedTiming")
    restore_s = sum(p.restore_seconds for p in pairs)
    prefill_s = sum(p.prefill_seconds for p in pairs)
    paired_tokens = sum(p.depth for p in pairs)
    if pairs:
        speedup = Derived(
            prefill_s / restore_s, "x", "measured", "paired: sum prefill / sum restore"
        )
        saved = Derived(prefill_s - restore_s, "s", "measured", "paired: sum prefill - sum restore")
    else:
        speedup = Derived(None, "x", "measured", "no paired timings yet")
        saved = Derived(None, "s", "measured", "no paired timings yet")
    tokens = (
        paired_tokens if restored_tokens is None else _count("restored_tokens", restored_tokens)
    )
    by_tier: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        row = by_tier.setdefault(
            pair.tier, {"pairs": 0, "tokens": 0, "restore_seconds": 0.0, "prefill_seconds": 0.0}
        )
        row["pairs"] += 1
        row["tokens"] += pair.depth
        row["restore_seconds"] += pair.restore_seconds
        row["prefill_seconds"] += pair.prefill_seconds
    return {
        "pairs": len(pairs),
        "paired_tokens": paired_tokens,
        "restore_seconds": restore_s,
        "prefill_seconds": prefill_s,
        "by_tier": by_tier,
        "speedup": speedup.as_dict(),
        "seconds_saved": saved.as_dict(),
        "flops_avoided": flops_avoided(num_params=num_params, restored_tokens=tokens).as_dict(),
        "joules_saved": joules_saved(saved, watts=watts).as_dict(),
    }
