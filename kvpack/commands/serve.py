"""`kvpack serve`: an OpenAI-compatible server whose prompt cache is the vault.

With no flags it runs the embedded default (SQLite and a local directory under the
data dir, the demo model). Storage comes from flags, else KVPACK_* environment
variables (AWS_* for S3), else the TOML file named by --config / KVPACK_CONFIG (see
kvpack/config.py). Before it listens it warms up (kvpack/service/warm.py: the restore
reserve mapped, the S3 client and a connection, a pooled catalog connection, one short
prefill, restore and decoded token on the engine thread, startup's objects frozen out of
the garbage collector) and fills the vault gauges once, so the first request after a restart costs
what the next ones do. When it listens it prints one line starting with
kvpack.server.app.READY, which `kvpack bench` waits for; /readyz answers only from then
on.

SIGTERM (or Ctrl-C) stops it gracefully: the listener closes, requests in flight and then
the publication queue get up to `drain_timeout_s` (KVPACK_DRAIN_TIMEOUT, 30 s) in all,
and what could not finish is logged with a count.

Every request but /healthz needs an API key (`kvpack api-keys create`), checked against
the catalog on each request. --no-auth serves anyone, in the default namespace, and is
refused unless --host is a loopback address.

Publication (kvpack/service/publication.py): every cold prefill's aligned cuts are held
resident at once and published durably once their request is served (at most
--publish-max-defer later); --no-publish (KVPACK_PUBLISH=false) publishes nothing.

The maintainer (kvpack/maintainer.py) keeps the vault while it serves: GC every
--gc-interval (evicting by tenant quotas and --store-budget, reclaiming chunks after
--gc-grace, one collector of a fleet at a time), and the gauges behind /metrics and the
status page at /.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import signal
import sys
import time
from typing import TYPE_CHECKING

from kvpack.commands.common import Subparsers, add_storage_arguments, settings_from_args
from kvpack.config import ConfigError, Settings
from kvpack.service.scheduler import DEFAULT_MAX_QUEUED  # stdlib only: no MLX at parse time

MAX_BODY_MIB = 8
# How long a thread running Python may keep the GIL while another waits for it (CPython's
# default: 5 ms). The server's threads hand it to each other all the time: the event loop,
# the engine, the store's reads and the chunks' opening. At 5 ms a first token waited
# 4-9 ms for the loop to send it while the engine built the next forward (traced), and a
# durable restore's threads waited alike; at 0.5 ms, on S3 + PostgreSQL at 256 tokens,
# the first request after a restart answered in 32-41 ms against 34-56 ms (docs/
# measurements.md).
SWITCH_INTERVAL_S = 0.0005

if TYPE_CHECKING:  # the service loads the engine: only when serving
    from kvpack.maintainer import Maintainer
    from kvpack.service.scheduler import Scheduler
    from kvpack.service.service import Service


def register(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API backed by the vault")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--model", default="smollm2",
                   help="tiny | smollm2 | model dir | .gguf | org/name[@revision] from the "
                        "local Hugging Face cache (never downloaded)")  # fmt: skip
    p.add_argument("--slots", type=int, default=1, help="engine slots per tenant")
    p.add_argument("--max-tokens", type=int, default=4096, help="ceiling on one completion")
    p.add_argument("--context-length", type=int, help="default: the model's configuration")
    p.add_argument("--resident-budget-mib", type=int, help="resident tier byte budget (MiB)")
    p.add_argument("--max-queued-per-tenant", type=int, default=DEFAULT_MAX_QUEUED,
                   help="requests one tenant may have queued or running; past it: 429 "
                        f"(default {DEFAULT_MAX_QUEUED})")  # fmt: skip
    p.add_argument("--max-body-mib", type=int, default=MAX_BODY_MIB,
                   help="largest request body read (MiB); a completion's limit is also "
                        f"derived from the context length (default {MAX_BODY_MIB})")  # fmt: skip
    p.add_argument("--no-auth", action="store_true",
                   help="no API keys: anyone may call (only with a loopback --host)")  # fmt: skip
    p.add_argument("--measure-restores", action="store_true",
                   help="record each restore's seconds, bytes and peak RSS added "
                   "(GET /v1/admin/restores; kvpack bench uses it)")  # fmt: skip
    p.add_argument("--store-budget", metavar="SIZE", help="vault byte budget, e.g. 50GiB")
    p.add_argument("--gc-interval", metavar="DURATION",
                   help="how often the maintainer collects (default 5m; 0: never)")  # fmt: skip
    p.add_argument("--gc-grace", metavar="DURATION",
                   help="how long an unreferenced chunk is kept (default 1h)")  # fmt: skip
    p.add_argument("--verify-interval", metavar="DURATION",
                   help="how often to verify manifests and sizes (default 0: never)")  # fmt: skip
    p.add_argument("--no-publish", action="store_true",
                   help="publish no cuts (reads still hit the vault): an A/B control")  # fmt: skip
    p.add_argument("--publish-max-defer", metavar="DURATION",
                   help="longest a durable cut waits for its request to be served "
                        "(default 30s)")  # fmt: skip
    add_storage_arguments(p)
    p.set_defaults(func=run)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: we cannot know where it resolves
        return False


def run(args: argparse.Namespace) -> int:
    from engine.errors import InvalidRequest
    from engine.models import ModelLoadError
    from kvpack.service.service import Service

    if args.max_queued_per_tenant < 1 or args.max_body_mib < 1:
        print("kvpack serve: --max-queued-per-tenant and --max-body-mib must be >= 1")
        return 2
    if args.no_auth and not is_loopback(args.host):
        print(f"kvpack serve: --no-auth serves anyone who can connect, so it needs a loopback "
              f"--host (127.0.0.1, ::1, localhost), not {args.host!r}")  # fmt: skip
        return 2
    try:
        settings = settings_from_args(
            args,
            store_budget=args.store_budget,
            gc_interval_s=args.gc_interval,
            gc_grace_s=args.gc_grace,
            verify_interval_s=args.verify_interval,
            publish=False if args.no_publish else None,
            publish_max_defer_s=args.publish_max_defer,
        )
    except (ConfigError, ValueError) as e:
        print(f"kvpack serve: {e}")
        return 2
    options = {}
    if args.resident_budget_mib is not None:
        options["resident_budget_bytes"] = args.resident_budget_mib * 1024 * 1024
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # before the service starts its threads
    print(f"kvpack serve: loading {args.model} ...", flush=True)
    try:
        service = Service.open(settings, model=args.model, num_slots=args.slots, **options)
    except (ModelLoadError, InvalidRequest) as e:
        print(f"kvpack serve: {e}")
        return 2
    if args.measure_restores:
        from kvpack.service.restores import RestoreMeter

        service.restores = RestoreMeter()
    deadline = Deadline(settings.drain_timeout_s)
    try:
        asyncio.run(_serve(service, settings, args, deadline))
    finally:
        left = service.close(timeout=deadline.left())
        if left:
            print(f"kvpack serve: {left} publication job(s) not finished within the drain "
                  f"timeout ({settings.drain_timeout_s:g}s); their cuts are lost, not "
                  "damaged", flush=True)  # fmt: skip
    return 0


def _warm(service: Service, scheduler: Scheduler) -> None:
    """Pay the first request's setup now, before the server listens (kvpack/service/warm.py),
    on the engine thread, where the requests will run: MLX streams are per thread."""
    from kvpack.service.warm import warm

    seconds = scheduler.call(lambda: warm(service))
    phases = ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items())
    print(f"kvpack serve: warm in {sum(seconds.values()):.2f} s ({phases})", flush=True)


def _fill_gauges(maintainer: Maintainer) -> bool:
    """The maintainer's first stats refresh, before the server listens (its queries' first
    use would otherwise land on the first requests); whether it worked."""
    try:
        maintainer.refresh()
    except Exception as e:  # noqa: BLE001 - best effort, as warming is: the loop retries
        print(f"kvpack serve: warm start: vault stats skipped: {type(e).__name__}: {e}",
              flush=True)  # fmt: skip
        return False
    return True


class Deadline:
    """The drain budget: started at SIGTERM (or on a failure), shared by the requests in
    flight and the publication queue."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._ends: float | None = None

    def start(self) -> None:
        if self._ends is None:
            self._ends = time.monotonic() + self.seconds

    def left(self) -> float:
        self.start()
        assert self._ends is not None
        return max(0.0, self._ends - time.monotonic())


async def _serve(
    service: Service, settings: Settings, args: argparse.Namespace, deadline: Deadline
) -> None:
    from catalog.db import redacted
    from kvpack.maintainer import Maintainer
    from kvpack.server.app import FRONT, READY, make_app, start
    from kvpack.server.auth import any_active_key, catalog_authenticator
    from kvpack.units import format_duration, format_size

    maintainer = Maintainer(
        vault=service.vault,
        quarantine=service.quarantine,
        accounting=service.accounting,
        budget_bytes=settings.store_budget,
        gc_interval_s=settings.gc_interval_s,
        grace_s=settings.gc_grace_s,
        quarantine_retention_s=settings.quarantine_retention_s,
        verify_interval_s=settings.verify_interval_s,
    )

    vault = service.vault
    app = make_app(
        service,
        authenticate=None
        if args.no_auth
        else catalog_authenticator(vault.db, breaker=vault.catalog_breaker),
        producer_key_path=settings.producer_key_path,
        drain_timeout_s=settings.drain_timeout_s,
        namespace=settings.namespace,
        context_length=args.context_length,
        max_tokens=args.max_tokens,
        max_queued_per_tenant=args.max_queued_per_tenant,
        max_body_bytes=args.max_body_mib * 1024 * 1024,
    )
    await asyncio.to_thread(_warm, service, app[FRONT].scheduler)
    refreshed = await asyncio.to_thread(_fill_gauges, maintainer)
    runner, url = await start(
        app, host=args.host, port=args.port, shutdown_timeout_s=settings.drain_timeout_s
    )
    maintainer.start(refreshed=refreshed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    loaded = service.loaded
    print(f"kvpack serve: model {loaded.name} ({loaded.num_params:,} parameters), "
          f"identity {loaded.identity.hex[:16]}, namespace {settings.namespace}")  # fmt: skip
    print(f"kvpack serve: data dir {settings.data_dir}")
    print(f"kvpack serve: store {settings.store_url}, catalog {redacted(settings.database_url)}")
    keys = service.vault.producer_keys
    peers = ", ".join(p.name for p in (service.remote.peers if service.remote else ())) or "none"
    print(f"kvpack serve: producer {keys.producer} (key {keys.current_id}), peers: {peers}")
    gc = (
        f"every {format_duration(settings.gc_interval_s)}, grace "
        f"{format_duration(settings.gc_grace_s)}"
        if settings.gc_interval_s
        else "off"
    )
    print(f"kvpack serve: budget {format_size(settings.store_budget)}, gc {gc}, "
          f"status page {url}/")  # fmt: skip
    if args.no_auth:
        print(f"kvpack serve: no API keys (--no-auth): whoever reaches {args.host} may call, "
              f"in namespace {settings.namespace}")  # fmt: skip
    else:
        print("kvpack serve: API keys required (Authorization: Bearer <key>)")
        if not await asyncio.to_thread(any_active_key, service.vault.db):
            print("kvpack serve: warning: no API key exists, so every request but /healthz "
                  "is refused; create one with `kvpack api-keys create --role tenant "
                  "--namespace NAME`")  # fmt: skip
    print(f"{READY}{url}", flush=True)
    try:
        await stop.wait()
    finally:
        deadline.start()
        print(f"kvpack serve: stopping: no new requests; draining for up to "
              f"{settings.drain_timeout_s:g}s", flush=True)  # fmt: skip
        maintainer.stop(timeout=0)  # no new pass starts; one in progress may finish
        await runner.cleanup()
        await asyncio.to_thread(maintainer.stop, deadline.left())
