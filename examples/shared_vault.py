"""Share one vault between two processes — or machines — through S3 and PostgreSQL.

    export KVPACK_STORE_URL=s3://kvpack/demo KVPACK_S3_ENDPOINT=http://127.0.0.1:8333
    export KVPACK_S3_ACCESS_KEY=... KVPACK_S3_SECRET_KEY=...
    export KVPACK_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/kvpack
    python examples/shared_vault.py --model mlx-community/SmolLM2-135M-Instruct-4bit

The first process computes the prompt and publishes its cuts (chunks to the bucket, rows
to the catalog); then it starts a second process with the same settings, which has
nothing in memory and serves the prompt from the durable tier. On another machine the
second is the same command with `--second` and the same settings — and the same vault
keyring (keyring.json in the data dir, or KVPACK_KEYRING): the chunks are sealed with it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import kvpack

QUESTION = [
    {"role": "system", "content": "You are a careful assistant. Answer in one sentence."},
    {"role": "user", "content": "What is the boiling point of water at sea level?"},
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a name, mlx-lm dir, .gguf or org/name")
    p.add_argument("--data-dir", help="keys and ids (default: $KVPACK_DATA_DIR or ~/.kvpack)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--second", action="store_true", help="be the second process only")
    args = p.parse_args()

    role = "second" if args.second else "first"
    with kvpack.open(data_dir=args.data_dir) as vault:
        s = vault.settings
        if not s.store_url.is_s3 or not s.database_url.startswith("postgresql"):
            print(f"{role}: note: not S3 + PostgreSQL ({s.store_url}); the vault is local")
        out = vault.model(args.model).generate(messages=QUESTION, max_tokens=args.max_tokens)
        print(
            f"{role}: tier {out.tier}, cached {out.cached_tokens} of {out.prompt_tokens} "
            f"prompt tokens, restore {out.restore_seconds:.3f} s, "
            f"prefill {out.prefill_seconds:.3f} s, text {json.dumps(out.text)}",
            flush=True,
        )
    # Leaving the `with` block stored every cut still queued: the second process sees them.
    if not args.second:
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--second"], check=True)


if __name__ == "__main__":
    main()
