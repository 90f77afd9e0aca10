"""Many durable restores inside one server, beside a raw GET of the same objects.

    .venv/bin/python benchmarks/server_restores.py [--depth 256] [--rounds 60]
        [--profile spy.txt] [--rate 500]

`kvpack bench` restores two cuts per server start, so its judged figure is one leg of
a few. This starts a SeaweedFS on loopback and one `kvpack serve` on it (SQLite
catalog) with one slot and no resident tier, publishes two `depth`-token prompts, and
then sends them in turn `rounds` times: each request evicts the other prompt's state,
so each is a durable restore from S3. Printed: the server's restore seconds (median,
p10, p90, from GET /v1/admin/restores), the raw aiobotocore GET of each cut (the
bench's baseline, best of three passes, timed after the server stops) and the GET's
ratio to the median restore.

--profile FILE attaches py-spy (`pip install py-spy`; not a dependency of kvpack) to
the server for the restores, writes its raw stacks to FILE and prints where the engine
thread's samples inside the restores fell, in ms per restore. The profiler takes CPU
from the two it measures: the restores run slower under it.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cas.s3 import ensure_bucket
from engine.models import load_model
from kvpack.bench.catalog import quantile
from kvpack.bench.probe import measure_gets
from kvpack.bench.seaweedfs import start_seaweedfs
from kvpack.bench.serve import ServerProcess, prompt_tokens, run_leg, server_restores

MODEL = "smollm2"
RESTORE_FRAME = "Ladder._try"  # kvpack/tiers/ladder.py: a restore's span on the engine thread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=256)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--profile", type=Path, help="py-spy's raw stacks to this file")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples a second")
    args = p.parse_args()
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if args.profile and spy is None:
        sys.exit("--profile needs py-spy on PATH or beside this Python (pip install py-spy)")
    tokenizer = load_model(MODEL).tokenizer
    prompts = {name: prompt_tokens(tokenizer, args.depth, seed=seed, title=name)
               for seed, name in enumerate(("Alpha", "Beta"))}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, start_seaweedfs(Path(tmp) / "s3") as weed:
        ensure_bucket(weed.s3.config("restores"))
        os.environ.update(weed.s3.env())
        data = Path(tmp) / "vault"
        data.mkdir()
        vault_argv = ["--data-dir", str(data), "--namespace", "restores", "--store-url",
                      "s3://restores/runs", "--s3-endpoint", weed.s3.endpoint_url]  # fmt: skip
        argv = [sys.executable, "-m", "kvpack.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                "--no-auth", "--measure-restores", "--model", MODEL, *vault_argv,
                "--slots", "1", "--resident-budget-mib", "0"]  # fmt: skip
        with ServerProcess(argv, Path(tmp) / "serve.log", 120.0) as server:
            for tokens in prompts.values():  # cold: computed and published
                run_leg(server.url, "cold", tokens, model=MODEL, max_tokens=1, timeout_s=300.0)
            seen = len(server_restores(server.url) or [])
            profiler = None
            if args.profile:
                assert spy is not None and server.proc is not None
                pid, out = str(server.proc.pid), str(args.profile)
                record = [spy, "record", "-p", pid, "-r", str(args.rate), "-f", "raw", "-o", out,
                          "--threads", "--nonblocking"]  # fmt: skip
                profiler = subprocess.Popen(record)
            order = list(prompts.values())
            for i in range(args.rounds):
                run_leg(server.url, "durable", order[i % 2], model=MODEL, max_tokens=1,
                        timeout_s=60.0)  # fmt: skip
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                profiler.wait()
            records = (server_restores(server.url) or [])[seen:]
        ms = sorted(r["seconds"] * 1000 for r in records if r["tier"] == "durable")
        if len(ms) < args.rounds:
            sys.exit(f"only {len(ms)} of {args.rounds} requests were durable restores: "
                     f"{records[:3]}")  # fmt: skip
        gets = measure_gets(python=sys.executable, model=MODEL, vault_argv=vault_argv,
                            cuts=prompts, timeout_s=120.0)  # fmt: skip
    if gets.get("error"):
        sys.exit(f"the raw GET failed: {gets['error']}")
    median = statistics.median(ms)
    print(f"depth {args.depth}, {len(ms)} durable restores in one server: median {median:.1f} ms, "
          f"p10 {quantile(ms, 0.1):.1f}, p90 {quantile(ms, 0.9):.1f}")  # fmt: skip
    for name in prompts:
        get_ms = gets[name]["seconds"] * 1000
        ratio = get_ms / median
        print(f"raw GET of {name}'s cut: {get_ms:.1f} ms, {ratio:.2f} x the median restore")
    if args.profile:
        _engine_profile(args.profile, args.rate, len(ms))


def _engine_profile(path: Path, rate: int, restores: int) -> None:
    """The engine thread's samples inside restores, by innermost frame, in ms a restore."""
    leaves: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if "kvpack-engine" in frames[0] and any(RESTORE_FRAME in f for f in frames):
            leaves[frames[-1]] += int(count)
    per_restore = 1000 / rate / restores
    total = sum(leaves.values()) * per_restore
    print(f"engine thread inside restores: {total:.1f} ms a restore (py-spy, {rate}/s)")
    for frame, n in leaves.most_common(8):
        print(f"  {n * per_restore:5.2f} ms  {frame}")


if __name__ == "__main__":
    main()
