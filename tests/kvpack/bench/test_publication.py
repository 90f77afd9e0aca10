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
