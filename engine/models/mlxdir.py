"""mlx-lm model directories: config.json + *.safetensors + tokenizer.json (local only).

The model is built by mlx-lm (`mlx_lm.utils.load_model`, any architecture it knows);
the tokenizer is the directory's tokenizer.json run by the `tokenizers` library, with
the chat template from chat_template.jinja or tokenizer_config.json. The weights
digest covers every safetensors file (cached by path, size and mtime).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from mlx_lm.utils import load_model as mlx_lm_load_model

from engine.identity import WeightDigests
from engine.models.errors import ModelLoadError, UnsupportedModel
from engine.models.loaded import LoadedModel, assemble
from engine.tokenizer import FastTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<eos>", ...} as some configs write it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(str(path.parent), f"{path.name} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def dir_tokenizer(path: Path, config: dict[str, Any]) -> FastTokenizer:
    spec = str(path)
    if not (path / "tokenizer.json").is_file():
        raise UnsupportedModel(
            spec, "no tokenizer.json (only `tokenizers` tokenizers are supported)"
        )
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok_config = _read_json(path / "tokenizer_config.json")
    template = tok_config.get("chat_template") or ""
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template", "") for t in template if isinstance(t, dict)}
        template = named.get("default", "")
    eos = [_token_text(tok_config.get("eos_token"))]
    eos_ids = config.get("eos_token_id")
    for i in eos_ids if isinstance(eos_ids, list) else [eos_ids]:
        if isinstance(i, int):
            eos.append(backend.id_to_token(i))
    eos_tokens = tuple(dict.fromkeys(t for t in eos if t is not None))
    if not eos_tokens:
        raise UnsupportedModel(spec, "no end-of-sequence token in tokenizer_config or config")
    try:
        return FastTokenizer(
            backend,
            template,
            bos_token=_token_text(tok_config.get("bos_token")),
            eos_tokens=eos_tokens,
        )
    except ValueError as e:
        raise UnsupportedModel(spec, str(e)) from e


def load_model_dir(
    path: Path,
    *,
    name: str | None = None,
    alignment: int,
    namespace: str,
    digests: WeightDigests | None = None,
    adapter: str | Path | None = None,
) -> LoadedModel:
    path = Path(path).resolve()
    spec = str(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(spec, "not a model directory (no config.json)")
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        raise ModelLoadError(spec, "no *.safetensors weight files")
    try:
        model, config = mlx_lm_load_model(path)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise UnsupportedModel(spec, f"mlx-lm cannot build it: {e}") from e
    tokenizer = dir_tokenizer(path, config)
    return assemble(
        name=name or path.name,
        model=model,
        tokenizer=tokenizer,
        weights_digest=(digests or WeightDigests()).files_digest(weight_files, root=path),
        alignment=alignment,
        namespace=namespace,
        adapter=adapter,
        path=path,
    )
