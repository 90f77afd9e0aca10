"""Restore what the vault holds into mlx-lm's own generate, bit-identical to a cold run.

    python examples/mlx_lm_restore.py --model mlx-community/SmolLM2-135M-Instruct-4bit
    python examples/mlx_lm_restore.py --model ./my-mlx-model --data-dir /tmp/vault

The model is an mlx-lm directory or a Hugging Face repo id in the local cache (mlx-lm's
tokenizer is read from it). mlx-lm continues a cut exactly as its cold run would when
prefill_step_size is the vault's alignment and the cut is aligned or holds all of the
prompt but its last token (see engine/interop.py); this script asks for that cut, fills
what the vault lacked in aligned steps, seals it, and lets mlx-lm generate the rest.
Run it twice: the second run restores the whole prompt but its last token.
"""

from __future__ import annotations

import argparse
import json

from mlx_lm import stream_generate
from mlx_lm.utils import load_tokenizer

import kvpack

SYSTEM = (
    "You are a careful assistant. Answer in one or two sentences, plainly, and say so when "
    "you do not know. Prefer facts a reader can check."
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question", nargs="?", default="Why is the sky blue?")
    p.add_argument("--model", required=True, help="an mlx-lm dir or org/name[@revision]")
    p.add_argument("--data-dir", help="the vault (default: $KVPACK_DATA_DIR or ~/.kvpack)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    with kvpack.open(data_dir=args.data_dir) as vault:
        model = vault.model(args.model)
        tokenizer = load_tokenizer(model.path)
        a = model.alignment
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": args.question},
        ]
        prompt = model.chat_tokens(messages)
        head = prompt[:-1]  # mlx-lm needs at least one token to start from

        cache = vault.prompt_cache(model, head)
        took = f"{cache.restore_seconds:.3f} s"
        print(f"vault: {cache.depth} of {len(head)} tokens from tier {cache.tier} in {took}")
        # Fill what the vault lacked in aligned steps, sealing the last aligned cut (an
        # ancestor for longer prompts) and the exact one.
        have = cache.depth
        for depth in sorted({len(head) // a * a, len(head)}):
            if have < depth:
                logits = model.prefill_aligned(cache.caches, head[have:depth])
                vault.publish(model, head[:depth], cache.caches, logits=logits)
                have = depth
                print(f"sealed the cut at {depth} tokens")

        def mlx_lm_generate(tokens, prompt_cache=None):
            """mlx-lm's own stream_generate, with prefill steps of the vault's alignment."""
            steps = stream_generate(
                model.module,
                tokenizer,
                tokens,
                max_tokens=args.max_tokens,
                prompt_cache=prompt_cache,
                prefill_step_size=a,
            )
            out = list(steps)
            return "".join(r.text for r in out), [r.token for r in out]

        text, tokens = mlx_lm_generate(prompt[-1:], cache.caches)
        print(f"mlx-lm from the vault: {json.dumps(text)}")
        print(f"same tokens as a cold mlx-lm run: {tokens == mlx_lm_generate(prompt)[1]}")


if __name__ == "__main__":
    main()
