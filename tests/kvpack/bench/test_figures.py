"""kvpack bench's figures and targets: computed from the legs, the server's restore
records and the baselines they are given (random inputs, so no result is built in), and
printed; a bad depth is refused before anything runs."""

from __future__ import annotations

import random

import pytest

from kvpack import cli
from kvpack.bench.figures import MB, format_figures, judge_figures, restart_legs
from kvpack.bench.serve import LEGS, BadDepth, check_depths, leg_names

MIB = 1 << 20


def leg(
    tier: str,
    ttft: float,
    restore: dict | None = None,
    *,
    valid: bool = True,
    gaps: tuple[float, ...] = (),
) -> dict:
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return {"valid": valid, "tier": tier, "ttft_s": ttft, "token_times_s": times,
            "server_restores": [] if restore is None else [restore]}  # fmt: skip


def record(tier: str, seconds: float, nbytes: int, peak: int) -> dict:
    return {"tier": tier, "depth": 2048, "seconds": seconds, "bytes": nbytes,
            "rss_before": 10 * MIB, "peak_rss_added": peak}  # fmt: skip


def attempt(rng: random.Random, *, store: str) -> dict:
    cut = rng.randrange(50, 150) * MIB
    legs = {
        "cold": leg("none", rng.uniform(1, 2)),
        "warm": leg("resident", rng.uniform(0.01, 0.1),
                    record("resident", rng.uniform(0.001, 0.01), cut, rng.randrange(MIB))),
        "miss": leg("none", rng.uniform(0.1, 0.2)),
        "second": leg("none", rng.uniform(1, 2)),
        "durable": leg("durable", rng.uniform(0.05, 0.3),
                       record("durable", rng.uniform(0.02, 0.2), cut, rng.randrange(3 * cut)),
                       gaps=(rng.uniform(0.1, 2), rng.uniform(0.1, 0.2))),
        "durable_second": leg("durable", rng.uniform(0.05, 0.3),
                              record("durable", rng.uniform(0.02, 0.2), cut, 0)),
    }  # fmt: skip
    if store == "s3":  # each durable leg's own GET, of its cut's sealed chunks
        for name in ("durable", "durable_second"):
            legs[name]["s3_get"] = {"seconds": rng.uniform(0.01, 0.2), "bytes": cut + 4096,
                                    "cut_bytes": cut}  # fmt: skip
    baseline = {
        "export": {"store": store, "cut_bytes": cut},
        "floor": {"bytes": cut, "seconds": rng.uniform(0.01, 0.1)},
        "mlx_lm": {"seconds": rng.uniform(0.05, 0.2)},
        "error": None,
    }
    return {"depth": 2048, "legs": legs, "baseline": baseline}


def by_name(receipt: dict) -> dict:
    return {t["target"]: t for t in receipt["targets"]}


@pytest.mark.parametrize("seed", range(5))
def test_figures_and_targets_on_a_local_store_follow_from_the_inputs(seed):
    """Restore seconds and bytes come from the server's records, MB/s from those; the
    floor fraction is floor seconds / restore seconds of the same bytes; TTFT over mlx-lm
    for the legs of the baseline's prompt only; each target's value, bound and verdict."""
    rng = random.Random(seed)
    receipt = attempt(rng, store="local")
    judge_figures(receipt, LEGS)
    legs, base, fig = receipt["legs"], receipt["baseline"], receipt["figures"]
    mlx = base["mlx_lm"]["seconds"]
    dur = legs["durable"]["server_restores"][0]
    assert fig["durable"]["restore_s"] == dur["seconds"] and fig["durable"]["bytes"] == dur["bytes"]
    assert fig["durable"]["mb_s"] == pytest.approx(dur["bytes"] / MB / dur["seconds"])
    assert fig["durable"]["floor_s"] == base["floor"]["seconds"]
    floor_x = base["floor"]["seconds"] / dur["seconds"]
    assert fig["durable"]["floor_fraction"] == pytest.approx(floor_x)
    floor_x2 = base["floor"]["seconds"] / legs["durable_second"]["server_restores"][0]["seconds"]
    assert fig["durable"]["s3_get_s"] is None and fig["warm"]["floor_s"] is None
    assert fig["cold"]["restore_s"] is None and fig["cold"]["mb_s"] is None
    assert fig["warm"]["ttft_vs_mlx_lm"] == pytest.approx(legs["warm"]["ttft_s"] / mlx)
    assert fig["second"]["ttft_vs_mlx_lm"] is None  # another prompt: not the same state
    times = legs["durable"]["token_times_s"]
    assert fig["durable"]["second_token_s"] == pytest.approx(times[1] - times[0])
    assert fig["cold"]["second_token_s"] is None  # one token streamed: no second

    targets = by_name(receipt)
    expected = {
        "durable restore rate / floor (slower leg)": (min(floor_x, floor_x2), ">=", 0.5),
        "resident TTFT / mlx-lm": (legs["warm"]["ttft_s"] / mlx, "<=", 0.6),
        "durable TTFT / mlx-lm (local)": (legs["durable"]["ttft_s"] / mlx, "<=", 1.5),
        "durable peak RSS added / cut bytes": (dur["peak_rss_added"] / dur["bytes"], "<=", 2.0),
        "first / second request after restart": (
            legs["durable"]["ttft_s"] / legs["durable_second"]["ttft_s"], "<=", 1.2),
    }  # fmt: skip
    assert set(targets) == set(expected)
    for name, (value, op, bound) in expected.items():
        t = targets[name]
        assert (t["value"], t["op"], t["bound"]) == (pytest.approx(value), op, bound)
        assert t["met"] is (value >= bound if op == ">=" else value <= bound)

    text = format_figures(receipt)
    assert f"{fig['durable']['floor_fraction']:.2f}" in text
    assert f" {fig['durable']['second_token_s']:.3f} " in text
    for t in receipt["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        assert f"target {t['target']}: {t['value']:.2f} (bound {t['op']} {t['bound']}) " \
               f"{verdict}" in text  # fmt: skip


def test_on_s3_each_restore_is_judged_against_its_own_raw_get_and_ttft_has_the_s3_bound():
    receipt = attempt(random.Random(7), store="s3")
    judge_figures(receipt, LEGS)
    legs, figs = receipt["legs"], receipt["figures"]
    get_x, get_x2 = (legs[n]["s3_get"]["seconds"] / figs[n]["restore_s"]
                     for n in ("durable", "durable_second"))  # fmt: skip
    assert figs["durable"]["s3_get_s"] == legs["durable"]["s3_get"]["seconds"]
    assert figs["durable"]["s3_get_fraction"] == pytest.approx(get_x)
    assert figs["durable_second"]["s3_get_fraction"] == pytest.approx(get_x2)
    targets = by_name(receipt)
    rate = targets["durable restore rate / raw S3 GET (slower leg)"]
    assert rate["value"] == pytest.approx(min(get_x, get_x2)) and rate["bound"] == 0.7
    assert targets["durable TTFT / mlx-lm (s3)"]["bound"] == 2.0
    assert "durable restore rate / floor (slower leg)" not in targets
    # A GET of other bytes than the restore's is shown but gives no fraction.
    receipt = attempt(random.Random(8), store="s3")
    receipt["legs"]["durable_second"]["s3_get"]["cut_bytes"] += 1
    judge_figures(receipt, LEGS)
    second = receipt["figures"]["durable_second"]
    assert second["s3_get_s"] is not None and second["s3_get_fraction"] is None
    rate = by_name(receipt)["durable restore rate / raw S3 GET (slower leg)"]
    assert rate["value"] == pytest.approx(receipt["figures"]["durable"]["s3_get_fraction"])


def test_a_missing_input_is_not_judged_and_other_bytes_get_no_fraction():
    """An invalid durable leg: its figures are None and so are the targets that need it;
    a restore of other bytes than the floor's gets the floor beside it but no fraction."""
    receipt = attempt(random.Random(3), store="local")
    receipt["legs"]["durable"]["valid"] = False
    receipt["legs"]["durable_second"]["server_restores"][0]["bytes"] += 1
    judge_figures(receipt, LEGS)
    targets = by_name(receipt)
    assert targets["durable restore rate / floor (slower leg)"]["met"] is None
    assert targets["durable TTFT / mlx-lm (local)"]["met"] is None
    assert targets["first / second request after restart"]["met"] is None
    assert targets["resident TTFT / mlx-lm"]["met"] is not None
    second = receipt["figures"]["durable_second"]
    assert second["floor_s"] is not None and second["floor_fraction"] is None
    assert "not judged" in format_figures(receipt)
    # A second leg of other bytes leaves the rate to the first leg alone.
    receipt = attempt(random.Random(4), store="local")
    receipt["legs"]["durable_second"]["server_restores"][0]["bytes"] += 1
    judge_figures(receipt, LEGS)
    rate = by_name(receipt)["durable restore rate / floor (slower leg)"]
    assert rate["value"] == pytest.approx(receipt["figures"]["durable"]["floor_fraction"])


def test_a_depth_beyond_the_context_is_a_clear_error(capsys):
    """check_depths: a depth plus the generated tokens must fit the context; the command
    refuses before it starts a server, naming the depth, the model and the context."""
    check_depths([1, 8188], context_length=8192, max_tokens=4, model="tiny")
    with pytest.raises(BadDepth, match=r"\[8189\].*context of 8192 tokens.*1\.\.8188"):
        check_depths([256, 8189], context_length=8192, max_tokens=4, model="tiny")
    code = cli.main(["bench", "--model", "tiny", "--depths", "256,9000", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 2
    assert "depth(s) [9000] do not fit tiny" in out and "context of 8192 tokens" in out


def test_a_printed_target_never_reads_as_the_other_verdict():
    """Two places, unless rounding would carry the value across its bound: a miss by
    0.004 does not print as the bound itself, nor a pass as a miss."""
    cases = [(0.696, ">=", 0.7, "0.696"), (1.2004, "<=", 1.2, "1.2004"),
             (0.5049, ">=", 0.5, "0.50"), (0.5961, "<=", 0.6, "0.60"),
             (0.4996, ">=", 0.5, "0.4996")]  # fmt: skip
    for value, op, bound, shown in cases:
        t = {"target": "t", "value": value, "op": op, "bound": bound}
        t["met"] = value >= bound if op == ">=" else value <= bound
        text = format_figures({"depth": 256, "figures": {}, "targets": [t]})
        verdict = "met" if t["met"] else "MISSED"
        assert f"target t: {shown} (bound {op} {bound}) {verdict}" in text, text


@pytest.mark.parametrize("seed", range(3))
def test_with_three_restarts_first_over_second_is_the_median_of_each_restarts_own(seed):
    """Each restart's first request is judged against that restart's second (the same
    process); the target is the median of those ratios, each printed; one restart with
    an invalid leg leaves the target not judged."""
    rng = random.Random(seed)
    receipt = attempt(rng, store="local")
    legs = receipt["legs"]
    for r in (2, 3):
        first, second = restart_legs(r)
        legs[first] = leg("durable", rng.uniform(0.05, 0.3))
        legs[second] = leg("durable", rng.uniform(0.05, 0.3))
    receipt["restarts"] = 3
    judge_figures(receipt, leg_names(3))
    ratios = [legs[a]["ttft_s"] / legs[b]["ttft_s"] for a, b in map(restart_legs, (1, 2, 3))]
    target = by_name(receipt)["first / second request after restart"]
    assert target["value"] == pytest.approx(sorted(ratios)[1])
    assert target["met"] is (sorted(ratios)[1] <= 1.2)
    text = format_figures(receipt)
    assert "first / second per restart: " + ", ".join(f"{r:.2f}" for r in ratios) in text
    assert "durable_second@3" in text

    legs["durable@2"]["valid"] = False
    judge_figures(receipt, leg_names(3))
    assert by_name(receipt)["first / second request after restart"]["met"] is None
