"""kvpack bench: prompts of exact depth, the leg validity gate, exclusive receipts, and a
fast end-to-end run on the tiny model (fresh `kvpack serve` processes)."""

from __future__ import annotations

import json
import secrets

import pytest

from engine.models import load_model
from engine.models.tiny import save_tiny
from kvpack import cli
from kvpack.bench.serve import (
    LEGS,
    Plan,
    ReceiptExists,
    judge,
    passed,
    prompt_tokens,
    run_bench,
    run_leg,
    write_receipt,
)
from tests.kvpack.serverkit import TINY_A, SlowService, running


@pytest.fixture
def service(tiny_service):
    return tiny_service


def test_prompts_are_deterministic_and_exactly_the_depth(service):
    """prompt_tokens: exactly `depth` ids, the same on every call; the miss prompt shares
    no prefix with the depth prompt (it differs at the first token)."""
    tok = service.loaded.tokenizer
    for depth in (1, 100, 1000):
        a = prompt_tokens(tok, depth, seed=1, title="Field notes of the survey.")
        assert len(a) == depth
        assert a == prompt_tokens(tok, depth, seed=1, title="Field notes of the survey.")
    miss = prompt_tokens(tok, 64, seed=2, title="Unrelated control passage.")
    assert miss[0] != a[0]


def test_a_leg_that_times_out_is_invalid_and_outputs_are_not_compared(service):
    """The validity gate: a leg past its deadline mid-stream is marked invalid with the
    timeout as its error; with one invalid leg the comparisons with it are None (not
    judged), legs_valid is False and leg_errors names it, even though the other legs match.
    A durable leg whose output differs from cold is outputs_match_durable False and fails
    the bench."""
    tokens = service.loaded.tokenizer.encode("Tell me about the sea. " * 3)
    with running(service) as fast_url:
        cold = run_leg(fast_url, "cold", tokens, model="tiny", max_tokens=6, timeout_s=30)
        warm = run_leg(fast_url, "warm", tokens, model="tiny", max_tokens=6, timeout_s=30)
        miss = run_leg(fast_url, "miss", tokens[:5], model="tiny", max_tokens=6, timeout_s=30)
    with running(SlowService(service, delay_s=0.4)) as slow_url:
        slow = run_leg(slow_url, "cold", tokens, model="tiny", max_tokens=6, timeout_s=1.0)
    assert cold["valid"] and warm["valid"] and miss["valid"]
    assert not slow["valid"] and slow["error"] == "timed out after 1s"

    durable = {**warm, "leg": "durable", "tier": "durable"}
    second = {**cold, "leg": "second"}
    durable_second = {**durable, "leg": "durable_second"}
    legs = {"cold": cold, "warm": warm, "miss": miss, "second": second, "durable": durable,
            "durable_second": durable_second}  # fmt: skip
    good = {"legs": legs}
    judge(good)
    assert good["legs_valid"] and good["leg_errors"] == {} and good["outputs_match"] is True
    assert good["outputs_match_durable"] is True and good["durable_tier"] == "durable"
    assert good["ttft_ratio_cold_to_durable"] == cold["ttft_s"] / durable["ttft_s"]
    assert passed([good])

    wrong = {"legs": {**good["legs"], "durable": {**durable, "output": durable["output"] + "!"}}}
    judge(wrong)
    assert wrong["legs_valid"] and wrong["outputs_match"] is True
    assert wrong["outputs_match_durable"] is False and not passed([wrong])

    gated = {"legs": {**legs, "cold": slow}}
    judge(gated)
    assert gated["legs_valid"] is False
    assert gated["leg_errors"] == {"cold": "timed out after 1s"}
    assert gated["outputs_match"] is None and gated["ttft_ratio_cold_to_warm"] is None
    assert gated["outputs_match_durable"] is None and gated["ttft_ratio_cold_to_durable"] is None

    # With two restarts, the second restart's legs are gated and compared too.
    restarted = {"legs": {**legs, "durable@2": durable, "durable_second@2": durable_second},
                 "restarts": 2}  # fmt: skip
    judge(restarted)
    assert restarted["outputs_match_durable"] is True and passed([restarted])
    again = {**durable_second, "output": durable_second["output"] + "!"}
    differs = {**restarted, "legs": {**restarted["legs"], "durable_second@2": again}}
    judge(differs)
    assert differs["outputs_match_durable_second"] is False and not passed([differs])
    short = {**restarted, "legs": legs}
    judge(short)
    assert short["leg_errors"] == {"durable@2": "not run", "durable_second@2": "not run"}

    missing = {"legs": {n: leg for n, leg in legs.items() if n != "durable"}}
    judge(missing)
    assert missing["leg_errors"] == {"durable": "not run"} and not passed([missing])
    assert missing["outputs_match"] is True and missing["outputs_match_durable"] is None


def test_receipts_are_created_exclusively(tmp_path):
    """A second receipt with the same attempt id raises ReceiptExists; the first survives."""
    attempt = f"20260101T000000Z-{secrets.token_hex(4)}-d256"
    path = write_receipt(tmp_path, attempt, {"n": 1})
    with pytest.raises(ReceiptExists):
        write_receipt(tmp_path, attempt, {"n": 2})
    assert json.loads(path.read_text()) == {"n": 1}


def test_bench_cli_on_tiny_cold_warm_miss_durable(tmp_path, capsys):
    """`kvpack bench` end to end: a fresh server, valid legs, cold and second served by no
    tier, warm by the resident tier with every prompt token cached and identical output,
    the miss control by no tier; then the durable legs on a second server process (another
    pid, counters from zero, the first one exited cleanly) over the same data dir and
    namespace: served by the durable tier with every token cached and the cold legs'
    outputs. The receipt on disk (version 2) says the same and carries the server's own
    restore records, the baselines and the targets; the tables are printed. The model is
    a directory: the server serves it under the directory's name, and the bench asks for
    that name, not the path it was given."""
    receipts = tmp_path / "receipts"
    model_dir = save_tiny(tmp_path / "tiny-dir")
    code = cli.main(["bench", "--model", str(model_dir), "--depths", "128",
                     "--alignment", str(TINY_A), "--max-tokens", "4", "--miss-depth", "64",
                     "--receipts-dir", str(receipts),
                     "--data-dir", str(tmp_path / "data"), "--restarts", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    (path,) = receipts.iterdir()
    receipt = json.loads(path.read_text())
    assert path.name == f"{receipt['attempt_id']}.json"
    assert receipt["legs_valid"] and receipt["outputs_match"] is True
    legs = receipt["legs"]
    tiers = ["none", "resident", "none", "none", "durable", "durable"]
    assert [legs[n]["tier"] for n in LEGS] == tiers and receipt["version"] == 3
    assert legs["warm"]["cached_tokens"] == 128 and legs["cold"]["prompt_tokens"] == 128
    assert legs["miss"]["prompt_tokens"] == 64 and receipt["miss_served_by_no_tier"]
    assert legs["warm"]["counters_delta"]["kvpack_hits_total:resident"] == 1
    assert legs["cold"]["counters_delta"]["kvpack_misses_total"] == 1
    assert receipt["namespace"].startswith("bench-")
    assert "depth 128: cold/warm TTFT" in out and "outputs_match yes" in out

    durable = legs["durable"]
    assert receipt["outputs_match_durable"] is True and durable["output"] == legs["cold"]["output"]
    assert durable["cached_tokens"] == 128
    assert durable["counters_delta"]["kvpack_hits_total:durable"] == 1
    first, second = receipt["server"], receipt["restarted_server"]
    assert first["pid"] != second["pid"]
    assert first["exit_code"] == 0 and second["exit_code"] == 0  # SIGTERM: a drained exit
    before = durable["counters_before"]  # a fresh process: nothing served before this leg
    assert before.get("kvpack_misses_total", 0) == 0 == before.get("kvpack_hits_total:resident", 0)
    assert "cold/durable TTFT" in out and "outputs_match_durable yes" in out
    assert receipt["outputs_match_durable_second"] is True
    # --restarts 2: a third process, the same two durable restores and outputs again.
    third = receipt["restarted_server@2"]
    assert third["pid"] not in (first["pid"], second["pid"]) and third["exit_code"] == 0
    for name, like in (("durable@2", "cold"), ("durable_second@2", "second")):
        assert legs[name]["tier"] == "durable" and legs[name]["output"] == legs[like]["output"]
        assert legs[name]["counters_delta"]["kvpack_hits_total:durable"] == 1
    assert "first / second per restart: " in out

    # The server measured each restore itself; the cold legs restored nothing.
    (record,) = durable["server_restores"]
    assert record["tier"] == "durable" and record["depth"] == 128
    assert legs["cold"]["server_restores"] == [] == legs["second"]["server_restores"]
    assert legs["durable_second"]["server_restores"][0]["tier"] == "durable"
    assert record["peak_rss_added"] is not None and record["seconds"] > 0
    # The baselines are of the same bytes and state: the cut the durable leg restored.
    baseline = receipt["baseline"]
    assert baseline["error"] is None and baseline["export"]["store"] == "local"
    assert baseline["export"]["tier"] == "durable" and baseline["export"]["depth"] == 128
    assert baseline["floor"]["bytes"] == record["bytes"] == baseline["export"]["cut_bytes"]
    assert "s3_get" not in durable and baseline["mlx_lm"]["seconds"] > 0  # no GET to time
    fig = receipt["figures"]["durable"]
    assert fig["restore_s"] == record["seconds"] and fig["bytes"] == record["bytes"]
    assert fig["floor_fraction"] == baseline["floor"]["seconds"] / record["seconds"]
    assert fig["ttft_vs_mlx_lm"] == durable["ttft_s"] / baseline["mlx_lm"]["seconds"]
    assert len(receipt["targets"]) == 5
    assert all(t["met"] is not None for t in receipt["targets"])  # every input was there
    assert "target durable restore rate / floor" in out and "x floor" in out


@pytest.mark.s3
@pytest.mark.postgres
@pytest.mark.parametrize("db_backend", ["postgres"], indirect=True)
def test_bench_against_shared_s3_and_postgres(tmp_path, s3_server, s3_bucket, db_factory):
    """The external path: storage flags reach the fresh server (s3:// store + PostgreSQL);
    each attempt gets its own namespace, so a shared vault cannot warm the cold leg."""
    db_url = db_factory.create()
    storage = ("--store-url", f"s3://{s3_bucket}/bench-{secrets.token_hex(4)}",
               "--database-url", db_url, "--s3-endpoint", s3_server.endpoint_url,
               "--s3-access-key", s3_server.access_key,
               "--s3-secret-key", s3_server.secret_key)  # fmt: skip
    plan = Plan(model="tiny", depths=(128, 128), work_dir=tmp_path / "data",
                receipts_dir=tmp_path / "receipts", storage_argv=storage,
                serve_argv=("--alignment", str(TINY_A)), miss_depth=64, max_tokens=4)  # fmt: skip
    receipts = run_bench(plan, load_model("tiny", alignment=TINY_A).tokenizer)
    for receipt in receipts:  # the same depth twice: the second is cold all the same
        assert receipt["legs_valid"] and receipt["outputs_match"] is True
        assert receipt["legs"]["cold"]["tier"] == "none"
        assert "***" in receipt["server"]["argv"]  # the secret key is not in the receipt
        baseline = receipt["baseline"]
        export = baseline["export"]
        assert baseline["error"] is None and export["store"] == "s3"
        assert export["catalog"] == "postgresql"
        # Each durable leg carries a raw GET of its own cut's sealed chunk objects, timed
        # before the restarted server started: the first prompt's cut is the export's.
        assert receipt["restarted_server"]["s3_get_error"] is None
        gets = [receipt["legs"][name]["s3_get"] for name in ("durable", "durable_second")]
        assert gets[0]["manifest"] == export["manifest"] != gets[1]["manifest"]
        for name, got in zip(("durable", "durable_second"), gets, strict=True):
            fig = receipt["figures"][name]
            assert got["objects"] == len(export["part_sizes"])
            assert got["cut_bytes"] == export["cut_bytes"] == fig["bytes"]
            assert got["bytes"] > got["cut_bytes"]  # sealed: headers and tags
            assert fig["s3_get_fraction"] == got["seconds"] / fig["restore_s"]
        assert receipt["targets"][0]["target"] == "durable restore rate / raw S3 GET (slower leg)"
    assert receipts[0]["namespace"] != receipts[1]["namespace"]
