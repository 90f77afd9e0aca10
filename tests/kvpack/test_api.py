"""The Python API (kvpack/api.py) on `tiny` (A = 64) and an embedded vault: kvpack.open,
vault.model, model.generate and stream_generate through the service's ladder, the typed
errors, several models on one vault, and an `import kvpack` that loads nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvpack
from engine.errors import InvalidRequest
from engine.models import ModelLoadError, ModelNotCached
from kvpack import api
from kvpack.config import ConfigError
from tests.engine.slotkit import TINY_A
from tests.engine.test_streams import released_on

ROOT = Path(__file__).resolve().parents[2]
TEXT = "A vault for prefix state: restore it, never recompute it. " * 6  # > 4 blocks
MAX = 24


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE_DIR", str(tmp_path / "kvpack-cache"))


def test_import_kvpack_loads_neither_mlx_nor_sqlalchemy():
    """A fresh `import kvpack` (the command line does it too) leaves MLX and SQLAlchemy
    unloaded; touching kvpack.open loads them — the control that the probe can see them."""
    probe = (
        "import json, sys, kvpack\n"
        "heavy = lambda: sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'sqlalchemy'})\n"
        "before = heavy(); kvpack.open\n"
        "print(json.dumps([before, heavy()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout) == [[], ["mlx", "sqlalchemy"]]


def test_generate_cold_then_resident_then_durable(settings, open_vault):
    """The same text three times: cold (no tier), then the whole prompt from the resident
    tier (no prefill), then on a new vault client with no resident budget from the durable
    tier; the same tokens and text each time, with the times the server reports."""
    vault = open_vault(settings)
    model = vault.model("tiny")
    cold = model.generate(TEXT, max_tokens=MAX)
    assert (cold.tier, cold.cached_tokens, cold.restore_seconds) == ("none", 0, 0.0)
    assert cold.prefill_seconds > 0 and cold.prompt_tokens == len(model.encode(TEXT))
    assert vault.flush(60)
    warm = model.generate(TEXT, max_tokens=MAX)
    assert (warm.tier, warm.cached_tokens, warm.prefill_seconds) == (
        "resident", cold.prompt_tokens, 0.0,
    )  # fmt: skip
    assert warm.restore_seconds > 0
    vault.close()
    again = open_vault(settings, resident_budget_bytes=0).model("tiny")
    durable = again.generate(TEXT, max_tokens=MAX)
    assert (durable.tier, durable.cached_tokens) == ("durable", cold.prompt_tokens)
    assert cold.tokens == warm.tokens == durable.tokens and len(cold.tokens) == MAX
    assert cold.text == warm.text == durable.text == again.decode(cold.tokens)


def test_closing_releases_the_engine_threads_mlx_streams(settings, open_vault, monkeypatch):
    """The client's engine thread ran the model; closing the client releases its streams
    there, as that thread's last job (MLX 0.32 can abort the process at exit otherwise:
    engine/streams.py)."""
    released = released_on(monkeypatch)
    vault = open_vault(settings)
    vault.model("tiny").generate(TEXT, max_tokens=2)
    vault.close()
    assert [n for n in released if n.startswith("kvpack-engine")] == ["kvpack-engine_0"]


def test_a_prompt_as_text_token_ids_or_messages(settings, open_vault):
    """Text is encoded, token ids are taken as given, messages go through the chat
    template (chat_tokens): each form of one prompt completes alike."""
    model = open_vault(settings).model("tiny")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    chat = model.chat_tokens(messages)
    assert chat != model.encode(TEXT) and model.tokenizer.decode(chat).count(TEXT) == 1
    by_messages = model.generate(messages=messages, max_tokens=MAX)
    by_ids = model.generate(chat, max_tokens=MAX)
    assert by_messages.prompt_tokens == len(chat) and by_ids.tokens == by_messages.tokens
    by_text = model.generate(TEXT, max_tokens=MAX)
    assert model.generate(model.encode(TEXT), max_tokens=MAX).tokens == by_text.tokens


def test_sampling_and_stop_strings_match_a_cold_run(settings, open_vault):
    """A seeded, tempered, nucleus request draws the same tokens cold and restored, and
    another seed draws others; a stop string cuts the text before its first occurrence
    and finishes with "stop"."""
    vault = open_vault(settings)
    model = vault.model("tiny")
    options = {"max_tokens": MAX, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    cold = model.generate(TEXT, **options)
    assert vault.flush(60)
    warm = model.generate(TEXT, **options)
    assert warm.tier == "resident" and warm.tokens == cold.tokens
    assert model.generate(TEXT, **{**options, "seed": 8}).tokens != cold.tokens
    greedy = model.generate(TEXT, max_tokens=MAX)
    stop = greedy.text[6:9]
    stopped = model.generate(TEXT, max_tokens=MAX, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == greedy.text[: greedy.text.find(stop)]


def test_stream_generate_yields_the_text_and_stops_when_closed(settings, open_vault):
    """The pieces join to the completion's text, the completion equals generate's; a
    stream closed after its first piece ends "cancelled", far short of its length, and
    the engine serves the next call."""
    model = open_vault(settings).model("tiny")
    stream = model.stream_generate(TEXT, max_tokens=MAX)
    assert stream.completion is None
    pieces = list(stream)
    done = stream.completion
    assert done is not None and "".join(pieces) == done.text and len(pieces) > 1
    assert model.generate(TEXT, max_tokens=MAX).tokens == done.tokens
    with model.stream_generate(TEXT, max_tokens=4000) as long:
        next(long)
    assert long.completion.finish_reason == "cancelled" and len(long.completion.tokens) < 4000
    assert model.generate(TEXT, max_tokens=2).tokens == done.tokens[:2]


def test_errors_are_the_typed_errors_the_server_maps(settings, open_vault, hub_cache):
    """Each bad input is an InvalidRequest naming its field (the context ones a
    ContextLengthExceeded), a model that does not load a ModelLoadError (ModelNotCached
    naming the repo), a bad setting a ConfigError, and any call after close VaultClosed."""
    vault = open_vault(settings)
    model = vault.model("tiny")
    long = [65] * model.context_length
    bad = {
        "prompt": [{}, {"prompt": TEXT, "messages": [{"role": "user", "content": "x"}]},
                   {"prompt": ""}, {"prompt": [1, 2.5]}, {"prompt": long}],
        "messages": [{"messages": []}, {"messages": "hi"}, {"messages": [{"role": "user"}]}],
        "max_tokens": [{"prompt": TEXT, "max_tokens": -1},
                       {"prompt": TEXT, "max_tokens": model.context_length}],
        "temperature": [{"prompt": TEXT, "temperature": 2.5}, {"prompt": TEXT, "temperature": "1"}],
        "top_p": [{"prompt": TEXT, "top_p": 0}],
        "seed": [{"prompt": TEXT, "seed": -1}, {"prompt": TEXT, "seed": 2**63}],
        "stop": [{"prompt": TEXT, "stop": list("abcde")}, {"prompt": TEXT, "stop": [""]}],
        "tokens": [{"prompt": [1, model.tokenizer.vocab_size + 5]}],
    }  # fmt: skip
    for field, cases in bad.items():
        for kwargs in cases:
            with pytest.raises(InvalidRequest) as info:
                model.generate(**kwargs)
            assert info.value.field == field, kwargs
    with pytest.raises(api.ContextLengthExceeded) as info:
        model.generate(TEXT, max_tokens=model.context_length)
    assert info.value.context_length == model.context_length
    with pytest.raises(ModelNotCached) as missing:
        vault.model("kvpack-test/absent", hf_cache=hub_cache)
    assert missing.value.repo_id == "kvpack-test/absent"
    with pytest.raises(ModelLoadError):
        vault.model("no-such-model")
    with pytest.raises(ConfigError):
        kvpack.open(data_dir=settings.data_dir, alignment=0)
    with pytest.raises(InvalidRequest):
        kvpack.open(settings=settings, namespace="other")
    vault.close()
    for call in (lambda: model.generate(TEXT), lambda: vault.model("tiny"),
                 lambda: vault.prompt_cache(model, [1, 2])):  # fmt: skip
        with pytest.raises(api.VaultClosed):
            call()


def test_several_models_share_one_vault_and_close_together(settings, tiny_models):
    """One spec is one model; a 4-bit and an 8-bit copy are two services on the client's
    one vault and resident tier, with their own identities; leaving the `with` block
    closes the services and the vault."""
    with kvpack.open(settings=settings) as vault:
        assert vault.model("tiny") is vault.model("tiny")
        q4, q8 = vault.model(str(tiny_models["q4g64"])), vault.model(str(tiny_models["q8g64"]))
        assert q4.service.vault is q8.service.vault is vault.vault
        assert q4.service.resident is q8.service.resident is vault.resident
        assert q4.identity != q8.identity and q4.alignment == TINY_A
        for m in (q4, q8):
            assert m.generate(TEXT, max_tokens=2).tier == "none"
    assert vault.vault.io.loop.is_closed()
    assert q4.service.background.submit("late", lambda: None) is False  # closed


def test_open_reads_the_settings_kvpack_serve_reads(tmp_path, monkeypatch):
    """open() takes every setting (kvpack/config.py) by name, refuses an unknown one, and
    like `kvpack serve` fills the rest from the environment, then the TOML file."""
    with pytest.raises(ConfigError, match="colour"):
        kvpack.open(data_dir=tmp_path / "x", colour="blue")
    toml = tmp_path / "kvpack.toml"
    toml.write_text(f'namespace = "from-toml"\nalignment = {TINY_A}\n')
    monkeypatch.setenv("KVPACK_DATA_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("KVPACK_NAMESPACE", "from-env")
    with kvpack.open(config_file=toml, namespace="given") as vault:
        s = vault.settings
        assert (s.data_dir, s.namespace, s.alignment) == (tmp_path / "from-env", "given", TINY_A)
    assert (tmp_path / "from-env" / "catalog.sqlite3").is_file()


def test_a_hugging_face_repo_id_cold_warm_and_durable(settings, open_vault, hub_cache):
    """vault.model("kvpack-test/tiny") reads the cached snapshot of main; its tag "v1" is
    the 4-bit copy, another identity. The repo id serves cold, then resident, then durable
    on a new vault client, with one text."""
    vault = open_vault(settings)
    model = vault.model("kvpack-test/tiny", hf_cache=hub_cache)
    tagged = vault.model("kvpack-test/tiny@v1", hf_cache=hub_cache)
    assert model.name == "kvpack-test/tiny" and model.path.parent.name == "snapshots"
    assert tagged.path != model.path and tagged.identity != model.identity
    cold = model.generate(TEXT, max_tokens=MAX)
    assert vault.flush(60)
    warm = model.generate(TEXT, max_tokens=MAX)
    vault.close()
    again = open_vault(settings, resident_budget_bytes=0).model(
        "kvpack-test/tiny", hf_cache=hub_cache
    )
    durable = again.generate(TEXT, max_tokens=MAX)
    assert [c.tier for c in (cold, warm, durable)] == ["none", "resident", "durable"]
    assert cold.text == warm.text == durable.text and cold.tokens == durable.tokens
