"""Generate with the vault: the second call starts from the state the first computed, and
so does the next process.

    python examples/generate.py                          # the demo model, vault in ~/.kvpack
    python examples/generate.py --model mlx-community/SmolLM2-135M-Instruct-4bit
    python examples/generate.py --model ./my-mlx-model --data-dir /tmp/vault "Why?"

The vault's other settings (store URL, database URL, S3, namespace) come from the
KVPACK_* environment or KVPACK_CONFIG, as for `kvpack serve`. Run it twice: in the second
run the first call is served from the durable tier.
"""

from __future__ import annotations

import argparse
import json

import kvpack

SYSTEM = (
    "You are a careful assistant. Answer in one or two sentences, plainly, and say so when "
    "you do not know. Prefer facts a reader can check."
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question", nargs="?", default="What is the capital of France?")
    p.add_argument("--model", default="smollm2", help="a name, mlx-lm dir, .gguf or org/name")
    p.add_argument("--data-dir", help="the vault (default: $KVPACK_DATA_DIR or ~/.kvpack)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    with kvpack.open(data_dir=args.data_dir) as vault:
        model = vault.model(args.model)
        print(
            f"model {model.name}, identity {model.identity[:16]}, vault {vault.settings.data_dir}"
        )
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": args.question},
        ]
        for call in (1, 2):
            out = model.generate(messages=messages, max_tokens=args.max_tokens)
            print(
                f"call {call}: tier {out.tier}, cached {out.cached_tokens} of "
                f"{out.prompt_tokens} prompt tokens, restore {out.restore_seconds:.3f} s, "
                f"prefill {out.prefill_seconds:.3f} s"
            )
            print(f"  text: {json.dumps(out.text)}")
            # Publication runs in the background; wait for it so call 2 can restore it.
            vault.flush()


if __name__ == "__main__":
    main()
