"""The first request after a restart against the second, on S3 + PostgreSQL.

Two different prompts of the same depth are served (and published durably) by one
`kvpack serve`, which then stops gracefully (draining its publication). A second
`kvpack serve` on the same store, catalog and namespace starts, and once it reports
ready the two prompts are sent again, one after the other: both are durable restores
(its resident tier is empty), so the first pays whatever the restart left cold and the
second does not. Printed: each request's time to first token, total time and restore
seconds, and first / second. SeaweedFS and a fresh PostgreSQL database are started
and dropped by the script.

    flock /tmp/bench.lock .venv/bin/python benchmarks/first_request.py --depth 2048

KVPACK_BENCH_PG (default postgresql://postgres@127.0.0.1:5432/postgres) names the
server's maintenance database.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path

import psycopg

from cas.s3 import ensure_bucket
from engine.models import load_model
from kvpack.bench.seaweedfs import start_seaweedfs
from kvpack.bench.serve import ServerProcess, prompt_tokens, run_leg

ADMIN = os.environ.get("KVPACK_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--depth", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    tokenizer = load_model(args.model).tokenizer
    prompts = [
        prompt_tokens(tokenizer, args.depth, seed=seed, title=f"first request {seed}")
        for seed in (1, 2)
    ]
    db = f"kvpack_bench_{secrets.token_hex(3)}"
    with psycopg.connect(ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{db}"')
    try:
        with tempfile.TemporaryDirectory() as tmp, start_seaweedfs(Path(tmp)) as server:
            s3 = server.s3
            config = s3.config("kvpack-bench")
            ensure_bucket(config)
            os.environ.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key)
            argv = [
                sys.executable, "-m", "kvpack.cli", "serve", "--no-auth", "--port", "0",
                "--model", args.model, "--data-dir", f"{tmp}/vault",
                "--store-url", "s3://kvpack-bench/first", "--s3-endpoint", s3.endpoint_url,
                "--database-url", f"{ADMIN.rsplit('/', 1)[0]}/{db}", "--namespace", "first",
            ]  # fmt: skip
            timeout = 60 + 0.5 * args.depth

            def leg(url: str, name: str, tokens: list[int]) -> dict:
                out = run_leg(url, name, tokens, model=args.model, max_tokens=args.max_tokens,
                              timeout_s=timeout)  # fmt: skip
                if not out["valid"]:
                    raise SystemExit(f"{name}: {out['error']}")
                return out

            with ServerProcess(argv, Path(tmp) / "serve-1.log", 300) as first:
                for i, tokens in enumerate(prompts):
                    leg(first.url, f"cold {i + 1}", tokens)
            with ServerProcess(argv, Path(tmp) / "serve-2.log", 300) as second:
                after = [
                    leg(second.url, f"after restart {i + 1}", t) for i, t in enumerate(prompts)
                ]
            print(f"startup to ready: {second.startup_s:.2f} s")
            for line in (Path(tmp) / "serve-2.log").read_text().splitlines():
                if line.startswith("kvpack serve: warm in"):
                    print(line)
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    for name, out in zip(("first", "second"), after, strict=True):
        print(f"{name} request after the restart: tier {out['tier']}, ttft {out['ttft_s']:.3f} s, "
              f"total {out['total_s']:.3f} s, restore {out['restore_seconds']:.3f} s")  # fmt: skip
    if any(out["tier"] != "durable" for out in after):
        print("INVALID: a request after the restart was not a durable restore")
        return 1
    ratio = after[0]["ttft_s"] / after[1]["ttft_s"]
    print(f"first / second (time to first token), depth {args.depth}: {ratio:.2f}")
    keys = ("tier", "ttft_s", "total_s", "restore_seconds", "output")
    print(
        json.dumps(
            {
                "depth": args.depth,
                "ratio_ttft": ratio,
                "startup_s": second.startup_s,
                **{
                    n: {k: o[k] for k in keys}
                    for n, o in zip(("first", "second"), after, strict=True)
                },
            }
        )
    )

    return 0


if __name__ == "__main__":
    sys.exit(main())
