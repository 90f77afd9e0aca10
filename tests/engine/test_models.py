"""engine.models: tiny, the GGUF demo model, mlx-lm directories, and the tokenizers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine.models import (
    LoadedModel,
    ModelLoadError,
    UnknownModelSpec,
    UnsupportedModel,
    load_model,
)
from engine.models.gguf import dequantized_weights, mlx_name
from engine.models.tiny import CONFIG, save_tiny
from engine.tokenizer import ChatTemplateError


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


def greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    cache = loaded.make_cache()
    logits = loaded.model(mx.array(prompt)[None], cache=cache)
    out = []
    for _ in range(n):
        y = logits[0, -1].argmax()
        out.append(y.item())
        logits = loaded.model(y.reshape(1, 1), cache=cache)
    return out


ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(b"The quick brown fox jumps over the lazy dog. " * 7)  # 315 tokens, ~10 windows

_SUBPROCESS = """
import json
from engine.models import load_model
from tests.engine.test_models import PROMPT, greedy
m = load_model("tiny")
print(json.dumps({"identity": m.identity.hex, "tokens": greedy(m, PROMPT, 32)}))
"""


def test_tiny_is_hybrid_and_wraps_the_ring():
    """tiny's layout: layers 0, 2 slide (window 32), 1, 3 are full; after a 315-token
    prefill and one decode step the sliding caches hold only their window (the ring
    wrapped) while the full ones cover every position."""
    m = load_model("tiny")
    assert m.layout.sliding_layers == (0, 2)
    assert [layer.window for layer in m.layout.layers] == [32, None, 32, None]
    assert m.layout.dtype == "float32" and m.dtype == mx.float32
    cache = m.make_cache()
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    mx.eval(m.model(mx.array(PROMPT)[None], cache=cache))
    mx.eval(m.model(mx.array([7])[None], cache=cache))
    assert all(c.offset == len(PROMPT) + 1 for c in cache)
    assert cache[0].keys.shape[2] == cache[2].keys.shape[2] == CONFIG["sliding_window"]
    assert cache[1].keys.shape[2] >= len(PROMPT) + 1
    assert len(PROMPT) > 4 * CONFIG["sliding_window"]


def test_tiny_is_deterministic_across_loads_and_processes():
    """Same seed -> same weights and greedy tokens in this process and in a fresh one."""
    a, b = load_model("tiny"), load_model("tiny")
    tokens = greedy(a, PROMPT, 32)
    assert greedy(b, PROMPT, 32) == tokens
    assert len(set(tokens)) > 16  # not stuck in a short cycle
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, check=True, cwd=ROOT
    )
    other = json.loads(out.stdout.strip().splitlines()[-1])
    assert other == {"identity": a.identity.hex, "tokens": tokens}


def test_tiny_tokenizer_bytes_specials_and_chat_template():
    """Byte ids, special tokens recognised in text, eos ids, and the ChatML template."""
    tok = load_model("tiny").tokenizer
    text = "héllo, wörld ✓"
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_end|>") == [260]
    assert tok.eos_token_ids == frozenset({258, 260}) and tok.bos_token_id == 257
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == [257, 259, *b"user\nhi", 260, 10, 259, *b"assistant\n"]
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
        == ids[: -len(b"assistant\n") - 1]
    )


def test_chat_template_errors_are_typed():
    """A template that raises, and a model without template, give ChatTemplateError."""
    from dataclasses import replace

    tok = load_model("tiny").tokenizer
    bad = replace(tok, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        replace(tok, chat_template="").apply_chat_template([{"role": "user", "content": "x"}])


def test_model_directory_roundtrip(tmp_path):
    """tiny saved in mlx-lm's format loads back through the directory path (mlx-lm builds
    it): same logits, tokenizer, template and layout; identity differs only by weights
    recipe (files vs generated arrays) and is independent of the directory's name."""
    tiny = load_model("tiny")
    a = load_model(str(save_tiny(tmp_path / "a")))
    b = load_model(str(save_tiny(tmp_path / "b")))
    assert a.identity == b.identity and a.name == "a"
    x = mx.array(PROMPT)[None]
    assert mx.array_equal(tiny.model(x, cache=tiny.make_cache()), a.model(x, cache=a.make_cache()))
    assert greedy(a, PROMPT, 16) == greedy(tiny, PROMPT, 16)
    diff = {
        k
        for k in tiny.identity.components
        if tiny.identity.components[k] != a.identity.components[k]
    }
    assert diff == {"weights"}
    assert a.layout == tiny.layout and a.tokenizer.eos_token_ids == tiny.tokenizer.eos_token_ids
    assert a.num_params == tiny.num_params


def test_bad_specs_are_typed_errors(tmp_path):
    """Unknown names, files that are no model, directories without config or weights, and
    a non-GGUF .gguf file. (Repo ids missing from the cache: tests/engine/test_hub.py.)"""
    with pytest.raises(UnknownModelSpec):
        load_model("no-such-model")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(UnknownModelSpec, match="neither a model directory nor a .gguf"):
        load_model(str(tmp_path / "notes.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    d = save_tiny(tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(d))
    d = save_tiny(tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedModel, match="tokenizer.json"):
        load_model(str(d))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(junk))


def test_gguf_names_and_dequantization():
    """GGUF tensor names map to mlx-lm llama names; a (weight, scales, biases) triplet is
    dequantized with the bit width implied by its shapes; unknown names are refused."""
    assert mlx_name("blk.7.attn_q") == "model.layers.7.self_attn.q_proj"
    assert mlx_name("blk.0.ffn_norm") == "model.layers.0.post_attention_layernorm"
    assert mlx_name("token_embd") == "model.embed_tokens"
    assert mlx_name("output") == "lm_head"
    with pytest.raises(KeyError):
        mlx_name("blk.0.attn_qkv")
    w = mx.random.normal((8, 64), key=mx.random.key(0))
    for bits in (4, 8):
        q, s, b = mx.quantize(w, group_size=32, bits=bits)
        out = dequantized_weights(
            {"blk.0.attn_q.weight": q, "blk.0.attn_q.scales": s, "blk.0.attn_q.biases": b}
        )
        expect = mx.dequantize(q, s, b, group_size=32, bits=bits)
        assert out["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float32
        assert mx.array_equal(out["model.layers.0.self_attn.q_proj.weight"], expect)


@pytest.mark.slow
def test_smollm2_answers_a_chat_prompt():
    """The demo GGUF: tokenizer and template from metadata, greedy answer names Paris."""
    m = load_model("smollm2")
    assert m.layout.num_layers == 30 and m.layout.sliding_layers == ()
    assert m.layout.layers[0].kv_heads == 3 and m.layout.layers[0].head_dim == 64
    tok = m.tokenizer
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]  # smollm splits digits
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(ids).startswith("<|im_start|>system\n")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    answer = []
    for t in greedy(m, ids, 24):
        if t in tok.eos_token_ids:
            break
        answer.append(t)
    assert "Paris" in tok.decode(answer)


@pytest.mark.slow
def test_a_gguf_this_process_may_not_write_loads_from_a_private_copy(tmp_path, monkeypatch):
    """MLX's GGUF reader opens the file for writing too: a file the service user may not
    write (say, installed by root) is read from a copy in the kvpack cache dir, made once,
    and the model's identity is that of the original file."""
    from engine.models import gguf

    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "cache"))
    original = gguf.smollm2_path()
    real_access, loaded_from = gguf.os.access, []
    monkeypatch.setattr(
        gguf.os, "access", lambda p, mode: mode != gguf.os.W_OK and real_access(p, mode)
    )
    real_load = gguf.mx.load
    monkeypatch.setattr(
        gguf.mx, "load", lambda p, **kw: loaded_from.append(p) or real_load(p, **kw)
    )
    first = load_model("smollm2")
    second = load_model("smollm2")
    copies = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(copies) == 1 and copies[0].read_bytes() == original.read_bytes()
    assert loaded_from == [str(copies[0])] * 2
    monkeypatch.undo()
    assert first.identity.digest == second.identity.digest == load_model("smollm2").identity.digest


def _save_lora(path, *, seed: int):
    """A LoRA adapter for tiny in mlx-lm's layout, with nonzero B so it changes outputs."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from engine.models.tiny import tiny_model

    params = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    model = tiny_model()
    model.freeze()
    linear_to_lora_layers(model, 4, params)
    lora = {}
    for i, (name, p) in enumerate(tree_flatten(model.trainable_parameters())):
        lora[name] = 0.1 * mx.random.normal(p.shape, key=mx.random.key(seed * 1000 + i))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), lora)
    config = {"fine_tune_type": "lora", "num_layers": 4, "lora_parameters": params}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_adapter_changes_outputs_and_identity(tmp_path):
    """An mlx-lm LoRA adapter is applied (outputs change), its digest becomes the identity's
    adapter component (same files -> same identity, other values -> other identity), and
    a directory that is not an adapter is a typed error."""
    base = load_model("tiny")
    a1 = load_model("tiny", adapter=_save_lora(tmp_path / "a1", seed=1))
    again = load_model("tiny", adapter=tmp_path / "a1")
    a2 = load_model("tiny", adapter=_save_lora(tmp_path / "a2", seed=2))
    assert a1.identity.components["adapter"] != "none"
    assert a1.identity == again.identity
    assert len({base.identity.digest, a1.identity.digest, a2.identity.digest}) == 3
    x = mx.array(PROMPT)[None]
    assert not mx.array_equal(
        base.model(x, cache=base.make_cache()), a1.model(x, cache=a1.make_cache())
    )
    assert a1.layout == base.layout
    with pytest.raises(ModelLoadError, match="not an adapter directory"):
        load_model("tiny", adapter=tmp_path)
