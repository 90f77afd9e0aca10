"""kvpack/bench/publication.py on tiny: the legs, the gate and the receipt (the figures
are the benchmark's business, never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

from kvpack.bench.publication import Plan, format_table, run
from kvpack.cli import main
from kvpack.config import Settings
from tests.engine.slotkit import TINY_A


def test_on_and_off_legs_are_cold_equal_and_only_on_stores(tmp_path):
    """Both legs cold in fresh namespaces with one output; the off leg stores nothing; the
    on leg seals exactly the chunks new to the store and its prompt is then served; the
    receipt on disk is what run() returned."""
    settings = Settings.load(data_dir=tmp_path / "vault", alignment=TINY_A, env={})
    plan = Plan(settings=settings, model="tiny", depths=(300,), max_tokens=24,
                receipts_dir=tmp_path / "receipts")  # fmt: skip
    receipt = run(plan, log=lambda _m: None)
    (depth,) = receipt["depths"]
    assert depth["valid"], depth["problems"]
    off, on = depth["legs"]
    assert (off["publish"], on["publish"]) == (False, True)
    assert off["tier"] == on["tier"] == "none" and off["namespace"] != on["namespace"]
    assert off["output"] == on["output"] and len(on["output"]) >= plan.min_tokens
    assert (off["chunks_sealed"], off["chunks_new"]) == (0, 0)
    assert on["chunks_sealed"] == on["chunks_new"] > 0 and on["chunks_already_stored"] > 0
    assert on["again_tier"] in ("resident", "durable") and depth["sealed_equals_new"]
    saved = json.loads(Path(receipt["path"]).read_text())
    assert saved["depths"] == receipt["depths"]
    assert "receipt:" in format_table(receipt)


def test_the_command_names_a_bad_depth(capsys):
    try:
        main(["bench-publication", "--depths", "2048,x"])
    except SystemExit as e:
        assert e.code == 2
    assert "not an integer: 'x'" in capsys.readouterr().err


def test_a_ratio_just_past_its_bound_does_not_print_as_the_bound():
    """1.0504 against the 1.05 prefill bound prints 1.0504, 0.9496 against the 0.95 decode
    bound 0.9496, beside MISSED; a ratio well inside prints to three places."""
    leg = {"prefill_s": 10.0, "decode_tokens_per_s": 9.0, "cpu_total_s": 50.0,
           "publication_after_s": 0.2}  # fmt: skip
    depth = {"depth": 2048, "on": leg, "off": leg, "chunks": [[9, 0, 9]], "valid": True,
             "problems": [], "target_met": False}  # fmt: skip
    for prefill, decode, want in [(1.0504, 0.99, "1.0504"), (1.0, 0.9496, "0.9496")]:
        receipt = {"depths": [{**depth, "prefill_ratio": prefill, "decode_ratio": decode}],
                   "path": "r.json"}  # fmt: skip
        row = format_table(receipt).splitlines()[1]
        assert want in row and row.endswith("MISSED"), row
    receipt = {"depths": [{**depth, "prefill_ratio": 1.01234, "decode_ratio": 0.98765}],
               "path": "r.json"}  # fmt: skip
    row = format_table(receipt).splitlines()[1]
    assert " 1.012 " in row and " 0.988 " in row, row
