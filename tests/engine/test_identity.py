"""engine.identity: every component moves the digest; equal content gives an equal digest;
the weight-digest cache skips unchanged files and rehashes changed ones."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3_text

from engine.errors import InvalidRequest
from engine.identity import (
    NO_ADAPTER,
    Identity,
    WeightDigests,
    arrays_digest,
    build_identity,
    default_cache_dir,
)
from engine.layout import KVLayout
from engine.models import load_model
from engine.models.tiny import CONFIG, tiny_tokenizer, tiny_weights


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


def _base(**overrides):
    tiny = load_model("tiny")
    kwargs = dict(
        model=tiny.model,
        weights_digest=bytes.fromhex(tiny.identity.components["weights"]),
        tokenizer=tiny.tokenizer,
        layout=tiny.layout,
        alignment=256,
        namespace="default",
        logits_dtype="float32",
        adapter_digest=None,
    )
    return build_identity(**{**kwargs, **overrides})


def _model(**config):
    return gemma3_text.Model(gemma3_text.ModelArgs.from_dict({**CONFIG, **config}))


def test_build_identity_matches_load_model():
    """build_identity over tiny's parts reproduces the identity load_model computed."""
    assert _base() == load_model("tiny").identity


def test_every_component_changes_the_digest():
    """Weights, tokenizer, chat template, adapter, KV layout (window, heads, dtype), rope
    (theta, local base), scalars (eps, attention scale), compute (BLAS), alignment, pack
    format and namespace each give a distinct digest."""
    tok = tiny_tokenizer()
    layout = load_model("tiny").layout
    other_tok = replace(tok, backend=_with_extra_special(tok.backend))
    variants = {
        "base": _base(),
        "weights": _base(weights_digest=b"\x01" * 32),
        "tokenizer": _base(tokenizer=other_tok),
        "chat_template": _base(tokenizer=replace(tok, chat_template=tok.chat_template + " ")),
        "adapter": _base(adapter_digest=b"\x02" * 32),
        "window": _base(layout=_relayer(layout, 0, window=64)),
        "kv_heads": _base(layout=_relayer(layout, 1, kv_heads=4)),
        "dtype": _base(layout=KVLayout(layout.layers, "bfloat16")),
        "rope_theta": _base(model=_model(rope_theta=20_000.0)),
        "rope_local": _base(model=_model(rope_local_base_freq=5_000.0)),
        "eps": _base(model=_model(rms_norm_eps=1e-5)),
        "attn_scale": _base(model=_model(query_pre_attn_scalar=32)),
        "compute": _base(compute={"device": "cpu", "blas": "bundled", "mlx": "0.0"}),
        "alignment": _base(alignment=128),
        "pack_format": _base(pack_format=2),
        "namespace": _base(namespace="tenant-b"),
    }
    digests = {name: ident.digest for name, ident in variants.items()}
    assert len(set(digests.values())) == len(digests), digests
    assert variants["base"].components["adapter"] == NO_ADAPTER
    assert variants["attn_scale"].components["scalars"]["attention_scale"] == 32**-0.5


def _with_extra_special(backend):
    import tokenizers

    clone = tokenizers.Tokenizer.from_str(backend.to_str())
    clone.add_special_tokens([tokenizers.AddedToken("<tool>", special=True)])
    return clone


def _relayer(layout: KVLayout, i: int, **changes) -> KVLayout:
    layers = list(layout.layers)
    layers[i] = replace(layers[i], **changes)
    return KVLayout(tuple(layers), layout.dtype)


def test_namespace_salt_separates_tenants():
    """The same model under two namespaces has two identities; the same namespace, one."""
    a = load_model("tiny", namespace="tenant-a")
    b = load_model("tiny", namespace="tenant-b")
    assert a.identity.digest != b.identity.digest
    assert load_model("tiny", namespace="tenant-a").identity == a.identity
    with pytest.raises(ValueError, match="namespace"):
        load_model("tiny", namespace="")
    with pytest.raises(ValueError, match="alignment"):
        load_model("tiny", alignment=0)


def test_with_namespace_is_the_tenant_identity():
    """Identity.with_namespace: the identity load_model builds under that namespace (so a
    tenant's pool and a tenant's vault agree), differing from the original only in the
    namespace component; namespace and alignment read back from the components; an empty
    namespace is an InvalidRequest naming the field."""
    base = load_model("tiny", alignment=128)
    tenant = base.identity.with_namespace("tenant-b")
    assert tenant == load_model("tiny", alignment=128, namespace="tenant-b").identity
    assert tenant.digest != base.identity.digest
    assert {k: v for k, v in tenant.components.items() if k != "namespace"} == {
        k: v for k, v in base.identity.components.items() if k != "namespace"
    }
    assert (tenant.namespace, tenant.alignment) == ("tenant-b", 128)
    assert (base.identity.namespace, base.alignment) == ("default", 128)
    with pytest.raises(InvalidRequest) as e:
        base.identity.with_namespace("")
    assert e.value.field == "namespace"


def test_loaded_model_with_namespace_shares_the_model():
    """LoadedModel.with_namespace: same module and tokenizer, the tenant's identity, and
    the alignment read from that identity."""
    base = load_model("tiny", alignment=64)
    tenant = base.with_namespace("tenant-c")
    assert tenant.model is base.model and tenant.tokenizer is base.tokenizer
    assert tenant.identity == base.identity.with_namespace("tenant-c")
    assert tenant.alignment == 64


def test_same_content_same_digest_and_describe():
    """Identity.of is canonical (key order free) and rebuilding from printed components
    gives the same identity; describe() prints every component."""
    comps = {"b": 1, "a": {"y": [1, 2], "x": "s"}}
    assert Identity.of(comps) == Identity.of(dict(reversed(comps.items())))
    ident = load_model("tiny").identity
    assert Identity.of(json.loads(json.dumps(dict(ident.components)))) == ident
    text = ident.describe()
    assert text.splitlines()[0] == f"identity {ident.hex}"
    for key in (
        "weights",
        "tokenizer",
        "chat_template",
        "adapter",
        "kv_layout",
        "rope",
        "scalars",
        "compute",
        "alignment",
        "pack_format",
        "namespace",
    ):
        assert f"  {key}: " in text
    assert len(ident.digest) == 32 and ident.short == ident.hex[:12]


def test_arrays_digest_covers_names_shapes_dtypes_and_values():
    """Generated weights are hashed by name, dtype, shape and bytes; one flipped value,
    a rename, a reshape or a dtype change moves the digest; a fresh generation does not."""
    w = dict(tiny_weights())
    base = arrays_digest(w)
    name = sorted(w)[0]
    a = w[name]
    assert arrays_digest(dict(w)) == base
    flipped = mx.array(a)
    flipped[(0,) * a.ndim] = flipped[(0,) * a.ndim] + 1
    assert arrays_digest({**w, name: flipped}) != base
    assert arrays_digest({**{k: v for k, v in w.items() if k != name}, name + "x": a}) != base
    assert arrays_digest({**w, name: a.reshape(-1)}) != base
    assert arrays_digest({**w, name: a.astype(mx.float16)}) != base
    assert arrays_digest(dict(tiny_weights(2))) != base


def test_weight_digest_cache_hit_skips_rehash(tmp_path):
    """A second lookup, and a fresh WeightDigests after a 'restart', hash nothing."""
    f = tmp_path / "w.safetensors"
    f.write_bytes(os.urandom(1 << 20))
    cache_dir = tmp_path / "cache"
    first = WeightDigests(cache_dir)
    d = first.file_digest(f)
    assert first.hashed == 1
    assert first.file_digest(f) == d and first.hashed == 1
    restarted = WeightDigests(cache_dir)
    assert restarted.file_digest(f) == d and restarted.hashed == 0
    entry = json.loads((cache_dir / WeightDigests.FILE).read_text())[str(f.resolve())]
    assert entry["size"] == 1 << 20 and entry["blake3"] == d.hex()


def test_weight_digest_cache_rehashes_changed_files(tmp_path):
    """Changed content (same size) and a touched mtime both rehash; content decides the
    digest, so touching alone keeps it; a corrupt cache file only costs a rehash."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    digests = WeightDigests(tmp_path / "cache")
    d1 = digests.file_digest(f)
    st = f.stat()
    f.write_bytes(b"b" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    d2 = digests.file_digest(f)
    assert digests.hashed == 2 and d2 != d1
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000))
    assert digests.file_digest(f) == d2 and digests.hashed == 3
    (tmp_path / "cache" / WeightDigests.FILE).write_text("{not json")
    assert digests.file_digest(f) == d2 and digests.hashed == 4


def test_model_directory_digest_uses_the_cache(tmp_path):
    """Reloading an unchanged model directory hashes no file; rewriting a weight file with
    other values rehashes it and changes the identity."""
    from engine.models.mlxdir import load_model_dir
    from engine.models.tiny import save_tiny

    d = save_tiny(tmp_path / "m")
    digests = WeightDigests(tmp_path / "cache")
    a = load_model_dir(d, alignment=256, namespace="default", digests=digests)
    assert digests.hashed == 1
    b = load_model_dir(d, alignment=256, namespace="default", digests=digests)
    assert digests.hashed == 1 and b.identity == a.identity
    save_tiny(d, seed=2)
    c = load_model_dir(d, alignment=256, namespace="default", digests=digests)
    assert digests.hashed == 2 and c.identity.digest != a.identity.digest


def test_default_cache_dir_env_override(tmp_path, monkeypatch):
    """KVPACK_CACHE_DIR wins; otherwise XDG_CACHE_HOME/kvpack."""
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("KVPACK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kvpack"


def test_engine_identity_command(capsys):
    """`kvpack engine identity`: --hex prints the digest, the default prints components,
    a bad spec exits 2 with the typed error's message."""
    import argparse

    from kvpack.commands import engine as engine_cmd

    parser = argparse.ArgumentParser()
    engine_cmd.register(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(["engine", "identity", *argv])
        rc = args.func(args)
        return rc, capsys.readouterr().out

    tiny = load_model("tiny", namespace="t1")
    assert run("--model", "tiny", "--namespace", "t1", "--hex") == (0, tiny.identity.hex + "\n")
    rc, out = run("--model", "tiny")
    assert rc == 0 and "model tiny (182,080 parameters)" in out and "  kv_layout: " in out
    rc, out = run("--model", "no-such-model")
    assert rc == 2 and "cannot load model 'no-such-model'" in out
