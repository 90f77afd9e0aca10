"""The demo model as users keep it: an mlx-lm directory written from the demo GGUF and its
copies converted with mlx-lm's own utilities (the `demo_models` fixture: float32, 4-bit,
8-bit, bfloat16), one of them as a Hugging Face repo in a cache. Each copy has its own
identity, serves bit-identical reuse through Slot.restore, and mlx-lm's own generation
continues an engine cut bit-identically.

Quantized and half-precision kernels are ~20-40x slower than float32 on a CPU, so the
reuse checks use A = 32 and a prompt of a few blocks."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from engine.errors import IdentityMismatch
from engine.format import encode
from engine.interop import to_mlx_lm
from engine.models import load_model
from engine.slots import SlotPool
from tests.engine.slotkit import assert_reuse_is_bit_identical, cold, physical
from tests.fixtures.models import COMMITS, DEMO_VARIANTS, add_hub_repo

pytestmark = pytest.mark.slow

A = 32
QUESTION = [{"role": "user", "content": "Name the largest planet of the solar system."}]


@pytest.fixture(scope="module")
def demo(demo_models, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPACK_CACHE_DIR", str(tmp_path_factory.mktemp("kvpack-cache")))
        models = {v: load_model(str(demo_models[v]), alignment=A) for v in DEMO_VARIANTS}
        tokens = models["float32"].tokenizer.apply_chat_template(QUESTION)
        yield SimpleNamespace(models=models, dirs=demo_models, tokens=tokens)


def test_the_directory_copy_is_the_gguf_model(demo):
    """The float32 directory mlx-lm loads computes what the GGUF loader builds: same logits
    bytes over the prompt, same identity but for the weights' digest."""
    gguf, copy = load_model("smollm2", alignment=A), demo.models["float32"]
    ca, cb = gguf.identity.components, copy.identity.components
    assert {k for k in ca if ca[k] != cb[k]} == {"weights"}
    x = mx.array(demo.tokens)[None]
    assert mx.array_equal(
        gguf.model(x, cache=gguf.make_cache()), copy.model(x, cache=copy.make_cache())
    )


def test_each_copy_has_its_own_identity_and_never_takes_anothers_cut(demo):
    """float32, 4-bit, 8-bit and bfloat16: four identities; the 4-bit and 8-bit ones differ
    in weights and quantization only; the 4-bit cut (same KV shapes and dtype as the
    8-bit and float32 ones) is refused by both on identity, their slots untouched."""
    m = demo.models
    assert len({x.identity.digest for x in m.values()}) == 4
    c4, c8 = m["q4"].identity.components, m["q8"].identity.components
    assert {k for k in c4 if c4[k] != c8[k]} == {"weights", "quantization"}
    assert {q["bits"] for q in c4["quantization"]} == {4}
    assert {q["bits"] for q in c8["quantization"]} == {8}
    assert m["bfloat16"].layout.dtype == "bfloat16" and m["q4"].layout.dtype == "float32"
    short = demo.tokens[: A + 4]
    cut = cold(SlotPool(m["q4"], num_slots=1), short).export()
    for other in ("q8", "float32"):
        pool = SlotPool(m[other], num_slots=1)
        assert pool.layout == m["q4"].layout
        held = cold(pool, demo.tokens[:8])
        before = (held.state, physical(held))
        with pytest.raises(IdentityMismatch):
            held.restore(encode(cut), prompt=short)
        assert held.state is before[0] and physical(held) == before[1]


@pytest.mark.parametrize("variant", list(DEMO_VARIANTS))
def test_cold_equals_restored_exact_and_ancestor(demo, variant):
    """Each copy on the chat prompt: the exact cut and the aligned cut at 32, restored
    through their planes, give the cold run's cache bytes, logits and next tokens."""
    pool = SlotPool(demo.models[variant], num_slots=2)
    assert len(demo.tokens) > A
    assert_reuse_is_bit_identical(pool, demo.tokens, ancestor=A, steps=3)


def test_a_repo_id_in_the_cache_loads_the_4bit_copy(demo, tmp_path):
    """The 4-bit directory laid out as a Hugging Face repo: its repo id loads the same
    model (same identity) from the snapshot."""
    cache = tmp_path / "hub"
    add_hub_repo(
        cache,
        "kvpack-test/SmolLM2-135M-Instruct-4bit",
        snapshots={COMMITS["a"]: demo.dirs["q4"]},
        refs={"main": COMMITS["a"]},
    )
    m = load_model("kvpack-test/SmolLM2-135M-Instruct-4bit", alignment=A, hf_cache=cache)
    assert m.identity == demo.models["q4"].identity
    assert m.path.parent.name == "snapshots"


def test_mlx_lm_generate_from_a_restored_cut_is_bit_identical_to_cold(demo):
    """At the default A = 256, on a ~300-token prompt: the engine's aligned cut at 256 in
    mlx-lm's own stream_generate (mlx-lm's own load of the directory, prefill_step_size
    256) yields the cold mlx-lm run's tokens and log-probability bytes."""
    from mlx_lm import stream_generate
    from mlx_lm.utils import load as mlx_lm_load

    pool = SlotPool(load_model(str(demo.dirs["float32"])), num_slots=1)
    model, tokenizer = mlx_lm_load(str(demo.dirs["float32"]))
    system = "Answer briefly. The vault keeps prefix state sealed and addressed by content. "
    messages = [{"role": "system", "content": system * 20}, *QUESTION]
    prompt = pool.loaded.tokenizer.apply_chat_template(messages)
    assert 256 < len(prompt) < 512, len(prompt)

    def run(tokens, cache=None):
        return [
            (r.token, bytes(memoryview(r.logprobs)))
            for r in stream_generate(
                model, tokenizer, tokens, max_tokens=8, prompt_cache=cache, prefill_step_size=256
            )
        ]

    slot, cuts = pool.slot(0), {}
    slot.prefill(prompt[:256], on_boundary=lambda d: cuts.setdefault(d, slot.export()))
    restored = run(prompt[256:], to_mlx_lm(pool, encode(cuts[256])).caches)
    assert restored == run(prompt)
