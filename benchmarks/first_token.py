"""Time to first token of durable restores in one server, beside their restore seconds.

    .venv/bin/python benchmarks/first_token.py [--depth 256] [--rounds 40] [--max-tokens 3]

Starts one `kvpack serve` on a fresh local vault (SQLite catalog, local directory) with
one slot and no resident tier, publishes two `depth`-token prompts, then sends them in
turn `rounds` times, streamed: each request evicts the other prompt's state, so each is
a durable restore. Printed: the client's time to first token and the server's restore
seconds (GET /v1/admin/restores), median, p10 and p90, and the median of their
difference: what a hit costs outside the restore (parsing, the catalog lookup, the
first token's draw and its way out to the client); then the whole request and the
stream's end after its last token (what the engine still does once the last token has
left: the end of the stream waits for it). `--max-tokens` above 1 gives the engine a
next token to start on while the first one leaves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from engine.models import load_model
from kvpack.bench.catalog import quantile
from kvpack.bench.serve import ServerProcess, prompt_tokens, run_leg

MODEL = "smollm2"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=256)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=3)
    args = p.parse_args()
    tokenizer = load_model(MODEL).tokenizer
    prompts = [prompt_tokens(tokenizer, args.depth, seed=seed, title=name)
               for seed, name in enumerate(("Alpha", "Beta"))]  # fmt: skip
    ttft, restore, whole, tail = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "vault"
        data.mkdir()
        argv = [sys.executable, "-m", "kvpack.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                "--no-auth", "--measure-restores", "--model", MODEL, "--data-dir", str(data),
                "--namespace", "first-token", "--slots", "1",
                "--resident-budget-mib", "0"]  # fmt: skip
        with ServerProcess(argv, Path(tmp) / "serve.log", 120.0) as server:
            for tokens in prompts:  # cold: computed and published
                run_leg(server.url, "cold", tokens, model=MODEL, max_tokens=1, timeout_s=300.0)
            for i in range(args.rounds):
                leg = run_leg(server.url, "durable", prompts[i % 2], model=MODEL,
                              max_tokens=args.max_tokens, timeout_s=60.0)  # fmt: skip
                if not leg["valid"] or leg["tier"] != "durable" or not leg["server_restores"]:
                    sys.exit(f"round {i}: not a durable restore: {leg.get('error') or leg['tier']}")
                ttft.append(leg["ttft_s"] * 1000)
                restore.append(leg["server_restores"][0]["seconds"] * 1000)
                whole.append(leg["total_s"] * 1000)
                tail.append((leg["total_s"] - leg["token_times_s"][-1]) * 1000)
    outside = [t - r for t, r in zip(ttft, restore, strict=True)]
    print(f"depth {args.depth}, {args.rounds} durable restores in one server (local directory):")
    rows = (("time to first token", ttft), ("restore", restore), ("outside it", outside),
            ("whole request", whole), ("end after last token", tail))  # fmt: skip
    for name, ms in rows:
        p10, p90 = quantile(sorted(ms), 0.1), quantile(sorted(ms), 0.9)
        print(f"  {name:20s} median {statistics.median(ms):6.2f} ms, p10 {p10:6.2f}, p90 {p90:.2f}")


if __name__ == "__main__":
    main()
