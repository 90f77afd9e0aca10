"""The Python API: the vault from your own code, on the ladder `kvpack serve` uses.

    import kvpack

    with kvpack.open(data_dir="~/.kvpack") as vault:
        model = vault.model("mlx-community/SmolLM2-135M-Instruct-4bit")
        out = model.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
        print(out.text, out.tier, out.cached_tokens, out.restore_seconds)

Words:
- vault client (VaultClient, what `open` returns): one vault (kvpack/vault.py) opened
  from the settings `kvpack serve` reads (Settings.load: these keyword arguments, then
  the KVPACK_* environment, then a TOML file), a resident tier its models share (one
  byte budget), and the engine thread.
- model (Model): a model the vault serves, by any spec `kvpack serve --model` takes
  ("tiny", "smollm2", an mlx-lm directory, a .gguf file, a Hugging Face repo id
  `org/name[@revision]` from the local cache; engine/models/__init__.py). Each is one
  Service (kvpack/service/service.py) over the shared vault: its slots, the ladder,
  publication and counters, as in the server. `vault.model(spec)` twice is one model.
- completion: what generate returns, the service's Completion — text, tokens,
  finish_reason, prompt_tokens, cached_tokens, tier, restore_seconds, prefill_seconds
  (what the server's `kvpack` object says). stream_generate yields the text as it comes
  and holds the same Completion in `completion` once it has ended.
- prompt cache: mlx-lm's own cache objects (kvpack/service/interop.py): `prompt_cache`
  restores what the vault holds into them, `publish` seals what mlx-lm computed.
- engine thread: MLX and the slots are used from one thread, as in the server; every
  call waits its turn there, so a VaultClient may be shared by threads.

Sampling: the server's options (temperature in [0, 2], top_p in (0, 1], seed in
[0, 2**63), at most 4 stop strings) with mlx-lm's defaults: temperature 0 (greedy),
top_p 1, seed 0. max_tokens 0 prefills (and publishes) without decoding.

Errors are the typed ones the server maps to HTTP statuses: InvalidRequest (a bad field,
named by `field`; 422) and its ContextLengthExceeded (413), ModelLoadError and its
ModelNotCached (a spec that does not load), ConfigError (a bad setting), a
RestoreRefused from publish (caches that do not fit), and VaultClosed after close().
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from catalog.manifest import Manifest
from engine import streams
from engine.errors import InvalidRequest
from engine.interop import prefill_aligned
from engine.sampling import Sampling
from engine.tokenizer import ChatTemplateError, Tokenizer
from kvpack.config import Settings
from kvpack.service import interop
from kvpack.service.interop import RestoredCache
from kvpack.service.service import Completion, CompletionRequest, Service
from kvpack.tiers.resident import DEFAULT_BUDGET_BYTES, ResidentTier
from kvpack.vault import DEFAULT_TIMEOUT_S, Vault

T = TypeVar("T")
DEFAULT_MAX_TOKENS = 256  # as the server and mlx-lm's generate
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_SEED = 2**63


class ContextLengthExceeded(InvalidRequest):
    """The prompt plus max_tokens is longer than the model's context (the server's 413)."""

    def __init__(self, field: str, *, prompt_tokens: int, max_tokens: int, context_length: int):
        super().__init__(
            field,
            f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed this model's "
            f"context of {context_length} tokens",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class VaultClosed(RuntimeError):
    """The vault client was closed; open a new one."""

    def __init__(self) -> None:
        super().__init__("this kvpack vault is closed")


def open(
    *,
    config_file: str | Path | None = None,
    settings: Settings | None = None,
    resident_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    io_timeout_s: float = DEFAULT_TIMEOUT_S,
    **overrides: Any,
) -> VaultClient:
    """Open the vault the settings name (the catalog migrated to head, as `kvpack serve`
    does). Every setting of kvpack/config.py can be given by name — data_dir, store_url,
    database_url, namespace, alignment, s3_endpoint, s3_region, s3_access_key,
    s3_secret_key, keyring_path, ... —; unset ones come from the environment, then
    `config_file`, then the defaults. Or pass complete `settings` and nothing else. An
    unknown name is a ConfigError naming it."""
    given = {name: value for name, value in overrides.items() if value is not None}
    if settings is None:
        settings = Settings.load(config_file=config_file, **given)
    elif given or config_file is not None:
        raise InvalidRequest("settings", "give complete settings or separate ones, not both")
    return VaultClient(
        settings, resident_budget_bytes=resident_budget_bytes, io_timeout_s=io_timeout_s
    )


class VaultClient:
    """An open vault, its models and the engine thread; a context manager that closes
    them all."""

    def __init__(
        self,
        settings: Settings,
        *,
        resident_budget_bytes: int = DEFAULT_BUDGET_BYTES,
        io_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.vault = Vault.open(settings, timeout_s=io_timeout_s)
        self.resident = ResidentTier(resident_budget_bytes)
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpack-engine")
        self._models: dict[tuple[str, str | None, str | None], Model] = {}
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()  # to stop on close
        self._lock = threading.Lock()  # the state below and the model table
        self._loading = threading.Lock()  # one model load at a time
        self._closed = False

    def __enter__(self) -> VaultClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    def model(
        self,
        spec: str,
        *,
        adapter: str | Path | None = None,
        hf_cache: str | Path | None = None,
    ) -> Model:
        """The model `spec` names, loaded once (kvpack serve --model's specs). `adapter`:
        an mlx-lm adapter directory; `hf_cache`: the Hugging Face cache to resolve a repo
        id in (default: huggingface_hub's, which follows HF_HUB_CACHE and HF_HOME).
        Raises ModelLoadError (ModelNotCached for a repo id that is not cached)."""
        key = (spec, None if adapter is None else str(adapter), None if hf_cache is None
               else str(hf_cache))  # fmt: skip
        with self._loading:  # one load per spec, even when two threads ask at once
            with self._lock:
                if self._closed:
                    raise VaultClosed()
                found = self._models.get(key)
            if found is not None:
                return found
            service = self._run(
                lambda: Service.open(
                    self.settings,
                    model=spec,
                    vault=self.vault,
                    resident=self.resident,
                    adapter=adapter,
                    hf_cache=hf_cache,
                )
            )
            model = Model(self, service)
            with self._lock:
                if self.closed:  # closed while loading: nobody else will close it
                    service.close()
                    raise VaultClosed()
                self._models[key] = model
            return model

    # -- mlx-lm's caches ----------------------------------------------------------------

    def prompt_cache(self, model: Model, tokens: Sequence[int]) -> RestoredCache:
        """What the vault holds for `tokens`, as fresh mlx-lm caches (`.caches`, the list
        make_prompt_cache returns) holding the first `.depth` tokens, with `.logits` (the
        cut's witnessed final logits, or None), `.tier` and `.restore_seconds`; depth 0,
        tier "none" and empty caches when no tier holds any of it. Asks the tiers as a
        request does (resident, durable, a peer); a restore is a hit of its tier.

        For mlx-lm's generate to continue bit-identically to its cold run, ask for
        `prompt[:-1]` and pass `prefill_step_size=model.alignment` (engine/interop.py)."""
        self._own(model)
        return self._run(lambda: interop.restore(model.service, tokens, namespace=self.namespace))

    def publish(
        self,
        model: Model,
        tokens: Sequence[int],
        prompt_cache: Sequence[Any] | RestoredCache,
        logits: mx.array | None = None,
    ) -> Manifest:
        """Seal mlx-lm caches holding `tokens` (and their final logits, when witnessed:
        what Model.prefill_aligned returns) into the vault; durable when this returns.
        Raises a RestoreRefused (ShapeMismatch, LogitsMissing, ...) when the caches do not
        fit the model, the depth or the alignment. Publish only caches prefill_aligned
        filled from empty or aligned caches: the gate sees shapes, not how the values were
        computed."""
        self._own(model)
        caches = prompt_cache.caches if isinstance(prompt_cache, RestoredCache) else prompt_cache
        return self._run(
            lambda: interop.publish(
                model.service, tokens, list(caches), logits=logits, namespace=self.namespace
            )
        )

    # -- lifetime ---------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every model's queued publication has been stored; False if
        `timeout` (seconds, per model) passed first."""
        with self._lock:
            models = list(self._models.values())
        return all([m.service.flush(timeout) for m in models])

    @property
    def closed(self) -> bool:
        """Whether close() has begun (another thread may close the client at any time)."""
        return self._closed

    def close(self) -> None:
        """Stop running generations, store what is queued (bounded wait), then close every
        model's service and the vault. Closing twice is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running, services = list(self._streams), [m.service for m in self._models.values()]
        for stream in running:
            stream.cancel()
        try:
            self._engine.submit(streams.release)  # its one thread's last job
            self._engine.shutdown(wait=True)
            for service in services:
                service.close()
        finally:
            self.vault.close()

    # -- the engine thread --------------------------------------------------------------

    def _submit(self, job: Callable[[], T]) -> Future[T]:
        with self._lock:
            if self._closed:
                raise VaultClosed()
            return self._engine.submit(job)

    def _run(self, job: Callable[[], T], cancel: threading.Event | None = None) -> T:
        future = self._submit(job)
        try:
            return future.result()
        except BaseException:
            if cancel is not None:  # e.g. Ctrl-C while waiting: stop the engine too
                cancel.set()
            raise

    def _own(self, model: Model) -> None:
        if not isinstance(model, Model) or model.client is not self:
            raise InvalidRequest("model", "a model of this vault (vault.model(spec))")


class Model:
    """A model the vault serves; make one with VaultClient.model(spec)."""

    def __init__(self, client: VaultClient, service: Service) -> None:
        self.client = client
        self.service = service
        loaded = service.loaded
        self.loaded = loaded
        self.context_length: int = loaded.context_length

    def __repr__(self) -> str:
        return f"Model({self.name!r}, identity={self.identity[:16]})"

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def identity(self) -> str:
        """The identity digest (hex), in the vault's namespace: whose cuts this model uses."""
        return self.loaded.identity.hex

    @property
    def alignment(self) -> int:
        return self.loaded.alignment

    @property
    def path(self) -> Path | None:
        """What was read: the directory, GGUF file or cache snapshot (None for tiny)."""
        return self.loaded.path

    @property
    def module(self) -> nn.Module:
        """The mlx-lm model module, for mlx-lm's own generate and caches."""
        return self.loaded.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    # -- tokens -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The messages through the model's chat template, with the generation prompt."""
        given: object = messages  # checked as it came, whatever the annotation says
        if isinstance(given, str | bytes) or not isinstance(given, Sequence):
            raise InvalidRequest("messages", "must be a list of {role, content} messages")
        if not messages:
            raise InvalidRequest("messages", "must not be empty")
        for i, m in enumerate(messages):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):  # fmt: skip
                raise InvalidRequest("messages", f"[{i}] is not a {{role, content}} of strings")
        try:
            return self.tokenizer.apply_chat_template(messages)
        except ChatTemplateError as e:
            raise InvalidRequest("messages", e.reason) from e

    # -- mlx-lm's caches ----------------------------------------------------------------

    def make_prompt_cache(self) -> list[Any]:
        """Fresh, empty mlx-lm caches for this model (make_prompt_cache)."""
        return self.loaded.make_cache()

    def prefill_aligned(self, caches: Sequence[Any], tokens: Sequence[int]) -> mx.array:
        """Run `tokens` into mlx-lm `caches` in steps that end on multiples of the
        alignment, as the engine prefills; returns the final logits. From empty or aligned
        caches this is what a cold engine run computes: caches VaultClient.publish takes."""
        return self.client._run(
            lambda: prefill_aligned(self.module, caches, tokens, alignment=self.alignment)
        )

    # -- generation -------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
    ) -> Completion:
        """Complete a prompt (text, or token ids as given) or chat `messages` (the chat
        template applied), from the deepest state the vault holds."""
        req = self._request(prompt, messages, max_tokens, temperature, top_p, seed, stop)
        cancel = threading.Event()
        return self.client._run(lambda: self.service.complete(req, cancel=cancel), cancel)

    def stream_generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
    ) -> Stream:
        """generate's text as it is produced: iterate for the pieces; `completion` once
        the iteration has ended. Leaving the loop early (or close()) stops the engine."""
        req = self._request(prompt, messages, max_tokens, temperature, top_p, seed, stop)
        return Stream(self.client, self.service, req)

    def _request(
        self,
        prompt: str | Sequence[int] | None,
        messages: Sequence[Mapping[str, Any]] | None,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stop: str | Sequence[str] | None,
    ) -> CompletionRequest:
        if (prompt is None) == (messages is None):
            raise InvalidRequest("prompt", "give a prompt (text or token ids) or messages")
        if messages is not None:
            tokens, field = self.chat_tokens(messages), "messages"
        elif isinstance(prompt, str):
            tokens, field = self.encode(prompt), "prompt"
        else:
            tokens, field = _token_ids(prompt), "prompt"
        if not tokens:
            raise InvalidRequest(field, "the prompt is empty")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidRequest("max_tokens", f"must be an int >= 0, got {max_tokens!r}")
        if len(tokens) + max_tokens > self.context_length:
            raise ContextLengthExceeded(
                field if len(tokens) >= self.context_length else "max_tokens",
                prompt_tokens=len(tokens),
                max_tokens=max_tokens,
                context_length=self.context_length,
            )
        return CompletionRequest(
            tokens=tokens,
            max_tokens=max_tokens,
            sampling=_sampling(temperature, top_p, seed),
            stop_strings=_stop(stop),
            namespace=self.client.namespace,
        )


class Stream:
    """The text of one generation as it is produced (an iterator of str); `completion`
    is the Completion once the iteration has ended. close() — or dropping the stream,
    e.g. by leaving a for loop over it early — stops the engine; a context manager."""

    def __init__(self, client: VaultClient, service: Service, req: CompletionRequest) -> None:
        self.completion: Completion | None = None
        self._client = client
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._ended = False
        # The job holds the queue and the event, never the stream, so dropping it cancels.
        client._submit(partial(_stream_job, service, req, self._events, self._cancel))
        with client._lock:
            client._streams.add(self)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        try:
            kind, value = self._events.get()
        except BaseException:  # e.g. Ctrl-C while waiting: stop the engine too
            self.cancel()
            raise
        if kind == "text":
            return value
        self._ended = True
        if kind == "error":
            raise value
        self.completion = value
        raise StopIteration

    def cancel(self) -> None:
        """Ask the engine to stop; the text so far stands, finish_reason "cancelled"."""
        self._cancel.set()

    def close(self) -> None:
        """Stop the generation and wait until the engine has let go of it."""
        self.cancel()
        with contextlib.suppress(Exception):  # its error, if any, was not asked for
            for _ in self:
                pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._cancel.set()


def _stream_job(
    service: Service,
    req: CompletionRequest,
    events: queue.SimpleQueue[tuple[str, Any]],
    cancel: threading.Event,
) -> None:
    """One stream on the engine thread: its text, then its Completion or its error."""
    try:
        done = service.complete(req, on_text=lambda d: events.put(("text", d)), cancel=cancel)
    except BaseException as e:  # every failure reaches the reader
        events.put(("error", e))
    else:
        events.put(("done", done))


def _token_ids(prompt: object) -> list[int]:
    if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
        raise InvalidRequest("prompt", "must be text or a sequence of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequest("prompt", "token ids must be ints")
    return list(prompt)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(name, f"must be a number, got {type(value).__name__}")
    return float(value)


def _sampling(temperature: float, top_p: float, seed: int) -> Sampling:
    t, p = _number("temperature", temperature), _number("top_p", top_p)
    if not 0.0 <= t <= MAX_TEMPERATURE:
        raise InvalidRequest("temperature", f"must be in [0, {MAX_TEMPERATURE}], got {t!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise InvalidRequest("seed", f"must be an int in [0, 2**63), got {seed!r}")
    return Sampling(temperature=t, top_p=p, seed=seed)  # checks top_p in (0, 1]


def _stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return stops
