"""KV layout: the shape of a model's cache, layer by layer.

- LayerKV: one layer's cache — `full` (grows with the sequence; mlx-lm KVCache) or
  `sliding` (a ring of `window` positions, the first `keep` pinned; RotatingKVCache) —
  with its kv heads and head dim.
- KVLayout: every layer in order plus the dtype the planes are stored in.

The layout is part of the identity and is what a restore's shape gate checks against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


class UnsupportedCache(TypeError):
    """A model's cache is neither a KVCache nor a RotatingKVCache."""

    def __init__(self, layer: int, cache_type: str) -> None:
        super().__init__(f"layer {layer}: cache type {cache_type} is not supported")
        self.layer = layer
        self.cache_type = cache_type


@dataclass(frozen=True)
class LayerKV:
    kind: Literal["full", "sliding"]
    kv_heads: int
    head_dim: int
    window: int | None = None  # sliding only: ring size
    keep: int = 0  # sliding only: leading positions never evicted

    @property
    def sliding(self) -> bool:
        return self.kind == "sliding"


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerKV, ...]
    dtype: str  # e.g. "float32"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.sliding)

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "layers": [asdict(layer) for layer in self.layers]}

    def cache_bytes(self, tokens: int) -> int:
        """What one slot's caches hold at `tokens` positions: K and V of every layer, a
        sliding layer's at most its window."""
        itemsize = getattr(mx, self.dtype).size
        return sum(
            2 * layer.kv_heads * layer.head_dim * itemsize
            * (min(tokens, layer.window) if layer.sliding and layer.window else tokens)
            for layer in self.layers
        )  # fmt: skip


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def kv_layout_of(model: nn.Module, *, dtype: mx.Dtype) -> KVLayout:
    """Read the layout from the model's own cache factory and its attention modules."""
    caches = make_prompt_cache(model)
    layers = []
    for i, (cache, block) in enumerate(zip(caches, model.layers, strict=True)):
        kv_heads, head_dim = _kv_shape(model, block)
        # RotatingKVCache subclasses nothing we match on first; check it before KVCache.
        if isinstance(cache, RotatingKVCache):
            layers.append(LayerKV("sliding", kv_heads, head_dim, cache.max_size, cache.keep))
        elif isinstance(cache, KVCache):
            layers.append(LayerKV("full", kv_heads, head_dim))
        else:
            raise UnsupportedCache(i, type(cache).__name__)
    return KVLayout(tuple(layers), dtype_name(dtype))


def _kv_shape(model: nn.Module, block: nn.Module) -> tuple[int, int]:
    attn = getattr(block, "self_attn", None)
    args = model.args
    kv_heads = getattr(attn, "n_kv_heads", None) or getattr(args, "num_key_value_heads", None)
    kv_heads = kv_heads or args.num_attention_heads
    head_dim = getattr(attn, "head_dim", None) or getattr(args, "head_dim", None)
    head_dim = head_dim or args.hidden_size // args.num_attention_heads
    return int(kv_heads), int(head_dim)
