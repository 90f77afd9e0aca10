"""Identity: the digest of everything that makes a KV state meaningful.

Components (all from content, never from names):
- weights: digest of the weight files (or, for generated weights, of the arrays),
- tokenizer / chat_template / adapter: their digests (no adapter -> a fixed marker),
- kv_layout: layers, which slide and their window, kv heads, head dim, dtype,
- rope / scalars: rope theta, order, scaling; norm eps, attention scale, softcaps,
- model_args: the architecture's full configuration,
- quantization: how the model's modules are quantized, read from the built modules (not
  the config): each distinct (module type, bits, group size, mode) with its count — so a
  4-bit and an 8-bit copy of one model, or one file quantized two ways at load, never
  share an identity (absent for an unquantized model),
- dtypes: the dtypes of the parameters ("weights", packed integers included) and of the
  logits ("logits"); the activations' dtype is the kv_layout's (what the cache stores).
  Absent when every weight and the logits are of the kv_layout's dtype, so the
  identities of float32 models are what they were before these two components existed,
- compute: device, BLAS (library, version, kernel family) and MLX version — the things
  that round differently, so a state computed elsewhere would not continue bit-identically,
- alignment (A, the token count of a block), pack_format, namespace (the tenant salt).

Two states are interchangeable only under the same identity digest. A tenant's identity
is the model's with another namespace (`with_namespace`): same components, other salt.
Weight digests of files are remembered in a small JSON cache keyed by (path, size,
mtime_ns), so a restart does not rehash unchanged files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import blas
from engine.errors import InvalidRequest
from engine.layout import KVLayout, dtype_name
from engine.tokenizer import Tokenizer

# Version of the plane/pack encoding (engine/codec/); a new encoding is a new identity.
PACK_FORMAT_VERSION = 1
NO_ADAPTER = "none"
NOT_QUANTIZED = "none"
_DOMAIN = b"kvpack.identity.v1\0"
_HASH_BLOCK = 1 << 22

# Config keys that change rotary embeddings or the scalar math of attention and norms.
ROPE_KEYS = (
    "rope_theta",
    "rope_traditional",
    "rope_scaling",
    "rope_local_base_freq",
    "partial_rotary_factor",
    "max_position_embeddings",
)
SCALAR_KEYS = (
    "rms_norm_eps",
    "layer_norm_eps",
    "norm_eps",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "attention_multiplier",
    "embedding_multiplier",
    "residual_multiplier",
    "logits_scaling",
    "tie_word_embeddings",
    "hidden_act",
)


@dataclass(frozen=True)
class Identity:
    digest: bytes
    components: Mapping[str, Any]

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def short(self) -> str:
        return self.digest.hex()[:12]

    @property
    def namespace(self) -> str:
        return str(self.components["namespace"])

    @property
    def alignment(self) -> int:
        return int(self.components["alignment"])

    def with_namespace(self, namespace: str) -> Identity:
        """The same components under another namespace salt: another tenant, another digest."""
        _check_namespace(namespace)
        return Identity.of({**self.components, "namespace": namespace})

    @classmethod
    def of(cls, components: Mapping[str, Any]) -> Identity:
        """Digest of the canonical JSON of the components."""
        canonical = _canonical(components)
        digest = hashlib.sha256(_DOMAIN + canonical.encode()).digest()
        return cls(digest, json.loads(canonical))

    def describe(self) -> str:
        lines = [f"identity {self.hex}"]
        for key, value in self.components.items():
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            lines.append(f"  {key}: {text}")
        return "\n".join(lines)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, set | frozenset):
        return sorted(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def model_settings(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model_args, rope, scalars) read from an mlx-lm model."""
    args = model.args
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        raw = dataclasses.asdict(args)
    else:
        raw = dict(vars(args))
    model_args = json.loads(_canonical(raw))
    rope = {k: model_args[k] for k in ROPE_KEYS if k in model_args}
    scalars = {k: model_args[k] for k in SCALAR_KEYS if k in model_args}
    # The scale actually used in attention (some models derive it, e.g. query_pre_attn_scalar).
    attn = getattr(model.layers[0], "self_attn", None) if model.layers else None
    if attn is not None and hasattr(attn, "scale"):
        scalars["attention_scale"] = float(attn.scale)
    return model_args, rope, scalars


def quantization_of(model: nn.Module) -> list[dict[str, Any]] | str:
    """Each distinct quantization of the model's modules with how many modules use it."""
    counts: Counter[tuple[str, int, int, str]] = Counter()
    for _, module in model.named_modules():
        bits, group_size = getattr(module, "bits", None), getattr(module, "group_size", None)
        if isinstance(bits, int) and isinstance(group_size, int):
            mode = str(getattr(module, "mode", "affine"))
            counts[(type(module).__name__, bits, group_size, mode)] += 1
    if not counts:
        return NOT_QUANTIZED
    return [
        {"module": kind, "bits": bits, "group_size": group, "mode": mode, "count": n}
        for (kind, bits, group, mode), n in sorted(counts.items())
    ]


def weight_dtypes(model: nn.Module) -> list[str]:
    # mlx types tree_flatten as list | dict; without a destination it is a list of pairs.
    pairs = tree_flatten(model.parameters())
    return sorted({dtype_name(p.dtype) for _, p in pairs})  # type: ignore[str-unpack, union-attr]


def precision(model: nn.Module, layout: KVLayout, logits_dtype: str) -> dict[str, Any]:
    """The "quantization" and "dtypes" components, each only when it says more than the
    KV layout's dtype already does: an unquantized model whose weights and logits are all
    of that dtype (the float32 models kvpack has always served) keeps the identity it had
    before these components existed, so the cuts its vaults hold stay reachable."""
    out: dict[str, Any] = {}
    quantization = quantization_of(model)
    if quantization != NOT_QUANTIZED:
        out["quantization"] = quantization
    dtypes = {"weights": weight_dtypes(model), "logits": logits_dtype}
    if dtypes != {"weights": [layout.dtype], "logits": layout.dtype}:
        out["dtypes"] = dtypes
    return out


def compute_fingerprint() -> dict[str, str]:
    """Device, BLAS and MLX version of this process (see engine/blas.py)."""
    return {
        "device": str(mx.default_device()),
        "blas": blas.status().fingerprint(),
        "mlx": mx.__version__,  # type: ignore[attr-defined]  # mlx.core's stubs omit it
    }


def build_identity(
    *,
    model: nn.Module,
    weights_digest: bytes,
    tokenizer: Tokenizer,
    layout: KVLayout,
    alignment: int,
    namespace: str,
    logits_dtype: str,
    adapter_digest: bytes | None = None,
    pack_format: int = PACK_FORMAT_VERSION,
    compute: Mapping[str, str] | None = None,
) -> Identity:
    """`logits_dtype`: what the model's forward returns (engine.models measures it)."""
    if not isinstance(alignment, int) or alignment <= 0:
        raise InvalidRequest("alignment", f"must be a positive int, got {alignment!r}")
    _check_namespace(namespace)
    model_args, rope, scalars = model_settings(model)
    return Identity.of(
        {
            "weights": weights_digest.hex(),
            "tokenizer": tokenizer.digest.hex(),
            "chat_template": tokenizer.chat_template_digest.hex(),
            "adapter": adapter_digest.hex() if adapter_digest is not None else NO_ADAPTER,
            "kv_layout": layout.as_dict(),
            "rope": rope,
            "scalars": scalars,
            "model_args": model_args,
            **precision(model, layout, logits_dtype),
            "compute": dict(compute) if compute is not None else compute_fingerprint(),
            "alignment": alignment,
            "pack_format": pack_format,
            "namespace": namespace,
        }
    )


def _check_namespace(namespace: object) -> None:
    if not isinstance(namespace, str) or not namespace:
        raise InvalidRequest("namespace", f"must be a non-empty string, got {namespace!r}")


def arrays_digest(arrays: Mapping[str, mx.array]) -> bytes:
    """Digest of named arrays (name, dtype, shape, bytes), for weights that have no file."""
    h = blake3.blake3(b"kvpack.arrays.v1\0")
    for name in sorted(arrays):
        a = arrays[name]
        mx.eval(a)
        header = _canonical([name, str(a.dtype), list(a.shape)])
        h.update(header.encode() + b"\0")
        h.update(memoryview(a).cast("B"))  # type: ignore[arg-type]  # stubs lack __buffer__
    return h.digest()


def default_cache_dir() -> Path:
    if env := os.environ.get("KVPACK_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvpack"


class WeightDigests:
    """File digests remembered by (path, size, mtime_ns) in `<cache_dir>/weight-digests.json`."""

    FILE = "weight-digests.json"

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.path = (cache_dir or default_cache_dir()) / self.FILE
        self.hashed = 0  # files actually read and hashed by this instance (cache misses)

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _store(self, key: str, entry: dict[str, Any]) -> None:
        # Best effort: a read-only cache dir only costs a rehash next time.
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = self._load()
            data[key] = entry
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".weight-digests.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True, indent=1)
            os.replace(tmp, self.path)

    def file_digest(self, path: Path) -> bytes:
        path = Path(path).resolve()
        st = path.stat()
        key = str(path)
        entry = self._load().get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("blake3"), str)
        ):
            return bytes.fromhex(entry["blake3"])
        digest = _hash_file(path)
        self.hashed += 1
        self._store(key, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "blake3": digest.hex()})
        return digest

    def files_digest(self, paths: Sequence[Path], *, root: Path | None = None) -> bytes:
        """One digest over several files, each named relative to `root` (order-free)."""
        h = blake3.blake3(b"kvpack.files.v1\0")
        named = sorted(
            (str(Path(p).relative_to(root)) if root else Path(p).name, Path(p)) for p in paths
        )
        for name, p in named:
            h.update(name.encode() + b"\0" + self.file_digest(p))
        return h.digest()


def _hash_file(path: Path) -> bytes:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.digest()
