"""The status page: GET / on `kvpack serve`, for an operator's browser (admin keys only,
kvpack/server/auth.py; a browser may send the key as the password of HTTP Basic auth).

It shows the model and identity, the tiers, the hit rate, each tenant's usage and
quota, the footprint against the budget, the last GC and verify, and a plot of recent
time to first token, cold (nothing restored) against warm. Every number it shows is read
from the service's Prometheus registry, the same one /metrics renders: an element of
class "m" names its metric (data-metric) and labels (data-labels, "k=v,..."), and shows
the sum of that metric's samples carrying those labels, exactly. The page is plain HTML
with an inline SVG plot: no script, nothing fetched from elsewhere; it reloads itself
every REFRESH_S seconds.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvpack.accounting.counters import HIT_TIERS, FirstToken
from kvpack.service.service import Service
from kvpack.units import format_size

STATUS = web.AppKey("status", Service)
REFRESH_S = 15
PLOT_W, PLOT_H, PAD = 640, 220, 36
MIN_SECONDS = 1e-4  # the plot's floor (log scale)
Samples = dict[str, list[tuple[dict[str, str], float]]]


def add_routes(app: web.Application, service: Service) -> None:
    app[STATUS] = service
    app.router.add_get("/", page)


async def page(request: web.Request) -> web.Response:
    service = request.app[STATUS]
    body = render(service, samples(service.accounting.registry))
    return web.Response(text=body, content_type="text/html", charset="utf-8")


def samples(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry by name (what /metrics renders, as numbers)."""
    out: Samples = defaultdict(list)
    for family in registry.collect():
        for s in family.samples:
            out[s.name].append((dict(s.labels), s.value))
    return out


def total(found: Samples, name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples that carry `labels`; None when there is none."""
    values = [v for ls, v in found.get(name, ()) if labels.items() <= ls.items()]
    return sum(values) if values else None


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else format(value, ".6g")


def metric(found: Samples, name: str, *, size: bool = False, **labels: str) -> str:
    """A cell showing a metric's value exactly (and, for bytes, in binary units)."""
    value = total(found, name, **labels)
    attrs = f'class="m" data-metric="{name}" data-labels="{_labels(labels)}"'
    if value is None:
        return f'<td {attrs} data-absent="1">-</td>'
    human = f" <small>{format_size(value)}</small>" if size else ""
    return f"<td><span {attrs}>{number(value)}</span>{human}</td>"


def render(service: Service, found: Samples) -> str:
    loaded = service.loaded
    hits = {t: total(found, "kvpack_hits_total", tier=t) or 0.0 for t in HIT_TIERS}
    misses = total(found, "kvpack_misses_total") or 0.0
    served = sum(hits.values()) + misses
    rate = f"{sum(hits.values()) / served:.4f}" if served else "-"
    remote = service.remote
    peers = ", ".join(p.name for p in remote.peers) if remote is not None else "none"
    tenants = sorted(
        {ls["namespace"] for name in ("kvpack_tenant_footprint_bytes", "kvpack_hits_total",
                                      "kvpack_misses_total")
         for ls, _ in found.get(name, ()) if "namespace" in ls}
    )  # fmt: skip
    rows = [
        f"<tr><th>{_e(ns)}</th>"
        + metric(found, "kvpack_tenant_footprint_bytes", size=True, namespace=ns)
        + metric(found, "kvpack_tenant_quota_bytes", size=True, namespace=ns)
        + metric(found, "kvpack_tenant_cuts", namespace=ns)
        + metric(found, "kvpack_hits_total", namespace=ns)
        + metric(found, "kvpack_misses_total", namespace=ns)
        + "</tr>"
        for ns in tenants
    ]
    footprint = total(found, "kvpack_vault_footprint_bytes")
    budget = total(found, "kvpack_vault_budget_bytes")
    use = (f"{100 * footprint / budget:.1f}% of the budget"
           if footprint is not None and budget else "no budget set")  # fmt: skip
    resident = service.resident
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_S}">
<title>kvpack: {_e(loaded.name)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0 1.5em; }}
th, td {{ text-align: left; padding: .2em .8em; border-bottom: 1px solid #ddd; }}
td .m, td.m {{ font-variant-numeric: tabular-nums; }}
small {{ color: #666; }} .cold {{ fill: #c0392b; }} .warm {{ fill: #2471a3; }}
</style></head><body>
<h1>kvpack</h1>
<table id="model">
<tr><th>model</th><td id="model-name">{_e(loaded.name)}</td></tr>
<tr><th>identity</th><td id="identity"><code>{loaded.identity.hex}</code></td></tr>
<tr><th>parameters</th><td>{loaded.num_params:,}</td></tr>
<tr><th>producer</th><td>{_e(service.vault.producer)}</td></tr>
</table>
<h2>Tiers</h2>
<table id="tiers">
<tr><th>tier</th><th>what</th><th>hits</th><th>restored tokens</th></tr>
<tr><th>session</th><td>{service.num_slots} slot(s) per tenant</td>
{metric(found, "kvpack_session_continuations_total")}<td>-</td></tr>
<tr><th>resident</th><td>{format_size(resident.resident_bytes)} held of
{format_size(resident.budget_bytes)}</td>
{metric(found, "kvpack_hits_total", tier="resident")}
{metric(found, "kvpack_restored_tokens_total", tier="resident")}</tr>
<tr><th>durable</th><td>the vault (catalog + object store)</td>
{metric(found, "kvpack_hits_total", tier="durable")}
{metric(found, "kvpack_restored_tokens_total", tier="durable")}</tr>
<tr><th>remote</th><td>peers: {_e(peers)}</td>
{metric(found, "kvpack_hits_total", tier="remote")}
{metric(found, "kvpack_restored_tokens_total", tier="remote")}</tr>
</table>
<table id="hits">
<tr><th>hit rate (hits / (hits + misses))</th><td id="hit-rate">{rate}</td></tr>
<tr><th>misses</th>{metric(found, "kvpack_misses_total")}</tr>
<tr><th>verification failures</th>{metric(found, "kvpack_verification_failures_total")}</tr>
<tr><th>cuts condemned</th>{metric(found, "kvpack_condemned_cuts_total")}</tr>
<tr><th>bytes served (manifests)</th>{metric(found, "kvpack_bytes_served_total", size=True)}</tr>
</table>
<h2>Vault</h2>
<table id="vault">
<tr><th>footprint</th>{metric(found, "kvpack_vault_footprint_bytes", size=True)}</tr>
<tr><th>budget</th>{metric(found, "kvpack_vault_budget_bytes", size=True)}</tr>
<tr><th>use</th><td id="budget-use">{use}</td></tr>
<tr><th>stored (sealed, pending too)</th>
{metric(found, "kvpack_vault_stored_bytes", size=True)}</tr>
<tr><th>cuts</th>{metric(found, "kvpack_vault_manifests")}</tr>
<tr><th>chunks</th>{metric(found, "kvpack_vault_chunks")}</tr>
<tr><th>dedup ratio (cut bytes / footprint)</th>{metric(found, "kvpack_vault_dedup_ratio")}</tr>
<tr><th>last GC</th><td>{_when(total(found, "kvpack_gc_last_run_timestamp_seconds"))}</td></tr>
<tr><th>last GC succeeded (1 = yes)</th>{metric(found, "kvpack_gc_last_success")}</tr>
<tr><th>last verify</th>
<td>{_when(total(found, "kvpack_verify_last_run_timestamp_seconds"))}</td></tr>
<tr><th>broken objects the last verify found</th>
{metric(found, "kvpack_verify_last_problems")}</tr>
</table>
<h2>Tenants</h2>
<table id="tenants">
<tr><th>namespace</th><th>footprint</th><th>quota</th><th>cuts</th><th>hits</th><th>misses</th></tr>
{"".join(rows)}
</table>
<h2>Time to first token</h2>
{plot(service.accounting.recent_first_tokens())}
</body></html>
"""


def plot(points: Iterable[FirstToken]) -> str:
    """An SVG scatter of recent first-token seconds (log scale), cold against warm."""
    points = list(points)
    if not points:
        return '<p id="ttft-empty">no requests yet</p>'
    seconds = [max(p.seconds, MIN_SECONDS) for p in points]
    lo, hi = math.log10(min(seconds)), math.log10(max(max(seconds), 10 * min(seconds)))
    span = max(hi - lo, 1e-9)
    step = (PLOT_W - 2 * PAD) / max(len(points) - 1, 1)
    dots = []
    for i, p in enumerate(points):
        y = math.log10(max(p.seconds, MIN_SECONDS))
        cy = PLOT_H - PAD - (y - lo) / span * (PLOT_H - 2 * PAD)
        kind = "cold" if p.tier == "none" else "warm"
        dots.append(
            f'<circle class="{kind}" data-tier="{p.tier}" data-seconds="{p.seconds:.6f}" '
            f'cx="{PAD + i * step:.1f}" cy="{cy:.1f}" r="3"><title>{p.tier}: '
            f"{p.seconds:.3f} s, {p.prompt_tokens} tokens</title></circle>"
        )
    return (
        f'<svg id="ttft" width="{PLOT_W}" height="{PLOT_H}" role="img" '
        f'aria-label="time to first token, cold and warm">'
        f'<text x="{PAD}" y="14">seconds (log), oldest to newest: '
        f'<tspan class="cold">cold</tspan> / <tspan class="warm">warm</tspan></text>'
        f'<text x="2" y="{PAD}">{10**hi:.3g}s</text>'
        f'<text x="2" y="{PLOT_H - PAD}">{10**lo:.3g}s</text>' + "".join(dots) + "</svg>"
    )


def _labels(labels: Mapping[str, str]) -> str:
    return _e(",".join(f"{k}={v}" for k, v in sorted(labels.items())))


def _when(ts: float | None) -> str:
    if ts is None:
        return "never"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _e(text: str) -> str:
    return html.escape(text, quote=True)
