"""The bench's figures and targets, computed from one attempt's receipt, and the tables
that print them.

- leg figures: per leg, time to first token (client side), and from the server's own
  restore measurement (kvpack/service/restores.py) the restore seconds, bytes restored,
  MB/s (10^6 bytes) and the peak RSS added; beside them, from the same run, the
  baselines of the same bytes or state: the floor (cas/floor.py) and, on S3, a raw
  aiobotocore GET of the leg's own cut, timed just before its server started
  (kvpack/bench/probe.py) — each as seconds and as the fraction of the baseline's rate
  the restore reached (baseline seconds / restore seconds, so only for a restore of
  exactly the baseline's bytes) — and mlx-lm's `load_prompt_cache` + one step for the
  prompt's state, with TTFT / that.
- targets: ratios with a bound and met (True), missed (False) or not judged (None: an
  input is missing, e.g. an invalid leg):
  durable restore rate, on the slower of the first restart's two legs, >= 0.5 x the
  floor (local store) or >= 0.7 x the raw GET (S3);
  resident TTFT <= 0.6 x mlx-lm; durable TTFT <= 1.5 x mlx-lm (local) or <= 2.0 x (S3);
  peak RSS added by the durable restore <= 2 x the cut's bytes; the first durable request
  after a restart <= 1.2 x the second (another prompt of the same depth): with more than
  one restart (`restart_legs`), the median of each restart's own ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MB = 1_000_000
PROMPT_A_LEGS = ("cold", "warm", "durable")  # the legs on the prompt the baselines are for


def restart_legs(restart: int) -> tuple[str, str]:
    """The first and second request after restart number `restart` (from 1): durable and
    durable_second, then "durable@2", "durable_second@2" and so on."""
    suffix = "" if restart == 1 else f"@{restart}"
    return f"durable{suffix}", f"durable_second{suffix}"


def base_leg(name: str) -> str:
    """The leg a further restart's leg repeats ("durable@2" -> "durable")."""
    return name.partition("@")[0]


@dataclass(frozen=True)
class StoreBounds:
    """What a durable restore from one kind of store is held to."""

    fraction: str  # the leg figure its restore rate is judged on
    baseline: str  # that figure's baseline, as the target's name says it
    rate: float  # restore rate >= this fraction of the baseline's
    ttft: float  # durable TTFT <= this multiple of mlx-lm's


BOUNDS = {
    "local": StoreBounds("floor_fraction", "floor", 0.5, 1.5),
    "s3": StoreBounds("s3_get_fraction", "raw S3 GET", 0.7, 2.0),
}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def restore_of(leg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The server's record of the leg's restore (None: no restore, or not measured)."""
    records = leg.get("server_restores") or []
    return records[-1] if records else None


def leg_figures(name: str, leg: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    record = restore_of(leg) if leg.get("valid") else None
    seconds = record["seconds"] if record else None
    nbytes = record["bytes"] if record else None
    floor, s3_get = baseline.get("floor"), leg.get("s3_get")
    mlx = (baseline.get("mlx_lm") or {}).get("seconds")

    def beside(base: Mapping[str, Any] | None, same_bytes: int | None) -> tuple[Any, Any]:
        """The baseline beside a durable restore; its fraction if of the same bytes."""
        if base is None or record is None or record["tier"] != "durable":
            return None, None
        same = nbytes == same_bytes
        return base["seconds"], _ratio(base["seconds"], seconds) if same else None

    floor_s, floor_x = beside(floor, floor and floor["bytes"])
    get_s, get_x = beside(s3_get, s3_get and s3_get["cut_bytes"])
    ttft = leg.get("ttft_s") if leg.get("valid") else None
    times = (leg.get("token_times_s") or []) if leg.get("valid") else []
    on_a = base_leg(name) in PROMPT_A_LEGS
    peak = record["peak_rss_added"] if record else None
    return {
        "leg": name,
        "tier": leg.get("tier"),
        "ttft_s": ttft,
        # the wait for the second token: what work the hit left behind costs its decode
        "second_token_s": times[1] - times[0] if len(times) > 1 else None,
        "restore_s": seconds,
        "bytes": nbytes,
        "mb_s": _ratio(nbytes / MB if nbytes is not None else None, seconds),
        "peak_rss_added": peak,
        "peak_rss_per_byte": _ratio(peak, nbytes),
        "floor_s": floor_s,
        "floor_fraction": floor_x,
        "s3_get_s": get_s,
        "s3_get_fraction": get_x,
        "mlx_lm_s": mlx if on_a else None,
        "ttft_vs_mlx_lm": _ratio(ttft, mlx) if on_a else None,
    }


def _holds(value: float, op: str, bound: float) -> bool:
    return value <= bound if op == "<=" else value >= bound


def _target(name: str, value: float | None, op: str, bound: float) -> dict[str, Any]:
    met = None if value is None else _holds(value, op, bound)
    return {"target": name, "value": value, "op": op, "bound": bound, "met": met}


def shown(value: float | None, op: str, bound: float, places: int = 2) -> str:
    """`value` to `places` decimals, or as many more as it takes to print on the same side
    of `bound` as the value itself (0.696 against >= 0.7 prints 0.696, not 0.70)."""
    if value is None:
        return "-"
    holds = _holds(value, op, bound)
    for more in range(places, places + 5):
        text = f"{value:.{more}f}"
        if _holds(float(text), op, bound) == holds:
            return text
    return repr(value)


def targets(figures: Mapping[str, Mapping[str, Any]], store: str | None) -> list[dict[str, Any]]:
    """The restore targets for one attempt; `store` is "s3" or "local" (None: unknown)."""
    warm, durable = figures.get("warm", {}), figures.get("durable", {})
    second = figures.get("durable_second", {})
    bounds = BOUNDS["s3" if store == "s3" else "local"]
    rate = _slower(durable.get(bounds.fraction), second.get(bounds.fraction))
    return [
        _target(f"durable restore rate / {bounds.baseline} (slower leg)", rate, ">=", bounds.rate),
        _target("resident TTFT / mlx-lm", warm.get("ttft_vs_mlx_lm"), "<=", 0.6),
        _target(
            f"durable TTFT / mlx-lm ({store or '?'})",
            durable.get("ttft_vs_mlx_lm"),
            "<=",
            bounds.ttft,
        ),  # fmt: skip
        _target("durable peak RSS added / cut bytes", durable.get("peak_rss_per_byte"), "<=", 2.0),
        _target(
            "first / second request after restart", _median(restart_ratios(figures)), "<=", 1.2
        ),  # fmt: skip
    ]


def restart_ratios(figures: Mapping[str, Mapping[str, Any]]) -> list[float | None]:
    """Per restart, in order: its first request's TTFT over its second's (None where a leg
    is missing or invalid)."""
    out: list[float | None] = []
    while (legs := restart_legs(len(out) + 1))[0] in figures:
        first, second = (figures.get(n, {}) for n in legs)
        out.append(_ratio(first.get("ttft_s"), second.get("ttft_s")))
    return out


def _median(values: list[float | None]) -> float | None:
    """The median, or None when any value is (a restart not judged judges none)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(v for v in values if v is not None)


def _slower(first: float | None, second: float | None) -> float | None:
    """The lower of the two durable legs' rates: the target holds for both restores, not
    the luckier one. None without the first (the leg after the restart)."""
    if first is None:
        return None
    return first if second is None else min(first, second)


def judge_figures(receipt: dict[str, Any], legs: tuple[str, ...]) -> None:
    """Fill `figures` (per leg) and `targets` from the legs and the baselines."""
    baseline = receipt.get("baseline") or {}
    figures = {n: leg_figures(n, receipt["legs"][n], baseline) for n in legs
               if n in receipt["legs"]}  # fmt: skip
    receipt["figures"] = figures
    receipt["targets"] = targets(figures, (baseline.get("export") or {}).get("store"))


FIGURES_HEADER = (
    f"{'depth':>6} {'leg':<16} {'tier':<9} {'ttft_s':>7} {'tok2_s':>6} {'restore_s':>9} {'MB':>7} "
    f"{'MB/s':>7} {'floor_s':>7} {'x floor':>7} {'s3get_s':>7} {'x get':>6} "
    f"{'mlx-lm_s':>8} {'ttft/mlx':>8} {'peak MB':>7}"
)


def num(v: float | None, fmt: str = ".2f") -> str:
    """`v` formatted, or "-" when there is none."""
    return "-" if v is None else format(v, fmt)


def format_figures(receipt: Mapping[str, Any]) -> str:
    rows = []
    for f in receipt.get("figures", {}).values():
        mb = None if f["bytes"] is None else f["bytes"] / MB
        peak = None if f["peak_rss_added"] is None else f["peak_rss_added"] / MB
        rows.append(
            f"{receipt['depth']:>6} {f['leg']:<16} {f['tier'] or '-':<9} "
            f"{num(f['ttft_s'], '.3f'):>7} {num(f['second_token_s'], '.3f'):>6} "
            f"{num(f['restore_s'], '.3f'):>9} "
            f"{num(mb, '.1f'):>7} {num(f['mb_s'], '.0f'):>7} {num(f['floor_s'], '.3f'):>7} "
            f"{num(f['floor_fraction'], '.2f'):>7} {num(f['s3_get_s'], '.3f'):>7} "
            f"{num(f['s3_get_fraction'], '.2f'):>6} {num(f['mlx_lm_s'], '.3f'):>8} "
            f"{num(f['ttft_vs_mlx_lm'], '.2f'):>8} {num(peak, '.1f'):>7}"
        )
    ratios = restart_ratios(receipt.get("figures", {}))
    if len(ratios) > 1:
        rows.append("  first / second per restart: " + ", ".join(num(r) for r in ratios))
    verdict = {True: "met", False: "MISSED", None: "not judged"}
    for t in receipt.get("targets", []):
        rows.append(f"  target {t['target']}: {shown(t['value'], t['op'], t['bound'])} "
                    f"(bound {t['op']} {t['bound']}) {verdict[t['met']]}")  # fmt: skip
    error = (receipt.get("baseline") or {}).get("error")
    if error:
        rows.append(f"  baseline error: {error}")
    return "\n".join(rows)
