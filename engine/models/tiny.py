"""tiny: the built-in hybrid test model.

mlx-lm's gemma3_text architecture at toy size: 4 layers, alternately sliding-window
(window 32, so prompts of a few hundred tokens wrap the ring) and full attention;
float32 weights drawn from a fixed mlx random key (the same on every run and machine);
a byte tokenizer (ids 0-255 are bytes) with five special tokens and a ChatML template.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import gemma3_text

from engine.tokenizer import FastTokenizer, byte_level_bpe, byte_to_unicode

SEED = 1  # chosen among a few: greedy output from it does not fall into a short cycle
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>")
BOS, EOS, IM_END = "<bos>", "<eos>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "rope_theta": 10_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 16,
    "sliding_window": 32,
    "sliding_window_pattern": 2,  # layers 0, 2 slide; 1, 3 attend to everything
    "max_position_embeddings": 8192,
}


def tiny_tokenizer() -> FastTokenizer:
    alphabet = byte_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    backend = byte_level_bpe(vocab, [], special_tokens=SPECIAL_TOKENS)
    return FastTokenizer(backend, CHAT_TEMPLATE, bos_token=BOS, eos_tokens=(EOS, IM_END))


def _init_scale(name: str, shape: tuple[int, ...]) -> float:
    if name.endswith("norm.weight"):
        return 0.1  # gemma norms scale by (1 + w)
    if "embed_tokens" in name:
        return 1.0
    return shape[-1] ** -0.5


@lru_cache(maxsize=4)
def tiny_weights(seed: int = SEED) -> tuple[tuple[str, mx.array], ...]:
    """The generated weights, by name. Each tensor gets its own key split from `seed`."""
    template = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(CONFIG))
    # mlx types tree_flatten as list | dict; without a destination it is a list of pairs.
    shapes = {name: p.shape for name, p in tree_flatten(template.parameters())}  # type: ignore[str-unpack, union-attr]
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = tuple(
        (
            name,
            _init_scale(name, shapes[name])
            * mx.random.normal(shapes[name], dtype=mx.float32, key=keys[i]),
        )
        for i, name in enumerate(names)
    )
    mx.eval([w for _, w in weights])
    return weights


def tiny_model(seed: int = SEED) -> gemma3_text.Model:
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(CONFIG))
    model.update(tree_unflatten(list(tiny_weights(seed))))
    mx.eval(model.parameters())
    return model


def save_tiny(path: Path, *, seed: int = SEED) -> Path:
    """Write tiny as an mlx-lm model directory (config, safetensors, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    config = {**CONFIG, "eos_token_id": sorted(tokenizer.eos_token_ids)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tiny_weights(seed)), metadata={"format": "mlx"}
    )
    tokenizer.backend.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path
