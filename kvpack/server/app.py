"""kvpack's HTTP front: an OpenAI-compatible API over one Service (aiohttp).

- worker: the one thread that runs Service.complete (the engine is synchronous and not
  thread-safe); requests queue for it in arrival order.
- job: one request on the worker. The service hands over text as it is generated (a
  stop string ends the generation there); it travels to the event loop through an
  asyncio.Queue via loop.call_soon_threadsafe. Its cancel Event is set when the client
  goes away or the server shuts down.

Routes: POST /v1/chat/completions and /v1/completions (SSE when `stream`), GET /v1/models,
/healthz, /metrics (Prometheus), /v1/economics, and the status page at /
(kvpack/server/status.py). Each completion says which tier served it: the `kvpack` object
in the body (for a stream: in the chunk with the finish reason) and, when not streaming,
X-Kvpack-Tier / X-Kvpack-Restore-Seconds headers.

Who may call what, and in which tenant namespace a completion runs, is kvpack/auth.py's:
every request but /healthz carries an API key unless the app is built without an
authenticator (anonymous: the front's default namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.errors import InvalidRequest
from engine.sampling import Sampling
from kvpack.server import admin, auth, peers, status
from kvpack.server.openai import (
    ApiError,
    ApiRequest,
    Envelope,
    Kind,
    Limits,
    headers,
    parse_json,
    parse_request,
    sse,
)
from kvpack.service.service import Completion, CompletionRequest, Service

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS_LIMIT = 4096
DEFAULT_CONTEXT_LENGTH = 4096  # when the model's config does not say
DISCONNECT_POLL_S = 0.5
MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
READY = "kvpack serve: ready at "  # the line `kvpack serve` prints once it listens


class Job:
    """One request on the worker thread, and the queue its events arrive on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancel = threading.Event()
        self.finished = False

    # -- worker side ---------------------------------------------------------------------
    def run(self, service: Service, req: CompletionRequest) -> None:
        try:
            completion = service.complete(req, on_text=self._on_text, cancel=self.cancel)
        except BaseException as e:  # every failure must reach the waiting handler
            self._post(("error", e))
        else:
            self._post(("done", completion))

    def _on_text(self, delta: str) -> None:
        self._post(("text", delta))

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
            self.finished = event[0] != "text"
            return event


class Front:
    """Everything the handlers share: the service, its one worker, the limits."""

    def __init__(
        self,
        service: Service,
        *,
        namespace: str | None = None,
        context_length: int | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS_LIMIT,
    ) -> None:
        loaded = service.loaded
        self.service = service
        self.tokenizer = loaded.tokenizer
        self.namespace = namespace or loaded.identity.components.get("namespace", "default")
        if context_length is None:
            args = getattr(loaded.model, "args", None)
            context_length = getattr(args, "max_position_embeddings", None)
        context_length = context_length or DEFAULT_CONTEXT_LENGTH
        self.limits = Limits(
            model=loaded.name,
            context_length=context_length,
            max_tokens=min(max_tokens, context_length),
        )
        self.fingerprint = f"kvpack-{loaded.identity.hex[:12]}"
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpack-engine")
        self.jobs: set[Job] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def parse(self, kind: Kind, raw: bytes) -> ApiRequest:
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
            raise ApiError(422, str(e), param="messages") from None

    def submit(self, api: ApiRequest, *, namespace: str) -> Job:
        req = CompletionRequest(
            tokens=api.tokens,
            max_tokens=api.max_tokens,
            sampling=Sampling(temperature=api.temperature, top_p=api.top_p, seed=api.seed),
            stop_strings=api.stop,
            namespace=namespace,
        )
        job = Job(asyncio.get_running_loop())
        self.jobs.add(job)
        self._idle.clear()
        self.worker.submit(job.run, self.service, req)
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


FRONT = web.AppKey("front", Front)


def worker_error(e: BaseException) -> ApiError:
    if isinstance(e, InvalidRequest):  # e.g. token ids outside the vocabulary
        return ApiError(422, str(e), param=e.field)
    log.error("completion failed", exc_info=e)
    return ApiError(500, f"the completion failed: {type(e).__name__}: {e}", code="internal")


async def _complete(request: web.Request, kind: Kind) -> web.StreamResponse:
    front = request.app[FRONT]
    api = front.parse(kind, await request.read())
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
                body = Envelope(kind, api.model, front.fingerprint).full(value)
                return web.json_response(body, headers=headers(value))
    finally:
        if not job.finished:  # the handler was cancelled (shutdown): stop the worker too
            job.cancel.set()
        front.done(job)


async def _stream(
    request: web.Request, front: Front, job: Job, api: ApiRequest
) -> web.StreamResponse:
    envelope = Envelope(api.kind, api.model, front.fingerprint)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    first = True
    try:
        while True:
            event, value = await job.next_event(request)
            if event == "error":
                if first:  # nothing sent yet: a proper error status is still possible
                    raise worker_error(value)
                await response.write(sse({"error": worker_error(value).body()["error"]}))
                break
            if first:
                await response.prepare(request)
            if event == "text":
                await response.write(sse(envelope.chunk(value, first=first)))
                first = False
                continue
            completion: Completion = value
            if first:
                await response.write(sse(envelope.chunk("", first=True)))
            await response.write(sse(envelope.last_chunk(completion)))
            if api.include_usage:
                await response.write(sse(envelope.usage_chunk(completion)))
            await response.write(sse("[DONE]"))
            break
        await response.write_eof()
    except ConnectionResetError:  # the client went away mid-stream
        job.cancel.set()
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
        raise ApiError(404, f"model {request.match_info['model']!r} does not exist",
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
    front = request.app[FRONT]
    return web.json_response(
        {
            "status": "ok",
            "model": front.limits.model,
            "identity": front.service.loaded.identity.hex,
            "namespace": front.namespace,
            "requests_in_flight": len(front.jobs),
            "publication": _publication(front.service),
        }
    )


def _publication(service: Service) -> dict[str, int] | None:
    """The background worker's queue (queued, done, failed, dropped), when it has one."""
    background = getattr(service, "background", None)
    return background.stats() if background is not None else None


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[FRONT].service.accounting.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def economics(request: web.Request) -> web.Response:
    # Off the loop: the ledger is read from the catalog (SQL), not from the engine.
    return web.json_response(await asyncio.to_thread(request.app[FRONT].service.economics))


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal leaves as an OpenAI error body, routing errors included."""
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = f"{request.method} {request.path}: {e.reason}"
        return web.json_response(ApiError(e.status, message).body(), status=e.status)


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
    # openai_errors comes first, so it wraps (and renders) the auth middleware's refusals.
    middlewares = [openai_errors, auth.middleware(authenticate)]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    front = app[FRONT] = Front(service, **front_options)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/v1/economics", economics)
    app.router.add_get("/healthz", healthz)
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
        await asyncio.to_thread(front.worker.shutdown, wait=True)

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
