"""Quantized and half-precision mlx-lm models on `tiny` (the `tiny_models` fixture: float32,
float16, bfloat16, 4-bit groups of 64 and 32, 8-bit groups of 64, converted with mlx-lm's
own utilities): each serves bit-identical reuse, each has its own identity, and a cut of
one never restores into another."""

from __future__ import annotations

import mlx.nn as nn
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

from engine.codec import frame
from engine.errors import IdentityMismatch
from engine.format import encode
from engine.models import assemble, load_model
from engine.slots import SlotPool
from tests.engine.slotkit import (
    PROMPT,
    TINY_A,
    assert_reuse_is_bit_identical,
    cold,
    physical,
)
from tests.fixtures.models import TINY_VARIANTS

KV_DTYPES = {"float16": "float16", "bfloat16": "bfloat16"}  # the others cache float32


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


def loaded(tiny_models, variant):
    return load_model(str(tiny_models[variant]), alignment=TINY_A)


def _differ(a, b) -> set[str]:
    ca, cb = a.identity.components, b.identity.components
    return {k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k)}


# What identities were made of before quantization and dtypes entered them.
FLOAT_COMPONENTS = {
    "weights", "tokenizer", "chat_template", "adapter", "kv_layout", "rope", "scalars",
    "model_args", "compute", "alignment", "pack_format", "namespace",
}  # fmt: skip


def test_each_variant_has_its_own_identity(tiny_models):
    """Six copies of one model, six identities. Between two quantizations only the weights
    and the quantization component differ; between precisions, the weights, the dtypes
    and the KV layout's dtype; the quantization component says what the modules do."""
    models = {v: loaded(tiny_models, v) for v in TINY_VARIANTS}
    assert len({m.identity.digest for m in models.values()}) == len(TINY_VARIANTS)
    assert _differ(models["q4g64"], models["q8g64"]) == {"weights", "quantization"}
    assert _differ(models["q4g64"], models["q4g32"]) == {"weights", "quantization"}
    assert _differ(models["float32"], models["q4g64"]) == {"weights", "quantization", "dtypes"}
    assert _differ(models["float32"], models["bfloat16"]) == {"weights", "kv_layout"}
    # Components that say nothing beyond the KV dtype are left out: a float32 model's
    # identity is made of exactly what it was made of before they existed.
    assert set(models["float32"].identity.components) == FLOAT_COMPONENTS
    assert "dtypes" not in models["bfloat16"].identity.components
    q4g32 = models["q4g32"].identity.components
    assert {(q["bits"], q["group_size"], q["mode"]) for q in q4g32["quantization"]} == {
        (4, 32, "affine")
    }
    assert sum(q["count"] for q in q4g32["quantization"]) == 30  # 29 linears + the embedding
    assert q4g32["dtypes"] == {"weights": ["float32", "uint32"], "logits": "float32"}
    assert models["bfloat16"].identity.components["kv_layout"]["dtype"] == "bfloat16"
    # Logical parameters: a packed weight counts as the values it holds.
    assert {m.num_params for m in models.values()} == {models["float32"].num_params}


def test_quantization_enters_the_identity_beyond_the_weights_digest(tiny_models):
    """The same float files quantized two ways at load (same weights digest) still give two
    identities: the quantization component is read from the built modules."""
    base = load_model(str(tiny_models["float32"]))
    digest = bytes.fromhex(base.identity.components["weights"])
    identities = []
    for bits in (4, 8):
        model, _ = mlx_lm_load_model(tiny_models["float32"])
        nn.quantize(model, group_size=64, bits=bits)
        identities.append(
            assemble(
                name="q",
                model=model,
                tokenizer=base.tokenizer,
                weights_digest=digest,
                alignment=256,
                namespace="default",
            ).identity
        )
    assert identities[0].components["weights"] == identities[1].components["weights"]
    assert identities[0].digest != identities[1].digest != base.identity.digest


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_cold_equals_restored_exact_and_ancestor(tiny_models, variant):
    """Each variant, prompt of ~9 windows, A = 64: the exact cut and the aligned cut at 256
    restored through their planes give the cold run's cache bytes and continuation; the
    planes carry the KV and logits in the model's own dtype (bfloat16 as its 16 bits)."""
    pool = SlotPool(loaded(tiny_models, variant), num_slots=2)
    dtype = KV_DTYPES.get(variant, "float32")
    assert pool.layout.dtype == dtype
    planes = assert_reuse_is_bit_identical(pool, PROMPT, ancestor=4 * TINY_A, steps=12)
    parts = dict(planes.parts)
    for role in ("block/0", "ring", "logits"):
        header, arrays = frame.decode_part(role, parts[role])
        assert {name for name, _ in header["arrays"]} == {dtype}, role
        assert all(str(a.dtype) == f"mlx.core.{dtype}" for a in arrays)
    data = parts["block/0"]
    _, arrays = frame.decode_part("block/0", data)
    _, _, header_len = frame._PREFIX.unpack_from(data)
    framing = frame._PREFIX.size + header_len + 32  # prefix, header, digest
    assert len(data) == framing + sum(a.size for a in arrays) * (4 if dtype == "float32" else 2)


def test_a_cut_never_restores_into_another_variant(tiny_models):
    """The 4-bit cut offered to the 8-bit and the float32 pools (whose caches have the very
    same shapes and dtype) is refused on identity, and the slots keep what they held."""
    q4 = SlotPool(loaded(tiny_models, "q4g64"), num_slots=1)
    snap = cold(q4, PROMPT).export()
    for other in ("q8g64", "float32", "q4g32"):
        pool = SlotPool(loaded(tiny_models, other), num_slots=1)
        assert pool.layout == q4.layout
        held = cold(pool, PROMPT[:100])
        before = (held.state, physical(held))
        with pytest.raises(IdentityMismatch):
            held.restore(encode(snap), prompt=PROMPT)
        assert held.state is before[0] and physical(held) == before[1]
