"""kvpack's HTTP front: an OpenAI-compatible API over one Service (aiohttp).

- the event loop never blocks: a completion body's size is checked before it is read
  (the Content-Length, then while reading; the limit follows from the context length and
  the longest token), and parsing, validation, chat templating and tokenizing run on the
  parser threads; every other blocking call leaves the loop through asyncio.to_thread.
- scheduler: the one engine thread (kvpack/service/scheduler.py). Requests queue per
  tenant and the tenants take turns one engine step at a time; a tenant past its bound
  is answered 429 with Retry-After.
- job: one request on the engine thread. The service hands over drawn tokens and text as
  they are generated (a stop string ends the generation there); they travel to the event
  loop through an asyncio.Queue via loop.call_soon_threadsafe. Its cancel Event is set
  when the client goes away or the server shuts down.
- first chunk: a stream's first text is written before the engine goes on: the engine
  thread waits (at most FIRST_CHUNK_WAIT_S) until the loop has sent it. Otherwise the
  next token's forward pass, built in Python, holds the interpreter lock while the loop
  waits for it, and the first token leaves milliseconds after it was drawn (docs/
  measurements.md, *the first token's way out*).

Routes: POST /v1/chat/completions and /v1/completions (SSE when `stream`), GET /v1/models,
/healthz (liveness), /readyz (readiness: each dependency, 503 when one is down), /metrics
(Prometheus), /v1/economics, and the status page at / (kvpack/server/status.py). Each
completion says which tier served it: the `kvpack` object in the body (for a stream: in
the chunk with the finish reason) and, when not streaming, X-Kvpack-Tier /
X-Kvpack-Restore-Seconds headers.

Who may call what, and in which tenant namespace a completion runs, is
kvpack/server/auth.py's: every request but /healthz and /readyz carries an API key
unless the app is built without an authenticator (anonymous: the front's default
namespace). /healthz shows activity (requests in flight, the publication queue) only to
an admin key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import hdrs, web

from engine.errors import InvalidRequest
from engine.sampling import Drawn
from engine.tokenizer import Tokenizer
from kvpack.server import admin, auth, peers, status
from kvpack.server.bodies import read_body
from kvpack.server.errors import ApiError
from kvpack.server.fields import parse_json
from kvpack.server.openai import ApiRequest, Envelope, Kind, Limits, headers, parse_request, sse
from kvpack.service.scheduler import DEFAULT_MAX_QUEUED, Scheduler, SchedulerClosed, TenantBusy
from kvpack.service.service import Completion, CompletionRequest, Service

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS_LIMIT = 4096
DEFAULT_CONTEXT_LENGTH = 4096  # when the model's config does not say
DISCONNECT_POLL_S = 0.5
MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 15.0  # /readyz answers within this even when a dependency hangs
PARSER_THREADS = 2
READY = "kvpack serve: ready at "  # the line `kvpack serve` prints once it listens
FIRST_CHUNK_WAIT_S = 0.005  # the most the engine waits for a stream's first chunk to leave


class Job:
    """One request on the engine thread, and the queue its events arrive on."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, stream: bool) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancel = threading.Event()
        self.finished = False
        self.first_sent = threading.Event()  # the first chunk is out; at once if not streamed
        if not stream:
            self.first_sent.set()

    # -- engine side ---------------------------------------------------------------------
    def on_text(self, delta: str) -> None:
        self._post(("text", delta))
        if not self.first_sent.is_set():  # the first chunk (see the module words)
            self.first_sent.wait(FIRST_CHUNK_WAIT_S)

    def on_token(self, drawn: Drawn) -> None:
        self._post(("token", drawn))

    def done(self, completion: Completion | None, error: BaseException | None) -> None:
        self._post(("error", error) if error is not None else ("done", completion))

    def _post(self, event: tuple[str, Any]) -> None:
        # A closed loop (RuntimeError) means nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    # -- loop side -----------------------------------------------------------------------
    async def next_event(self, request: web.Request) -> tuple[str, Any]:
        """The next event; a client that went away cancels the job (we still wait for it)."""
        while True:
            # Checked before every event, not only when idle: tokens may arrive faster
            # than the poll interval for as long as the generation runs.
            if request.transport is None or request.transport.is_closing():
                self.cancel.set()
            try:
                event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                continue
            self.finished = event[0] in ("done", "error")
            return event


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one token's text has (special tokens included)."""
    return max(len(tokenizer.decode([i]).encode()) for i in range(tokenizer.vocab_size))


class Front:
    """Everything the handlers share: the service, the engine thread, the limits."""

    def __init__(
        self,
        service: Service,
        *,
        namespace: str | None = None,
        context_length: int | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS_LIMIT,
        max_queued_per_tenant: int = DEFAULT_MAX_QUEUED,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        loaded = service.loaded
        self.service = service
        self.tokenizer = loaded.tokenizer
        self.namespace = namespace or loaded.identity.components.get("namespace", "default")
        if context_length is None:
            args = getattr(loaded.model, "args", None)
            context_length = getattr(args, "max_position_embeddings", None)
        context_length = context_length or DEFAULT_CONTEXT_LENGTH
        max_prompt_chars = context_length * longest_token_bytes(self.tokenizer)
        self.limits = Limits(
            model=loaded.name,
            context_length=context_length,
            max_tokens=min(max_tokens, context_length),
            vocab_size=service.tenant(self.namespace).pool.vocab_size,
            max_prompt_chars=max_prompt_chars,
        )
        # The largest completion body a prompt that fits can need: each character of it
        # escaped (\\u00XX), plus each message's keys; past it the body is not read.
        self.body_limit = min(max_body_bytes, 8 * max_prompt_chars + 64 * context_length + 65536)
        self.max_body_bytes = max_body_bytes
        self.fingerprint = f"kvpack-{loaded.identity.hex[:12]}"
        self.scheduler = Scheduler(max_queued=max_queued_per_tenant)
        self.parsers = ThreadPoolExecutor(PARSER_THREADS, thread_name_prefix="kvpack-parse")
        self.jobs: set[Job] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def parse(self, kind: Kind, request: web.Request) -> ApiRequest:
        raw = await read_body(request, limit=self.body_limit)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.parsers, self._parse, kind, raw)

    def _parse(self, kind: Kind, raw: bytes) -> ApiRequest:
        return parse_request(
            kind,
            parse_json(raw),
            limits=self.limits,
            chat_tokens=self._chat_tokens,
            encode=self.tokenizer.encode,
        )

    def _chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template(messages)
        except ValueError as e:  # ChatTemplateError: these messages do not fit the template
            raise ApiError(400, str(e), param="messages") from None

    def submit(self, api: ApiRequest, *, namespace: str) -> Job:
        req = CompletionRequest(
            tokens=api.tokens,
            max_tokens=api.max_tokens,
            sampling=api.sampling,
            stop_strings=api.stop,
            namespace=namespace,
            top_logprobs=api.top_logprobs,
        )
        job = Job(asyncio.get_running_loop(), stream=api.stream)
        streamed = api.stream and api.top_logprobs is not None

        def start() -> Any:
            return self.service.steps(
                req,
                on_text=job.on_text,
                on_token=job.on_token if streamed else None,
                cancel=job.cancel,
            )

        try:
            self.scheduler.submit(namespace, start, job.done)
        except TenantBusy as e:
            raise ApiError(429, str(e), code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after_s)}) from None  # fmt: skip
        except SchedulerClosed:
            raise ApiError(503, "the server is shutting down", code="shutting_down") from None
        self.jobs.add(job)
        self._idle.clear()
        return job

    def done(self, job: Job) -> None:
        self.jobs.discard(job)
        if not self.jobs:
            self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for the requests in flight to finish; cancel the
        rest and return how many there were (0: all finished)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        left = list(self.jobs)
        for job in left:
            job.cancel.set()
        return len(left)

    def envelope(self, api: ApiRequest) -> Envelope:
        return Envelope(api.kind, api.model, self.fingerprint, decode=self.tokenizer.decode)


FRONT = web.AppKey("front", Front)


def worker_error(e: BaseException) -> ApiError:
    if isinstance(e, InvalidRequest):  # e.g. a namespace or state the engine refuses
        return ApiError(400, str(e), param=e.field)
    log.error("completion failed", exc_info=e)
    return ApiError(500, f"the completion failed: {type(e).__name__}: {e}", code="internal")


async def _complete(request: web.Request, kind: Kind) -> web.StreamResponse:
    front = request.app[FRONT]
    api = await front.parse(kind, request)
    namespace = auth.completion_namespace(request[auth.PRINCIPAL], front.namespace)
    job = front.submit(api, namespace=namespace)
    try:
        if api.stream:
            return await _stream(request, front, job, api)
        while True:
            event, value = await job.next_event(request)
            if event == "error":
                raise worker_error(value)
            if event == "done":
                body = front.envelope(api).full(value)
                return web.json_response(body, headers=headers(value))
    finally:
        if not job.finished:  # the handler was cancelled (shutdown): stop the worker too
            job.cancel.set()
        front.done(job)


async def _stream(
    request: web.Request, front: Front, job: Job, api: ApiRequest
) -> web.StreamResponse:
    envelope = front.envelope(api)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    first = True
    drawn: list[Drawn] | None = [] if api.top_logprobs is not None else None
    try:
        while True:
            event, value = await job.next_event(request)
            if event == "token":
                assert drawn is not None
                drawn.append(value)
                continue
            if event == "error":
                if first:  # nothing sent yet: a proper error status is still possible
                    raise worker_error(value)
                await response.write(sse({"error": worker_error(value).body()["error"]}))
                break
            if first:
                await response.prepare(request)
            if event == "text":
                await response.write(sse(envelope.chunk(value, first=first, drawn=drawn)))
                job.first_sent.set()
                drawn = [] if drawn is not None else None
                first = False
                continue
            completion: Completion = value
            if first:
                await response.write(sse(envelope.chunk("", first=True)))
            await response.write(sse(envelope.last_chunk(completion, drawn)))
            if api.include_usage:
                await response.write(sse(envelope.usage_chunk(completion)))
            await response.write(sse("[DONE]"))
            break
        await response.write_eof()
    except ConnectionResetError:  # the client went away mid-stream
        job.cancel.set()
    finally:
        job.first_sent.set()  # whatever happened, the engine waits for nothing more
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "completion")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[FRONT])]})


async def model(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    if request.match_info["model"] != front.limits.model:
        raise ApiError(404, f"model {request.match_info['model'][:80]!r} does not exist",
                       param="model", code="model_not_found")  # fmt: skip
    return web.json_response(_model_card(front))


def _model_card(front: Front) -> dict[str, Any]:
    return {
        "id": front.limits.model,
        "object": "model",
        "created": 0,
        "owned_by": "kvpack",
        "context_length": front.limits.context_length,
        "identity": front.service.loaded.identity.hex,
    }


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the loop answers. Activity only for an admin key (or anonymous mode)."""
    front = request.app[FRONT]
    body: dict[str, Any] = {
        "status": "ok",
        "model": front.limits.model,
        "identity": front.service.loaded.identity.hex,
        "namespace": front.namespace,
    }
    principal = await auth.optional_principal(request)
    if principal is not None and principal.role == "admin":
        body["requests_in_flight"] = len(front.jobs)
        body["requests_queued"] = front.scheduler.pending()
        body["publication"] = _publication(front.service)
    return web.json_response(body)


def _publication(service: Service) -> dict[str, int] | None:
    """The publication queues (queued, done, failed, dropped), when it has them."""
    publication = getattr(service, "publication", None)
    return publication.stats() if publication is not None else None


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the engine thread, the catalog and the object store each answer; 503
    when one does not (a load balancer then sends traffic elsewhere)."""
    front = request.app[FRONT]
    vault = front.service.vault
    checks = {"catalog": vault.check_catalog, "object_store": vault.check_store}
    names = list(checks)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(asyncio.to_thread(checks[n]) for n in names)), READY_TIMEOUT_S
        )
    except TimeoutError:
        results = [{"up": False, "detail": f"no answer within {READY_TIMEOUT_S} s"}] * len(names)
    report = dict(zip(names, results, strict=True))
    report["engine"] = {"up": front.scheduler.alive, "queued": front.scheduler.pending()}
    ready = all(r["up"] for r in report.values())
    body = {"status": "ready" if ready else "unavailable", "dependencies": report}
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[FRONT].service.accounting.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def economics(request: web.Request) -> web.Response:
    # Off the loop: the ledger is read from the catalog (SQL), not from the engine.
    return web.json_response(await asyncio.to_thread(request.app[FRONT].service.economics))


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal leaves as an OpenAI error body, routing errors included; so does an
    unexpected failure (a 500 is a bug, but never an HTML page)."""
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = f"{request.method} {request.path[:200]}: {e.reason}"
        allow = {hdrs.ALLOW: e.headers[hdrs.ALLOW]} if hdrs.ALLOW in e.headers else None
        return web.json_response(ApiError(e.status, message).body(), status=e.status,
                                 headers=allow)  # fmt: skip
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001 - logged; the client gets JSON, not HTML
        log.error("%s %s failed", request.method, request.path[:200], exc_info=e)
        error = ApiError(500, f"internal error: {type(e).__name__}", code="internal")
        return web.json_response(error.body(), status=500)


def make_app(
    service: Service,
    *,
    authenticate: auth.Authenticator | None,
    producer_key_path: Path | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    **front_options: Any,
) -> web.Application:
    """The aiohttp application over `service`; the caller opens and closes the service.
    `authenticate` checks every request's API key; None serves everyone anonymously.
    Peer export (kvpack/server/peers.py) and admin routes (kvpack/server/admin.py) ride
    along; key rotation only when `producer_key_path` says where the rotated keys are
    saved. On shutdown (the runner's cleanup: the listener is closed first) requests in
    flight get up to `drain_timeout_s` to finish; what is left is cancelled and logged."""
    front = Front(service, **front_options)
    # openai_errors comes first, so it wraps (and renders) the auth middleware's refusals.
    middlewares = [openai_errors, auth.middleware(authenticate)]
    app = web.Application(middlewares=middlewares, client_max_size=front.max_body_bytes)
    app[FRONT] = front
    app[auth.AUTHENTICATOR] = auth.KeyCheck(authenticate)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/v1/economics", economics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    peers.add_routes(app, service.exporter)
    admin.add_routes(app, service, producer_key_path)
    status.add_routes(app, service)

    async def drain_jobs(_app: web.Application) -> None:
        left = await front.drain(drain_timeout_s)
        if left:
            log.warning("shutdown: %d request(s) still in flight after %gs, cancelled",
                        left, drain_timeout_s)  # fmt: skip

    async def stop_worker(_app: web.Application) -> None:
        await asyncio.to_thread(front.scheduler.close)
        front.parsers.shutdown(wait=False, cancel_futures=True)

    app.on_shutdown.append(drain_jobs)
    app.on_cleanup.append(stop_worker)
    return app


async def start(
    app: web.Application, *, host: str, port: int, shutdown_timeout_s: float = 60.0
) -> tuple[web.AppRunner, str]:
    """Listen on host:port (0 picks a free port); returns the runner and the base URL.
    The runner's cleanup waits up to `shutdown_timeout_s` for handlers to return."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]  # the real port when port was 0
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return runner, f"http://{shown}:{bound[1]}"
