"""LoadedModel: a built model wrapped with what kvpack needs to know of it.

- LoadedModel: an mlx-lm module, its tokenizer, its identity and KV layout, and the path
  it was read from (None for tiny); make_cache() returns fresh mlx-lm caches. Its
  alignment is its identity's; `with_namespace` gives the same model (same module,
  shared) under a tenant's identity; `context_length` is how many tokens (prompt +
  generated) it takes.
- assemble: what every loader (engine/models/gguf.py, mlxdir.py, tiny) ends with: apply
  an adapter if any, measure the dtypes, read the layout and derive the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import get_total_parameters

from engine.identity import Identity, build_identity
from engine.layout import KVLayout, dtype_name, kv_layout_of
from engine.tokenizer import Tokenizer

DEFAULT_CONTEXT_LENGTH = 4096  # when the model's configuration does not say


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

    @property
    def context_length(self) -> int:
        """Prompt + generated tokens the model takes: its configuration's
        max_position_embeddings, or DEFAULT_CONTEXT_LENGTH when that does not say."""
        args = getattr(self.model, "args", None)
        return getattr(args, "max_position_embeddings", None) or DEFAULT_CONTEXT_LENGTH

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
